"""The training loop, top to bottom: set-up, data, model, optimizer, resume, then per step
batch -> forward/backward over micro-batches -> clip -> guard -> optimizer step -> log/eval/checkpoint."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from data.corpus import ensure_builtin
from data.loader import BatchLoader
from data.shards import ShardSet
from data.stream import BatchWithPositions, TokenStream
from trainer import checkpoint, fault, host, parallel
from trainer.config import Config, ConfigError, micro_batch_size, validate
from trainer.config import save as save_config
from trainer.cost import cost_report, format_cost
from trainer.metrics import BREAKDOWN, MetricsLog, StepTimer, format_breakdown, memory_mb, peak_flops
from trainer.model import ModelArgs, Transformer
from trainer.profiling import StepProfiler


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr over warmup_steps, then cosine decay to train.min_lr at train.steps."""
    t = cfg.train
    if step <= t.warmup_steps:
        return t.lr * step / max(t.warmup_steps, 1)
    progress = (step - t.warmup_steps) / max(t.steps - t.warmup_steps, 1)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms); the fused kernel per dist.fused_adamw."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": True} if parallel.use_fused_adamw(cfg.dist, device) else (
        {"foreach": True} if cfg.dist.fused_adamw == "foreach" else {})
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), **impl)


def open_dataset(cfg: Config, info: parallel.DistInfo) -> ShardSet:
    path = cfg.data.path or str(ensure_builtin(cfg.model.vocab_size, cfg.data.builtin_mb,
                                               cfg.data.cache_dir or None, progress=info.is_main))
    shards = ShardSet(path)
    if shards.manifest.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"config key 'model.vocab_size' ({cfg.model.vocab_size}) is smaller than the dataset's "
            f"tokenizer vocabulary ({shards.manifest.vocab_size}) in {path}"
        )
    return shards


Micro = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # tokens, RoPE positions, loss mask


def micro_batches(batch: torch.Tensor | BatchWithPositions, size: int, cfg: Config,
                  device: torch.device) -> list[Micro]:
    """Split a loader batch into micro-batches of (tokens, positions or None, loss mask or None),
    keeping only what data.reset_positions / data.mask_boundary_loss ask for."""
    if isinstance(batch, torch.Tensor):
        return [(m, None, None) for m in batch.to(device).split(size)]
    tokens = batch.tokens.to(device).split(size)
    positions = batch.positions.to(device).split(size) if cfg.data.reset_positions else [None] * len(tokens)
    masks = batch.loss_mask.to(device).split(size) if cfg.data.mask_boundary_loss else [None] * len(tokens)
    return list(zip(tokens, positions, masks, strict=True))


@torch.no_grad()
def evaluate(model, stream: TokenStream, cfg: Config, info: parallel.DistInfo, micro_batch: int) -> float:
    """Mean held-out loss over all targets (never masked, so runs with and without the mask compare)."""
    model.eval()
    total = 0.0
    for j in range(cfg.train.eval_batches):
        batch = stream.val_batch(j).to(info.device)
        for micro in batch.split(micro_batch):
            positions = stream.positions(micro) if cfg.data.reset_positions else None
            with parallel.autocast(cfg.dist, info):
                total += model(micro[:, :-1], positions, targets=micro[:, 1:]).item() * len(micro)
    model.train()
    n = cfg.train.eval_batches * stream.local_batch
    return parallel.all_reduce_mean([total / n], info)[0]


def train(cfg: Config) -> dict:
    """Run (or resume) the training job described by cfg; returns the final summary.

    Raises fault.Preempted after committing an emergency checkpoint when SIGTERM arrives."""
    fault.die_with_launcher()
    if cfg.dist.tune_malloc:
        host.tune_malloc()
    info = parallel.init_distributed(cfg.dist)
    heartbeat, preemption = fault.Heartbeat(info.rank), fault.PreemptionFlag()
    try:
        return _train(cfg, info, heartbeat, preemption)
    finally:
        preemption.close()
        heartbeat.close()
        parallel.shutdown()


