"""The training run, top to bottom: `train()` builds the run, resumes it, then loops
`train_step` -> `after_step` until the last step, and finishes with a summary. Each component decides
when it acts (the evaluator, the metrics log, the checkpointer); teardown happens once, in `train`'s
`finally`. The step itself is trainer.step; the components are in their own modules."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from data.corpus import ensure_builtin
from data.loader import BatchLoader
from data.shards import ShardSet
from data.stream import TokenStream
from trainer import storage
from trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointStorageError,
    TrainState,
    memory_auto,
    step_dir,
)
from trainer.checkpoint import memory as memory_tier
from trainer.config import Config, ConfigError, micro_batch_size, resume_rules, validate
from trainer.config import save as save_config
from trainer.distributed import parallel
from trainer.evaluate import Evaluator
from trainer.model.transformer import Transformer
from trainer.observability import logs, wandb_log
from trainer.observability.cost import cost_report, format_cost
from trainer.observability.metrics import (
    BREAKDOWN,
    LogWindow,
    MetricsLog,
    PendingRecords,
    RecordDraft,
    StepTimer,
    format_breakdown,
    memory_mb,
    peak_flops,
    with_other,
)
from trainer.observability.profiling import StepProfiler
from trainer.observability.stragglers import Change, StragglerWatch
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.runtime import fault, host, protocol
from trainer.runtime.lease import DirectoryInUse, Lease
from trainer.step import NonFiniteGuard, StepResult, micro_batches, train_step

log = logs.get_logger()


@dataclass
class Run:
    """Everything one training process holds: `build` makes the components, `resume` the start state
    and the per-step ones (which need the start step)."""

    cfg: Config
    info: parallel.DistInfo
    heartbeat: protocol.Heartbeat
    preemption: fault.PreemptionFlag
    stalls: storage.StallWatch  # bounds the waits on storage (storage.stall_s)
    shards: ShardSet
    loader: BatchLoader
    evaluator: Evaluator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer
    micro_batch: int
    flops_per_token: float
    peak_flops: float
    state: TrainState = field(default_factory=TrainState)
    metrics: MetricsLog | None = None  # from here on: made by `resume`, once the start step is known
    timer: StepTimer | None = None
    window: LogWindow | None = None
    comm: parallel.CommTimer | None = None
    profiler: StepProfiler | None = None
    guard: NonFiniteGuard | None = None
    stragglers: StragglerWatch | None = None
    records: PendingRecords | None = None  # log records waiting for the other ranks' numbers
    memory: memory_tier.MemoryTier | None = None  # checkpoint.memory_every > 0 (or auto, and it fits)
    auto_measure: memory_auto.Measure | None = None  # memory_every=auto: the first steps, until it settles
    resumed_tier: str = "none"  # where the start state came from: memory-local | memory-peer | durable | none
    restored_records: list[RecordDraft] = field(default_factory=list)  # unwritten at the memory snapshot
    start_step: int = 0
    started: float = 0.0
    busy_s: float = 0.0  # time spent in training steps this attempt (goodput's numerator)
    eval_loss: float = float("nan")
    closed: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.model.seq_len


def train(cfg: Config) -> dict:
    """Run (or resume) the training job described by cfg; returns the final summary.

    Raises fault.Preempted after committing an emergency checkpoint when SIGTERM arrives."""
    fault.die_with_launcher()
    if cfg.dist.tune_malloc:
        host.tune_malloc()
    storage.bound_requests(cfg.storage.timeout_s)
    info = parallel.init_distributed(cfg.dist)
    logs.setup(rank=info.rank, verbose=info.is_main)
    heartbeat, preemption, run = protocol.Heartbeat(info.rank), fault.PreemptionFlag(), None
    stalls = storage.StallWatch(cfg.storage.stall_s, fault.storage_stalled)
    leases: list[Lease] = []
    try:
        with stalls.guard("taking the leases on run.dir and checkpoint.dir", cfg.checkpoint_dir):
            leases = hold_directories(cfg, info)
        run = build(cfg, info, heartbeat, preemption, stalls)
        resume(run)
        while run.state.step < cfg.train.steps:
            step_start = time.perf_counter()
            micros, data_wait = next_batch(run)
            result = train_step(run.model, run.optimizer, micros, cfg, info, run.timer,
                                fault.slowdown(run.state.step + 1, info.rank))
            after_step(run, result, step_start, data_wait)
        return finish(run)
    finally:
        try:
            if run is not None:
                release(run, clean=False)  # a no-op after finish() or an emergency checkpoint
        finally:
            release_leases(leases)
            stalls.close()
            preemption.close()
            heartbeat.close()
            parallel.shutdown()


# ---------------------------------------------------------------------- build
def hold_directories(cfg: Config, info: parallel.DistInfo) -> list[Lease]:
    """Rank 0 takes the leases on run.dir and the checkpoint directory for this job (trainer.runtime.lease);
    every rank raises the same error when it cannot: DirectoryInUse, naming the holder, when another live
    job holds one; CheckpointStorageError when the storage cannot be reached."""
    if not cfg.run.lease_s:
        return []
    leases, refused = [], None
    if info.is_main:
        try:
            for directory in dict.fromkeys([cfg.run.dir, cfg.checkpoint_dir]):
                where = f"checkpoint storage {directory}" if directory == cfg.checkpoint_dir else directory
                with storage.unreachable_as(CheckpointStorageError, f"cannot reach {where}"):
                    lease = Lease(directory, cfg.run.lease_s, on_lost=fault.lease_lost)
                    taken = lease.acquire()
                leases.append(lease)
                if taken:
                    holder, why = taken
                    log.warning("took over the lease on %s from %s: %s", directory, holder.describe(), why)
                    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
                    protocol.append_event(cfg.run.dir, "lease_taken", directory=directory, job=holder.job,
                                          host=holder.host, pid=holder.pid, why=why)
        except (DirectoryInUse, CheckpointStorageError) as e:
            refused = (type(e), str(e))
        except Exception as e:  # noqa: BLE001 - said on every rank below (no rank left waiting)
            refused = (CheckpointError, f"taking the lease on {cfg.checkpoint_dir}: {type(e).__name__}: {e}")
    refused = parallel.broadcast_object(refused, info)  # (the error class travels by name, as pickle does)
    if refused:
        release_leases(leases)
        error, message = refused
        raise error(message)
    return leases


def release_leases(leases: list[Lease], timeout_s: float = 10.0) -> None:
    """Remove this job's leases (best effort, bounded: storage that stopped answering must not keep the
    run from ending; a lease left behind is taken over by the next job)."""
    def release() -> None:
        for lease in leases:
            try:
                lease.release()
            except Exception as e:  # noqa: BLE001
                log.warning("could not release the lease %s: %s: %s", lease.url, type(e).__name__, e)

    if leases:
        releasing = threading.Thread(target=release, name="lease-release", daemon=True)
        releasing.start()
        releasing.join(timeout_s)
        if releasing.is_alive():
            log.warning("the leases were not released within %.0fs: the next job takes them over", timeout_s)


def open_dataset(cfg: Config, info: parallel.DistInfo, stalls: storage.StallWatch) -> ShardSet:
    path = cfg.data.path or str(ensure_builtin(cfg.model.vocab_size, cfg.data.builtin_mb,
                                               cfg.data.cache_dir or None, progress=info.is_main))
    with stalls.guard("opening the dataset", path):
        shards = ShardSet(path)
    if shards.manifest.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"config key 'model.vocab_size' ({cfg.model.vocab_size}) is smaller than the dataset's "
            f"tokenizer vocabulary ({shards.manifest.vocab_size}) in {path}"
        )
    return shards


def build(cfg: Config, info: parallel.DistInfo, heartbeat: protocol.Heartbeat,
          preemption: fault.PreemptionFlag, stalls: storage.StallWatch) -> Run:
    """Data, model (sharded), optimizer and checkpointer; says what was built."""
    validate(cfg, info.world)
    t = cfg.train
    micro_batch = micro_batch_size(cfg, info.world)
    run_dir = Path(cfg.run.dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    shards = open_dataset(cfg, info, stalls)
    stream = TokenStream(shards, cfg.model.seq_len, t.global_batch, cfg.data.seed, info.rank, info.world,
                         cfg.data.val_fraction)
    stall = cfg.storage.stall_s  # the stall watch names a storage that stopped answering; the loader's own
    loader = BatchLoader(stream, cfg.data.num_workers,  # timeout (lost workers) comes after it
                         with_positions=cfg.data.reset_positions or cfg.data.mask_boundary_loss,
                         timeout_s=stall + 30.0 if stall else 0.0)
    entropy = shards.manifest.stats.get("unigram_entropy_nats", float("nan"))
    log.info("data %s: %s tokens, %s train / %s held-out samples, unigram entropy %.3f nats",
             shards.root, f"{len(shards):,}", f"{stream.n_train:,}", f"{stream.n_val:,}", entropy)
    evaluator = Evaluator(stream, cfg, info, micro_batch)
    if not evaluator.enabled:
        log.info("no evaluation: %s", evaluator.why_not)

    torch.manual_seed(cfg.run.seed)  # the same on every rank: identical full weights before sharding
    model = Transformer(cfg.model)
    if cfg.model.init_from:
        init_from_hf(model, cfg)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    model = parallel.parallelize(model, cfg.dist, info)
    optimizer = build_optimizer(model, cfg, info.device)
    peak, peak_source = peak_flops(info.device, cfg.log.peak_tflops)
    accum = t.global_batch // (micro_batch * info.world)
    log.info("model %.2fM params, %.1f MFLOPs/token | world %d (%s, %s) | global batch %d = %d ranks x %d micro "
             "x %d | peak %s GFLOP/s (%s)", n_params / 1e6, flops_per_token / 1e6, info.world, info.backend,
             parallel.compute_dtype(cfg.dist, info.device), t.global_batch, info.world, accum, micro_batch,
             f"{peak / 1e9:,.0f}", peak_source)

    ck = cfg.checkpoint
    on_event = (lambda name, **fields: protocol.append_event(run_dir, name, **fields)) if info.is_main else None
    on_commit = (lambda step: on_event("commit", step=step)) if on_event else None
    checkpointer = Checkpointer(cfg.checkpoint_dir, info, ck.keep, ck.keep_every, ck.async_, on_commit,
                                every=ck.every, max_failed_saves=ck.max_failed_saves, on_event=on_event,
                                stalls=stalls, fmt=ck.format)
    state = TrainState(world=info.world, config_sha256=cfg.sha256(), model=asdict(cfg.model), config=cfg.to_dict())
    run = Run(cfg, info, heartbeat, preemption, stalls, shards, loader, evaluator, model, optimizer, checkpointer,
              micro_batch, flops_per_token, peak, state)
    start_memory_tier(run)
    return run


def start_memory_tier(run: Run) -> None:
    """The memory tier per checkpoint.memory_every (`auto`: trainer.checkpoint.memory_auto), said in one
    start-up line (collective: the run's record and the ranks' decisions)."""
    cfg, info, ck = run.cfg, run.info, run.cfg.checkpoint
    if not ck.memory_every:
        return
    directory = ck.memory_dir or memory_tier.default_dir()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world))
    record = memory_tier.run_record(cfg.run.dir, info.is_main, info.world)
    identity = memory_tier.config_identity(run.state.config)
    several_nodes = info.world > local_world and ck.memory_replicas
    every, why = memory_auto.choose(ck.memory_every, directory, memory_auto.snapshot_bytes(run.model),
                                    memory_tier.SLOTS * (2 if several_nodes else 1), local_world,
                                    memory_auto.kept_choice(record, identity))
    every, why = memory_auto.agree(every, why, info.world)
    if every == 0:
        log.info("memory tier: off (checkpoint.memory_every=auto): %s", why)
        return
    run.memory = memory_tier.MemoryTier(
        directory, record["run_id"], identity, info.rank, info.world, every or 1, cfg.run.dir,
        on_failure=lambda error: log.warning("memory snapshot failed (training goes on; the durable tier and "
                                             "older snapshots stay): %s", error),
        local_world=local_world, replicas=ck.memory_replicas)
    how_often = ""
    if every is None:
        run.auto_measure = memory_auto.Measure(on_cpu=info.device.type == "cpu")
        how_often = (f"auto: every step while the first {memory_auto.MEASURED_STEPS} steps are timed, then every "
                     f"n steps, the fewest at which a snapshot costs at most {memory_auto.COST_SHARE:.0%} of them")
    elif ck.memory_every == "auto":
        how_often = f"auto: every {every} step(s), as this run chose at its first start"
    log.info("memory tier: %s", run.memory.describe(how_often))


def measure_memory_tier(run: Run, step_s: float) -> None:
    """checkpoint.memory_every=auto, the first steps: time them and their snapshots, then settle on the
    interval (collective, at the same step on every rank), say it and keep it in run.dir."""
    measure, memory = run.auto_measure, run.memory
    measure.note(step_s, memory.call_s, memory.waited_s, memory.write_s)
    if not measure.due():
        return
    memory.every, cost_s, step_s = measure.settle(run.info.world)
    run.auto_measure = None
    log.info("memory tier: auto chose every %d step(s): a snapshot costs %.2f ms, a step takes %.1f ms (at most "
             "%.0f%% of the steps it covers)", memory.every, cost_s * 1e3, step_s * 1e3,
             memory_auto.COST_SHARE * 100)
    if run.info.is_main:
        memory_auto.keep_choice(run.cfg.run.dir, memory.config_sha256, memory.every)


def init_from_hf(model: Transformer, cfg: Config) -> None:
    """The full model's weights from a Hugging Face Llama directory (every rank, before sharding); a
    resume then loads its checkpoint over them. HFModelError (bad input) when the shape is not this one."""
    from trainer.model import hf

    directory = cfg.model.init_from
    weights, config = hf.read_hf_llama(directory)
    model.load_state_dict(hf.from_hf_state_dict(weights, config, cfg.model, storage.join(directory, hf.CONFIG)))
    log.info("model weights from %s (Hugging Face Llama)", directory)


# ---------------------------------------------------------------------- resume
def resume(run: Run) -> None:
    """Load the newest usable checkpoint (per checkpoint.resume), then start the per-step components."""
    cfg, info, root = run.cfg, run.info, run.cfg.checkpoint_dir
    mode = cfg.checkpoint.resume
    run.heartbeat.beat("load", t_load=time.time())
    if mode == "never" and (existing := run.checkpointer.list_committed()):
        raise CheckpointError(
            f"checkpoint.resume=never, but {root} holds committed step(s) {existing}: set another "
            "checkpoint.dir (or run.dir), or delete them to start over")
    with run.stalls.guard("resuming from a checkpoint", root):
        latest = run.checkpointer.discover_latest() if mode != "never" else None
        parts = run.memory.scan() if run.memory is not None and mode != "never" else {}
        in_memory, givers = run.memory.plan(parts) if run.memory is not None and mode != "never" else (None, {})
        why = tier_choice(run, in_memory, latest)
        if in_memory is not None and (latest is None or in_memory > latest):
            load_snapshot(run, in_memory, givers, parts, durable=latest)
        elif latest is None and mode == "required":
            raise CheckpointError(f"checkpoint.resume=required but no usable committed checkpoint in {root}")
        elif latest is not None:
            load_checkpoint(run, latest)
            if run.memory is not None:
                log.info("memory tier not used: %s", why)
        elif mode != "never":
            log.info("no committed checkpoint in %s: starting fresh", root)
    run.heartbeat.beat("loaded", step=run.state.step, t_loaded=time.time(), resumed_step=run.state.step,
                       resumed_tier=run.resumed_tier, tier_why=why[:200])

    t = cfg.train
    run.metrics = MetricsLog(cfg.run.dir, t.steps, run.state.step, info.is_main, cfg.log.progress,
                             cfg.log.tensorboard, t.log_every, t.eval_every,
                             wandb_log.start(cfg, run.state.step) if info.is_main else None)
    run.comm = parallel.CommTimer() if parallel.CommTimer.enabled_for(info) else None
    run.timer = StepTimer(info.device, run.comm)
    run.profiler = StepProfiler(cfg.profile.steps, cfg.run.dir, info.rank, info.device)
    run.profiler.maybe_start(run.state.step + 1)
    run.guard = NonFiniteGuard(t.max_bad_steps)
    run.window = LogWindow(run.timer)
    run.records = PendingRecords(lambda values: parallel.all_gather_rows(values, info),
                                 lambda draft, parts: write_record(run, draft, parts), run.restored_records)
    run.stragglers = StragglerWatch(cfg.fault.straggler_factor, cfg.fault.straggler_s)
    run.start_step, run.started = run.state.step, time.perf_counter()
    run.model.train()


def tier_choice(run: Run, in_memory: int | None, durable: int | None) -> str:
    """Why the state comes from the tier it comes from (for the log and the ledger's resume event); ''
    with the memory tier off."""
    newest = "none" if durable is None else f"step {durable}"
    if run.memory is None:
        return ""
    if in_memory is not None and (durable is None or in_memory > durable):
        return f"memory snapshot of step {in_memory} is newer than the newest durable checkpoint ({newest})"
    if in_memory is not None:
        return f"the newest snapshot every rank has (step {in_memory}) is not newer than the durable {newest}"
    seen = f" (on rank {run.info.rank}'s node: {run.memory.skipped[0]})" if run.memory.skipped else ""
    return f"no memory snapshot that every rank has{seen}"


def load_checkpoint(run: Run, step: int) -> None:
    """Load committed `step` into the run, once its config passes `resume_rules` (before any tensor
    is read); list the settings this run changed, in the log and the ledger."""
    cfg, path, changed = run.cfg, step_dir(run.cfg.checkpoint_dir, step), {}

    def check(saved: TrainState) -> None:
        changed.update(resume_rules.check_resume(saved.config, saved.model, cfg.to_dict(), path))

    run.state = run.checkpointer.load(step, run.model, run.optimizer, check=check)
    run.resumed_tier = "durable"
    run.loader.load_state_dict(run.state.data or {})
    log.info("resumed from step %d (%s, saved by %d rank(s))", run.state.step, path, run.state.world)
    if changed:
        log.info("settings changed since that checkpoint: %s", resume_rules.describe(changed))
        if run.info.is_main:
            protocol.append_event(cfg.run.dir, "config_changed", step=run.state.step,
                                  changes={key: list(values) for key, values in changed.items()})
    adopt_config(run)  # the next checkpoint records this run's settings


def adopt_config(run: Run) -> None:
    """The loaded train state takes this run's config, model arguments and config hash."""
    cfg = run.cfg
    run.state.config, run.state.model, run.state.config_sha256 = cfg.to_dict(), asdict(cfg.model), cfg.sha256()


def load_snapshot(run: Run, step: int, givers: dict[int, int], parts: dict, durable: int | None) -> None:
    """Restore this rank's part of memory snapshot `step` (same run, config and world size: nothing to
    check or reshard), sent by the rank holding it when its own node does not have it (collective)."""
    moved = sorted(rank for rank, giver in givers.items() if giver != rank)
    run.state = run.memory.load(*run.memory.fetch(step, givers, parts), run.model, run.optimizer)
    run.restored_records = [RecordDraft.from_json(d) for d in run.memory.restored_extra.get("records", [])]
    adopt_config(run)  # a snapshot is of this very config (config_sha256 less where memory lives): not kept
    run.resumed_tier = "memory-peer" if moved else "memory-local"
    run.loader.load_state_dict(run.state.data or {})
    sent = f"; the part(s) of rank(s) {moved} sent by the rank(s) holding them" if moved else ""
    log.info("resumed from step %d (memory snapshot in %s%s; newest durable checkpoint: %s)", run.state.step,
             run.memory.dir, sent, "none" if durable is None else f"step {durable}")


# ---------------------------------------------------------------------- the step and what follows it
def next_batch(run: Run) -> tuple[list, float]:
    """The next batch as micro-batches, and the seconds spent waiting for it; sets this step's lr."""
    step = run.state.step + 1
    fault.inject_faults(step, run.info.rank)
    start = time.perf_counter()
    with run.stalls.guard("waiting for training data", run.shards.root):
        batch = next(run.loader)
    micros = micro_batches(batch, run.micro_batch, run.cfg, run.info.device)
    data_wait = time.perf_counter() - start
    set_lr(run.optimizer, lr_at(step, run.cfg))
    return micros, data_wait


def after_step(run: Run, result: StepResult, step_start: float, data_wait: float) -> None:
    """Account for the step, then evaluate, log, save and honour a preemption, each when it is due."""
    cfg, info, state = run.cfg, run.info, run.state
    step = state.step + 1
    run.guard.check(step, result)
    state.step, state.tokens_seen = step, state.tokens_seen + run.tokens_per_step
    run.checkpointer.poll()  # completes (or fails loudly) a background save once every rank has written it
    run.busy_s += time.perf_counter() - step_start
    if step == run.start_step + 1:  # start-up is over: hangs from here on should fail fast
        parallel.set_collective_timeout(cfg.fault.collective_timeout_s, info)
        # The heap has its steady size now: back it with 2 MiB pages. Not after a restart: the collapse
        # (about a second per few hundred MB, on the training thread) would add to every recovery.
        if cfg.dist.tune_malloc and info.device.type == "cpu" and protocol.attempt() == 0:
            host.huge_pages_for_heap()
    run.window.add(float(result.loss), data_wait)
    run.metrics.step(step)

    evaluated = run.evaluator.due(step)
    if evaluated:
        run.heartbeat.beat("eval")
        run.eval_loss = run.evaluator.run(run.model)
    if run.metrics.should_log(step):
        log_record(run, step, result, evaluated)
    exchange_records(run, step)
    final = step == cfg.train.steps
    saved = run.checkpointer.should_save(step, final)
    if saved:
        run.heartbeat.beat("save")
        state.data = run.loader.state_dict()
        path = run.checkpointer.save(state, run.model, run.optimizer, blocking=final or not cfg.checkpoint.async_,
                                     required=final)
        if path is not None:  # else: a periodic save failed, and said so
            log.info("checkpoint step %d -> %s (%.2fs blocking)", step, path, run.checkpointer.last_blocking_s)
    if run.memory is not None and run.memory.due(step) and not final:
        state.data = run.loader.state_dict()
        run.memory.snapshot(state, run.model, run.optimizer, records=run.records.unwritten())
        if run.auto_measure is not None:
            measure_memory_tier(run, time.perf_counter() - step_start)
    # The step is reported done (the launcher counts lost steps from it) once its snapshot is under way:
    # a failure in the bookkeeping before it would otherwise redo a step that had been reported.
    run.heartbeat.beat("train", step=step, busy_s=run.busy_s, steps_run=step - run.start_step)
    if run.preemption.agreed(step, info.world, info.device, last=final):
        emergency_checkpoint(run, saved)
    trace = run.profiler.after_step(step)
    if trace is not None:
        log.info("profiler trace of steps %s -> %s", cfg.profile.steps, trace)


def log_record(run: Run, step: int, result: StepResult, evaluated: bool) -> None:
    """Close the log window: its metrics.jsonl record is written once the other ranks' numbers are in
    (`exchange_records`: means over ranks, each rank's own work, straggler scores)."""
    fields = {"lr": lr_at(step, run.cfg), "grad_norm": result.grad_norm, "mem_mb": memory_mb(run.info.device),
              "tokens": run.state.tokens_seen, "skipped_steps": run.guard.total, "time": time.time()}
    if evaluated:
        fields["eval_loss"] = run.eval_loss
    window = run.window.close()
    run.records.add(RecordDraft(step, window, fields, first=step - window.steps <= run.start_step))
    run.window.restart()


def write_record(run: Run, draft: RecordDraft, parts: dict) -> None:
    """Rank 0 writes the record of a closed window, given the ranks' numbers (`ClosedWindow.means`)."""
    if draft.restored and draft.step <= run.metrics.logged_through:
        return  # restored from a memory snapshot, and written by the attempt that took it
    f = draft.fields
    tokens_per_s = run.tokens_per_step / parts["step_time_s"]
    mfu = run.flops_per_token * tokens_per_s / (run.peak_flops * run.info.world) if run.peak_flops else 0.0
    record = {"step": draft.step, "lr": f["lr"], "grad_norm": f["grad_norm"], "tokens_per_s": tokens_per_s,
              "mfu": mfu, "mem_mb": f["mem_mb"], **parts, "tokens": f["tokens"], "skipped_steps": f["skipped_steps"],
              "time": f["time"]}
    if "eval_loss" in f:
        record["eval_loss"] = f["eval_loss"]
    if run.stragglers.enabled:
        scores, changes = run.stragglers.update(parts["rank_work_s"], draft.window.steps, draft.window.elapsed_s,
                                                judged=not draft.first)
        record["straggler_score"] = [round(score, 3) for score in scores]
        record["stragglers"] = sorted(run.stragglers.flagged)
        for change in changes:
            report_straggler(run, draft.step, change)
    run.metrics.log(record)


def exchange_records(run: Run, step: int, now: bool = False) -> None:
    """Exchange the closed log windows' numbers between the ranks and write their records (collective:
    every rank, every step boundary, deciding alike). A blocking gather per log step cost more than the
    rest of a small step's bookkeeping, so the ranks exchange them at the preemption check steps only
    (about every 0.25 s on fast steps, every step on slow ones: trainer.runtime.fault), asynchronously: a check
    writes the records sent at the previous one. `now`, and at a step whose state may be committed to
    the durable tier at this boundary (`commits_at`), every record is written before going on: a step
    that is not redone after a failure must have its record on disk before its checkpoint is (a memory
    snapshot carries the unwritten ones instead). The time this takes is not counted in the current log
    window."""
    now = now or run.info.world == 1 or commits_at(run, step)
    if not (now or run.preemption.checks_at(step)):
        return
    start = time.perf_counter()
    run.records.receive()  # sent at the previous check: finished since
    run.records.send()
    if now or run.preemption.blocking:
        run.records.receive()
    run.window.started += time.perf_counter() - start


def commits_at(run: Run, step: int) -> bool:
    """Whether the state of `step` may be committed to the durable tier at this boundary: a checkpoint
    save, the end of the run (the emergency checkpoint writes the pending records itself). A memory
    snapshot carries the records not written yet instead (`RecordDraft`)."""
    final = step == run.cfg.train.steps
    return final or run.checkpointer.should_save(step, final)


def report_straggler(run: Run, step: int, change: Change) -> None:
    """Say once (rank 0: log and ledger) that a rank became a straggler, or stopped being one."""
    if not run.info.is_main:
        return
    f = run.cfg.fault
    what = (f"rank {change.rank} {'is a straggler' if change.status == 'slow' else 'is no longer a straggler'}: "
            f"{change.time_s:.4f}s of its own work per step over the last {change.period_s:.0f}s, "
            f"{change.score:.2f}x the other ranks' median {change.others_s:.4f}s "
            f"(fault.straggler_factor={f.straggler_factor:g})")
    (log.warning if change.status == "slow" else log.info)("step %d: %s", step, what)
    protocol.append_event(run.cfg.run.dir, "straggler", rank=change.rank, status=change.status, step=step,
                          score=round(change.score, 3), work_s=round(change.time_s, 6),
                          others_median_s=round(change.others_s, 6), period_s=round(change.period_s, 3),
                          factor=f.straggler_factor)


def emergency_checkpoint(run: Run, saved: bool) -> None:
    """SIGTERM reached some rank: commit this step (or let its async save commit), then stop."""
    exchange_records(run, run.state.step, now=True)  # the records, before the checkpoint
    run.heartbeat.beat("preempt", signalled=run.preemption.received)  # the launcher names the rank that got it
    if saved:
        run.checkpointer.wait()  # an async save of this very step: let it commit
    if not saved or run.checkpointer.failed_in_a_row:  # not saved, or that save failed: this one must not
        run.state.data = run.loader.state_dict()
        run.checkpointer.save(run.state, run.model, run.optimizer, blocking=True, required=True)
    release(run)
    log.info("SIGTERM: emergency checkpoint of step %d committed; exiting with code %d", run.state.step,
             protocol.EXIT_PREEMPTED)
    raise fault.Preempted(run.state.step)


# ---------------------------------------------------------------------- finish and teardown
def finish(run: Run) -> dict:
    """The last async save committed, everything closed; the run summary (collective), said on rank 0."""
    trace = run.profiler.stop()  # a range past the last step ends with the run
    if trace is not None:
        log.info("profiler trace -> %s", trace)
    run.checkpointer.wait()
    if run.memory is not None:
        run.memory.close(remove=True)  # the run is over: its snapshots go
    release(run)
    cfg, info = run.cfg, run.info
    wall = time.perf_counter() - run.started
    steps_done = run.state.step - run.start_step
    tokens = run.tokens_per_step * steps_done
    entropy = run.shards.manifest.stats.get("unigram_entropy_nats", float("nan"))
    summary = {"steps": run.state.step, "steps_this_run": steps_done, "wall_s": wall, "eval_loss": run.eval_loss,
               "unigram_entropy": entropy, "tokens_per_s": tokens / wall if wall else 0.0,
               "breakdown": run_breakdown(run, wall / max(steps_done, 1))}
    log.info("done: %d steps in %.1fs (%s tok/s) | %s", steps_done, wall, f"{summary['tokens_per_s']:,.0f}",
             f"final eval loss {run.eval_loss:.3f} nats vs unigram entropy {entropy:.3f} nats"
             if run.evaluator.enabled else "no evaluation")
    log.info("time per step: %s", format_breakdown(summary["breakdown"]))
    if cfg.log.cost_per_device_hour:
        summary["cost"] = cost_report(info.world, wall, tokens, 0.0, cfg.log.cost_per_device_hour)
        log.info("%s (%d device(s), this process's %.1fs)", format_cost(summary["cost"]), info.world, wall)
    return summary


def run_breakdown(run: Run, step_time_s: float) -> dict[str, float]:
    """Where the time went, per step, over this process's steps (means over ranks; collective)."""
    totals, n = run.timer.totals, max(run.timer.totals["steps"], 1)
    means = parallel.all_reduce_mean([run.window.data_wait_total / n, totals["fwd_bwd_s"] / n,
                                      totals["optim_s"] / n, totals["comm_wait_s"] / n], run.info)
    breakdown = dict(zip(BREAKDOWN[:4], means, strict=True))
    if run.comm is None:
        breakdown.pop("comm_wait_s")
    return with_other({**breakdown, "step_time_s": step_time_s})


def release(run: Run, clean: bool = True) -> None:
    """Close what the run holds, once: loader workers, the checkpointer (after an error, not waiting
    for a background save: its peers may be gone), files, the progress bar, the collective timer."""
    if run.closed:
        return
    run.closed = True
    closers = [run.loader.close, lambda: run.checkpointer.close(wait=clean), run.memory and run.memory.close,
               run.metrics and (lambda: run.metrics.close(clean)),
               run.comm and run.comm.close]
    for close in filter(None, closers):
        try:
            close()
        except Exception as e:  # noqa: BLE001 - after an error, say so and keep closing: the error is what matters
            if clean:
                raise
            log.warning("while stopping after an error: %s: %s", type(e).__name__, e)
