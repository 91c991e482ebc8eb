"""What one training process holds, in three parts: `Run`, built once by `build` (data, model,
optimizer, checkpointer, memory tier) around the `ProcessParts` the process keeps to its end;
`Progress`, what changes step by step (the train state, the time spent in steps), made by
trainer.resume; `Meters`, the per-attempt instruments (metrics log, timers, log window, straggler
watch), started once the start step is known."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import storage
from common.clock import call_bounded
from data.corpus import ensure_builtin
from data.loader import BatchLoader
from data.shards import ShardSet
from data.stream import BatchGeometry, TokenStream
from trainer.checkpoint import Checkpointer, CheckpointError, CheckpointStorageError, TrainState, memory_auto
from trainer.checkpoint import memory as memory_tier
from trainer.config import Config, ConfigError, micro_batch_size, validate
from trainer.config import save as save_config
from trainer.distributed import parallel
from trainer.evaluate import Evaluator
from trainer.health.check import StepHealth
from trainer.model.transformer import Transformer
from trainer.observability import logs
from trainer.observability.metrics import LogWindow, MetricsLog, PendingRecords, RecordDraft, StepTimer, peak_flops
from trainer.observability.profiling import StepProfiler
from trainer.observability.stragglers import StragglerWatch
from trainer.optim import build_optimizer
from trainer.recovery.regroup import Regroup
from trainer.runtime import fault, protocol
from trainer.runtime.lease import DirectoryInUse, Lease
from trainer.step import NonFiniteGuard

log = logs.get_logger()


@dataclass
class ProcessParts:
    """What the training process holds from its start to its end, around every run it builds (an in-process
    recovery builds the run again with the same parts)."""

    heartbeat: protocol.Heartbeat  # this rank's progress record for the launcher
    preemption: fault.PreemptionFlag  # SIGTERM, and the ranks' agreement on the step to stop at
    stalls: storage.StallWatch  # bounds the waits on storage (storage.stall_s)
    regroup: Regroup | None = None  # in-process recovery (trainer.recovery.inplace), when the launcher offers it


@dataclass(frozen=True)
class Flops:
    """MFU's terms: the model's training FLOPs per token, and the device's peak FLOP/s (0: unknown, no MFU)."""

    per_token: float
    peak: float


@dataclass
class Run:
    """What one training process builds once (`build`) and holds to the end."""

    cfg: Config
    info: parallel.DistInfo
    process: ProcessParts
    loader: BatchLoader  # its stream holds the dataset (`shards`)
    evaluator: Evaluator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer
    memory: memory_tier.MemoryTier | None  # checkpoint.memory_every > 0 (or auto, and it fits)
    flops: Flops
    closed: bool = False  # `release` ran

    @property
    def shards(self) -> ShardSet:
        return self.loader.stream.shards

    @property
    def micro_batch(self) -> int:
        return micro_batch_size(self.cfg, self.info.world)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.model.seq_len


@dataclass
class Progress:
    """What changes step by step: the train state (what a checkpoint keeps) and this attempt's account."""

    state: TrainState
    resumed_tier: str = "none"  # memory-local | memory-peer | memory-reshard | durable | none
    restored_records: list[RecordDraft] = field(default_factory=list)  # unwritten at the memory snapshot
    start_step: int = 0
    started: float = 0.0
    busy_s: float = 0.0  # time spent in training steps this attempt (goodput's numerator)
    eval_loss: float = float("nan")


@dataclass
class Meters:
    """The per-attempt instruments, started by `trainer.resume.start_meters` at the start step."""

    metrics: MetricsLog
    timer: StepTimer
    window: LogWindow
    comm: parallel.CommTimer | None  # several ranks on gloo: the time spent waiting in collectives
    profiler: StepProfiler
    guard: NonFiniteGuard
    stragglers: StragglerWatch
    records: PendingRecords  # log records waiting for the other ranks' numbers
    health: StepHealth  # the steps' check: anomaly -> replay -> verdict (trainer.health)
    memory_measure: memory_auto.Measure | None = None  # memory_every=auto: the first steps, until it settles