def _train(cfg: Config, info: parallel.DistInfo, heartbeat: fault.Heartbeat,
           preemption: fault.PreemptionFlag) -> dict:
    validate(cfg, info.world)
    t, ck = cfg.train, cfg.checkpoint
    micro_batch = micro_batch_size(cfg, info.world)
    accum = t.global_batch // (micro_batch * info.world)
    run_dir = Path(cfg.run.dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    say = (lambda msg: print(f"[rekindle] {msg}", flush=True)) if info.is_main else (lambda msg: None)

    # --- data
    shards = open_dataset(cfg, info)
    stream = TokenStream(shards, cfg.model.seq_len, t.global_batch, cfg.data.seed, info.rank, info.world,
                         cfg.data.val_fraction)
    loader = BatchLoader(stream, cfg.data.num_workers,
                         with_positions=cfg.data.reset_positions or cfg.data.mask_boundary_loss)
    entropy = shards.manifest.stats.get("unigram_entropy_nats", float("nan"))
    say(f"data {shards.root}: {len(shards):,} tokens, {stream.n_train:,} train / {stream.n_val:,} held-out "
        f"samples, unigram entropy {entropy:.3f} nats")
    evaluating = t.eval_batches > 0 and stream.n_val > 0
    if not evaluating:
        say("no evaluation: " + ("data.val_fraction=0 holds out no samples" if stream.n_val == 0
                                 else "train.eval_batches=0"))

    # --- model (same seed on every rank: identical full weights before sharding)
    torch.manual_seed(cfg.run.seed)
    model = Transformer(ModelArgs(**asdict(cfg.model)))
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    model = parallel.parallelize(model, cfg.dist, info)
    optimizer = build_optimizer(model, cfg, info.device)
    peak, peak_source = peak_flops(info.device, cfg.log.peak_tflops)
    say(f"model {n_params / 1e6:.2f}M params, {flops_per_token / 1e6:.1f} MFLOPs/token | world {info.world} "
        f"({info.backend}, {parallel.compute_dtype(cfg.dist, info.device)}) | global batch {t.global_batch} "
        f"= {info.world} ranks x {accum} micro x {micro_batch} | peak {peak / 1e9:,.0f} GFLOP/s ({peak_source})")

    # --- resume
    on_commit = (lambda step: fault.append_event(run_dir, "commit", step=step)) if info.is_main else None
    ckpt = checkpoint.Checkpointer(cfg.checkpoint_dir, info, ck.keep, ck.keep_every, ck.async_, on_commit)
    state = checkpoint.TrainState(world=info.world, config_sha256=cfg.sha256())
    heartbeat.beat("load", t_load=time.time())
    if ck.resume == "never" and (existing := ckpt.list_committed()):
        raise checkpoint.CheckpointError(
            f"checkpoint.resume=never, but {cfg.checkpoint_dir} holds committed step(s) {existing}: set another "
            "checkpoint.dir (or run.dir), or delete them to start over")
    if ck.resume != "never":
        latest = ckpt.discover_latest()
        if latest is None and ck.resume == "required":
            raise checkpoint.CheckpointError(
                f"checkpoint.resume=required but no usable committed checkpoint in {cfg.checkpoint_dir}")
        if latest is not None:
            state = ckpt.load(latest, model, optimizer)
            loader.load_state_dict(state.data or {})
            say(f"resumed from step {state.step} ({checkpoint.step_dir(cfg.checkpoint_dir, latest)}, "
                f"saved by {state.world} rank(s))")
        else:
            say(f"no committed checkpoint in {cfg.checkpoint_dir}: starting fresh")
    heartbeat.beat("loaded", step=state.step, t_loaded=time.time(), resumed_step=state.step)

    # --- loop
    metrics = MetricsLog(cfg.run.dir, t.steps, state.step, info.is_main, cfg.log.progress, cfg.log.tensorboard)
    comm = parallel.CommTimer() if parallel.CommTimer.enabled_for(info) else None
    timer = StepTimer(info.device, comm)
    profiler = StepProfiler(cfg.profile.steps, cfg.run.dir, info.rank, info.device)
    profiler.maybe_start(state.step + 1)
    data_wait_total = 0.0
    tokens_per_step = t.global_batch * cfg.model.seq_len
    bad_steps, skipped_total, loss_sum, window_start, window_steps, data_wait = 0, 0, 0.0, time.perf_counter(), 0, 0.0
    eval_loss, run_start, start_step = float("nan"), time.perf_counter(), state.step
    model.train()
    busy_s = 0.0  # time spent in training steps this attempt (goodput's numerator)
    while state.step < t.steps:
        step = state.step + 1
        fault.inject_faults(step, info.rank)
        data_start = time.perf_counter()
        micros = micro_batches(next(loader), micro_batch, cfg, info.device)
        data_wait += time.perf_counter() - data_start
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        timer.start()
        step_loss = torch.zeros((), device=info.device)
        for i, (micro, positions, mask) in enumerate(micros):
            parallel.set_gradient_sync(model, i == len(micros) - 1)
            with parallel.autocast(cfg.dist, info):
                loss = model(micro[:, :-1], positions, targets=micro[:, 1:], mask=mask) / len(micros)
            loss.backward()
            step_loss += loss.detach()
        timer.mark()  # forward + backward done
        # foreach=True: FSDP2's DTensor gradients would otherwise be clipped one parameter at a time
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"), foreach=True)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)

        if math.isfinite(grad_norm):  # the norm is global: every rank takes the same branch
            optimizer.step()
            bad_steps = 0
        else:
            bad_steps += 1
            skipped_total += 1
            metrics.event(f"step {step}: non-finite loss/gradient (norm {grad_norm}); step skipped "
                          f"({bad_steps}/{t.max_bad_steps} in a row)")
            if bad_steps >= t.max_bad_steps:
                raise NonFiniteError(f"{bad_steps} steps in a row had a non-finite loss or gradient "
                                     f"(last at step {step}); lower train.lr or check the data")
        optimizer.zero_grad(set_to_none=True)
        timer.mark()  # optimizer done
        state.step, state.tokens_seen = step, state.tokens_seen + tokens_per_step
        ckpt.poll()  # completes (or fails loudly) a background save once every rank has written it
        busy_s += time.perf_counter() - data_start
        heartbeat.beat("train", step=step, busy_s=busy_s, steps_run=step - start_step)
        if step == start_step + 1:  # start-up is over: hangs from here on should fail fast
            parallel.set_collective_timeout(cfg.fault.collective_timeout_s, info)
            if cfg.dist.tune_malloc and info.device.type == "cpu":
                host.huge_pages_for_heap()  # the heap has its steady size now: back it with 2 MiB pages
        loss_sum += float(step_loss)
        window_steps += 1
        metrics.step(step)

        is_last = step == t.steps
        evaluated = evaluating and ((t.eval_every and step % t.eval_every == 0) or is_last)
        if evaluated:
            heartbeat.beat("eval")
            eval_loss = evaluate(model, stream, cfg, info, micro_batch)
        if step % t.log_every == 0 or is_last or (t.eval_every and step % t.eval_every == 0):
            elapsed = time.perf_counter() - window_start
            parts = timer.window()  # per-step seconds of this rank; averaged over ranks below
            data_wait_total += data_wait
            loss_mean, wait, *means = parallel.all_reduce_mean(
                [loss_sum / window_steps, data_wait, *parts.values()], info)
            parts = dict(zip(parts, means, strict=True))
            tokens_per_s = tokens_per_step * window_steps / elapsed
            record = {
                "step": step, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                "mfu": flops_per_token * tokens_per_s / (peak * info.world) if peak else 0.0,
                "mem_mb": memory_mb(info.device), "step_time_s": elapsed / window_steps,
                "data_wait_s": wait / window_steps, **parts, "tokens": state.tokens_seen,
                "skipped_steps": skipped_total, "time": time.time(),
            }
            # other: eval, checkpoint, logging and Python between the measured phases
            record["other_s"] = max(record["step_time_s"] - sum(record.get(k) or 0.0 for k in BREAKDOWN[:-1]), 0.0)
            if evaluated:
                record["eval_loss"] = eval_loss
            metrics.log(record)
            loss_sum, window_steps, data_wait, window_start = 0.0, 0, 0.0, time.perf_counter()
        saved = (ck.every and step % ck.every == 0) or is_last
        if saved:
            heartbeat.beat("save")
            state.data = loader.state_dict()
            path = ckpt.save(state, model, optimizer, blocking=is_last or not ck.async_)  # the last one: sync
            metrics.event(f"[rekindle] checkpoint step {step} -> {path} ({ckpt.last_blocking_s:.2f}s blocking)")
        if not is_last and preemption.requested(info.world, info.device):
            heartbeat.beat("preempt")
            if saved:
                ckpt.wait()  # an async save of this very step: let it commit
            else:
                state.data = loader.state_dict()
                ckpt.save(state, model, optimizer, blocking=True)
            loader.close()
            ckpt.close()
            metrics.close()
            say(f"SIGTERM: emergency checkpoint of step {step} committed; exiting with code {fault.EXIT_PREEMPTED}")
            raise fault.Preempted(step)
        heartbeat.beat("train")
        trace = profiler.after_step(step)
        if trace is not None:
            metrics.event(f"[rekindle] profiler trace of steps {cfg.profile.steps} -> {trace}")
    trace = profiler.stop()  # a range past the last step ends with the run
    if trace is not None:
        metrics.event(f"[rekindle] profiler trace -> {trace}")
    loader.close()
    ckpt.wait()
    ckpt.close()
    metrics.close()
    if comm is not None:
        comm.close()

    wall = time.perf_counter() - run_start
    steps_done = state.step - start_step
    summary = {"steps": state.step, "steps_this_run": steps_done, "wall_s": wall, "eval_loss": eval_loss,
               "unigram_entropy": entropy, "tokens_per_s": tokens_per_step * steps_done / wall if wall else 0.0}
    # where the time went, per step, over this process's steps (rank means)
    n = max(timer.totals["steps"], 1)
    totals = parallel.all_reduce_mean([data_wait_total / n, timer.totals["fwd_bwd_s"] / n,
                                       timer.totals["optim_s"] / n, timer.totals["comm_wait_s"] / n], info)
    breakdown = dict(zip(BREAKDOWN[:4], totals, strict=True))
    if comm is None:
        breakdown.pop("comm_wait_s")
    breakdown["step_time_s"] = wall / max(steps_done, 1)
    breakdown["other_s"] = max(breakdown["step_time_s"] - sum(v for k, v in breakdown.items() if k != "step_time_s"),
                               0.0)
    summary["breakdown"] = breakdown
    say(f"done: {steps_done} steps in {wall:.1f}s ({summary['tokens_per_s']:,.0f} tok/s) | "
        + (f"final eval loss {eval_loss:.3f} nats vs unigram entropy {entropy:.3f} nats" if evaluating
           else "no evaluation"))
    say(f"time per step: {format_breakdown(breakdown)}")
    if cfg.log.cost_per_device_hour:
        summary["cost"] = cost_report(info.world, wall, tokens_per_step * steps_done, 0.0, cfg.log.cost_per_device_hour)
        say(f"{format_cost(summary['cost'])} ({info.world} device(s), this process's {wall:.1f}s)")
    return summary