# ---------------------------------------------------------------------- build
def build(cfg: Config, info: parallel.DistInfo, process: ProcessParts, joining: dict | None = None) -> Run:
    """Data, model (sharded), optimizer, checkpointer and memory tier; says what was built. `joining`:
    a replacement rank's settings from the survivors (trainer.recovery.inplace.joining_setup), in place of the
    start-up collectives they are no longer in."""
    validate(cfg, info.world)
    t = cfg.train
    micro_batch = micro_batch_size(cfg, info.world)
    run_dir = Path(cfg.run.dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    shards = open_dataset(cfg, info, process.stalls)
    geometry = BatchGeometry(seq_len=cfg.model.seq_len, global_batch=t.global_batch, rank=info.rank, world=info.world)
    stream = TokenStream(shards, geometry, seed=cfg.data.seed, val_fraction=cfg.data.val_fraction)
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
    if joining is not None and joining.get("peak"):  # its peers' (a spare has measured nothing yet)
        peak, peak_source = joining["peak"], "the survivors' figure"
    else:
        peak, peak_source = peak_flops(info.device, cfg.log.peak_tflops)
    accum = t.global_batch // (micro_batch * info.world)
    log.info("model %.2fM params, %.1f MFLOPs/token | world %d (%s, %s) | global batch %d = %d ranks x %d micro "
             "x %d | peak %s GFLOP/s (%s)", n_params / 1e6, flops_per_token / 1e6, info.world, info.backend,
             parallel.compute_dtype(cfg.dist, info.device), t.global_batch, info.world, accum, micro_batch,
             f"{peak / 1e9:,.0f}", peak_source)

    on_event = (lambda name, **fields: protocol.append_event(run_dir, name, **fields)) if info.is_main else None
    regroup = process.regroup
    with regroup.tracking() if regroup is not None else contextlib.nullcontext():  # their groups' connections
        checkpointer = Checkpointer(cfg.checkpoint_dir, info, cfg.checkpoint, on_event=on_event,
                                    stalls=process.stalls)
        memory = start_memory_tier(cfg, info, model, joining)
    return Run(cfg=cfg, info=info, process=process, loader=loader, evaluator=evaluator, model=model,
               optimizer=optimizer, checkpointer=checkpointer, memory=memory,
               flops=Flops(per_token=flops_per_token, peak=peak))


def hold_directories(cfg: Config, info: parallel.DistInfo, alone: bool = False) -> list[Lease]:
    """Rank 0 takes the leases on run.dir and the checkpoint directory for this job (trainer.runtime.lease);
    every rank raises the same error when it cannot: DirectoryInUse, naming the holder, when another live
    job holds one; CheckpointStorageError when the storage cannot be reached. `alone`: a replacement rank
    (in-process recovery), whose peers took the leases at their start: no collective."""
    if not cfg.run.lease_s or (alone and not info.is_main):
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
    if not alone:
        refused = parallel.broadcast_object(refused, info)  # (the error class travels by name, as pickle does)
    if refused:
        release_leases(leases)
        error, message = refused
        raise error(message)
    return leases


def release(run: Run, meters: Meters | None, clean: bool = True) -> None:
    """Close what the run holds, once: loader workers, the checkpointer (after an error, not waiting
    for a background save: its peers may be gone), files, the progress bar, the collective timer."""
    if run.closed:
        return
    run.closed = True
    closers = [run.loader.close, lambda: run.checkpointer.close(wait=clean), run.memory and run.memory.close,
               meters and (lambda: meters.metrics.close(clean)), meters and meters.comm and meters.comm.close]
    for close in filter(None, closers):
        try:
            close()
        except Exception as e:  # noqa: BLE001 - after an error, say so and keep closing: the error is what matters
            if clean:
                raise
            log.warning("while stopping after an error: %s: %s", type(e).__name__, e)


def release_leases(leases: list[Lease], timeout_s: float = 10.0) -> None:
    """Remove this job's leases (best effort, bounded: storage that stopped answering must not keep the
    run from ending; a lease left behind is taken over by the next job)."""
    def release() -> None:
        for lease in leases:
            try:
                lease.release()
            except Exception as e:  # noqa: BLE001
                log.warning("could not release the lease %s: %s: %s", lease.url, type(e).__name__, e)

    if leases and not call_bounded(release, timeout_s, name="lease-release").done:
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


def start_memory_tier(cfg: Config, info: parallel.DistInfo, model: torch.nn.Module,
                      joining: dict | None = None) -> memory_tier.MemoryTier | None:
    """The memory tier per checkpoint.memory_every (`auto`: trainer.checkpoint.memory_auto; the tier is
    `measuring` while it still has to time the first steps), said in one start-up line (collective: the
    run's record and the ranks' decisions; a replacement rank takes them from `joining`)."""
    ck = cfg.checkpoint
    if not ck.memory_every or (joining is not None and not joining["run_id"]):
        return None
    directory = ck.memory_dir or memory_tier.default_dir()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world))
    identity = memory_tier.config_identity(cfg.to_dict())
    if joining is not None:
        record, (every, why) = {"run_id": joining["run_id"]}, (None if joining["measuring"] else joining["every"], "")
    else:
        record = memory_tier.run_record(cfg.run.dir, info.is_main, info.world)
        several_nodes = info.world > local_world and ck.memory_replicas
        every, why = memory_auto.choose(ck.memory_every, directory, memory_auto.snapshot_bytes(model),
                                        memory_tier.SLOTS * (2 if several_nodes else 1), local_world,
                                        memory_auto.kept_choice(record, identity))
        every, why = memory_auto.agree(every, why, info.world)
    if every == 0:
        log.info("memory tier: off (checkpoint.memory_every=auto): %s", why)
        return None
    setup = memory_tier.TierSetup(
        run_id=record["run_id"], config_sha256=identity, run_dir=cfg.run.dir, local_world=local_world,
        on_failure=lambda error: log.warning("memory snapshot failed (training goes on; the durable tier and "
                                             "older snapshots stay): %s", error))
    memory = memory_tier.MemoryTier(ck, info, setup, every=every)
    how_often = ""
    if every is None:
        how_often = (f"auto: every step while the first {memory_auto.MEASURED_STEPS} steps are timed, then every "
                     f"n steps, the fewest at which a snapshot costs at most {memory_auto.COST_SHARE:.0%} of them")
    elif ck.memory_every == "auto":
        how_often = f"auto: every {every} step(s), as this run chose at its first start"
    log.info("memory tier: %s", memory.describe(how_often))
    return memory


def init_from_hf(model: Transformer, cfg: Config) -> None:
    """The full model's weights from a Hugging Face Llama directory (every rank, before sharding); a
    resume then loads its checkpoint over them. HFModelError (bad input) when the shape is not this one."""
    from trainer.model import hf

    directory = cfg.model.init_from
    weights, config = hf.read_hf_llama(directory)
    model.load_state_dict(hf.from_hf_state_dict(weights, config, cfg.model, storage.join(directory, hf.CONFIG)))
    log.info("model weights from %s (Hugging Face Llama)", directory)
