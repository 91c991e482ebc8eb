"""Where a run starts: the newest usable state (per checkpoint.resume) from the memory tier or the
durable tier, whichever is newer, checked against this run's config; then the per-attempt meters."""

from __future__ import annotations

import time
from dataclasses import asdict

from trainer.checkpoint import CheckpointError, TrainState, memory_auto, step_dir
from trainer.config import resume_rules
from trainer.distributed import parallel
from trainer.health.anomaly import AnomalyRule
from trainer.health.check import StepHealth
from trainer.observability import logs, wandb_log
from trainer.observability.metrics import LogWindow, MetricsLog, PendingRecords, RecordDraft, StepTimer
from trainer.observability.profiling import StepProfiler
from trainer.observability.stragglers import StragglerWatch
from trainer.records import write_record
from trainer.run import Meters, Progress, Run
from trainer.runtime import protocol
from trainer.step import NonFiniteGuard

log = logs.get_logger()


def resume(run: Run) -> Progress:
    """Load the newest usable checkpoint (per checkpoint.resume); the progress the run starts from."""
    cfg, root = run.cfg, run.cfg.checkpoint_dir
    mode = cfg.checkpoint.resume
    progress = Progress(fresh_state(run))
    run.process.heartbeat.beat("load", t_load=time.time())
    if mode == "never" and (existing := run.checkpointer.list_committed()):
        raise CheckpointError(
            f"checkpoint.resume=never, but {root} holds committed step(s) {existing}: set another "
            "checkpoint.dir (or run.dir), or delete them to start over")
    with run.process.stalls.guard("resuming from a checkpoint", root):
        latest = run.checkpointer.discover_latest() if mode != "never" else None
        parts = run.memory.scan() if run.memory is not None and mode != "never" else {}
        in_memory, givers = run.memory.plan(parts) if run.memory is not None and mode != "never" else (None, {})
        other = run.memory.plan_reshard() if run.memory is not None and mode != "never" and in_memory is None else None
        why = tier_choice(run, in_memory, latest, other)
        if in_memory is not None and (latest is None or in_memory > latest):
            load_snapshot(run, progress, in_memory, givers, parts, durable=latest)
        elif other is not None and (latest is None or other[1] > latest):
            load_resharded(run, progress, *other, durable=latest)
        elif latest is None and mode == "required":
            raise CheckpointError(f"checkpoint.resume=required but no usable committed checkpoint in {root}")
        elif latest is not None:
            load_checkpoint(run, progress, latest)
            if run.memory is not None:
                log.info("memory tier not used: %s", why)
        elif mode != "never":
            log.info("no committed checkpoint in %s: starting fresh", root)
    skip_known_data(run, progress.state.step)
    run.process.heartbeat.beat("loaded", step=progress.state.step, t_loaded=time.time(),
                               resumed_step=progress.state.step, resumed_tier=progress.resumed_tier, tier_why=why[:200])
    return progress


def fresh_state(run: Run) -> TrainState:
    """Step 0 of this run: its world, config and model arguments."""
    cfg = run.cfg
    return TrainState(world=run.info.world, config_sha256=cfg.sha256(), model=asdict(cfg.model), config=cfg.to_dict())


def skip_known_data(run: Run, step: int) -> None:
    """The samples the run skipped after `step` (the ledger's data verdicts, trainer.health): a resume from
    before them skips exactly those, on any number of ranks, without judging them again. Read on rank 0."""
    found = None
    if run.info.is_main:
        found = [e["samples"] for e in protocol.read_events(run.cfg.run.dir)
                 if e["event"] == "verdict" and e.get("kind") == "data" and e["step"] > step and "samples" in e]
    for first, end in parallel.broadcast_object(found, run.info) or []:
        run.loader.stream.skip(first, end)


def start_meters(run: Run, progress: Progress) -> Meters:
    """The per-attempt instruments, from the start step on; the model in training mode."""
    cfg, info, t = run.cfg, run.info, run.cfg.train
    metrics = MetricsLog(cfg.run.dir, cfg.train, cfg.log, progress.state.step, info.is_main,
                         wandb_log.start(cfg, progress.state.step) if info.is_main else None)
    comm = parallel.CommTimer() if parallel.CommTimer.enabled_for(info) else None
    timer = StepTimer(info.device, comm)
    profiler = StepProfiler(cfg.profile.steps, cfg.run.dir, info.rank, info.device)
    profiler.maybe_start(progress.state.step + 1)
    stragglers = StragglerWatch(cfg.fault.straggler_factor, cfg.fault.straggler_s)
    records = PendingRecords(lambda values: parallel.all_gather_rows(values, info),
                             lambda draft, parts: write_record(run, metrics, stragglers, draft, parts),
                             progress.restored_records)
    measuring = run.memory is not None and run.memory.measuring
    measure = memory_auto.Measure(on_cpu=info.device.type == "cpu") if measuring else None
    progress.start_step, progress.started = progress.state.step, time.perf_counter()
    run.model.train()
    f = cfg.fault
    health = StepHealth(AnomalyRule(f.anomaly_window, f.anomaly_threshold), f.verify_every)
    health.load_state_dict(progress.state.health)
    return Meters(metrics, timer, LogWindow(timer), comm, profiler, NonFiniteGuard(t.max_bad_steps), stragglers,
                  records, health, measure)


def tier_choice(run: Run, in_memory: int | None, durable: int | None, other: tuple[int, int] | None = None) -> str:
    """Why the state comes from the tier it comes from (for the log and the ledger's resume event); ''
    with the memory tier off. `other`: (world, step) of a snapshot of another world size to reshard."""
    newest = "none" if durable is None else f"step {durable}"
    if run.memory is None:
        return ""
    if in_memory is not None and (durable is None or in_memory > durable):
        return f"memory snapshot of step {in_memory} is newer than the newest durable checkpoint ({newest})"
    if in_memory is not None:
        return f"the newest snapshot every rank has (step {in_memory}) is not newer than the durable {newest}"
    if other is not None:
        world, step = other
        newer = "newer" if durable is None or step > durable else "not newer"
        return f"the {world}-rank memory snapshot of step {step}, resharded, is {newer} than the newest durable " \
               f"checkpoint ({newest})"
    skipped = run.memory.restoring.skipped
    seen = f" (on rank {run.info.rank}'s node: {skipped[0]})" if skipped else ""
    return f"no memory snapshot that every rank has{seen}"


def load_checkpoint(run: Run, progress: Progress, step: int) -> None:
    """Load committed `step` into the run, once its config passes `resume_rules` (before any tensor
    is read); list the settings this run changed, in the log and the ledger."""
    cfg, path, changed = run.cfg, step_dir(run.cfg.checkpoint_dir, step), {}

    def check(saved: TrainState) -> None:
        changed.update(resume_rules.check_resume(saved.config, saved.model, cfg.to_dict(), path))

    state = run.checkpointer.load(step, run.model, run.optimizer, check=check)
    progress.state, progress.resumed_tier = state, "durable"
    run.loader.load_state_dict(state.data or {})
    log.info("resumed from step %d (%s, saved by %d rank(s))", state.step, path, state.world)
    if changed:
        log.info("settings changed since that checkpoint: %s", resume_rules.describe(changed))
        if run.info.is_main:
            protocol.append_event(cfg.run.dir, "config_changed", step=state.step,
                                  changes={key: list(values) for key, values in changed.items()})
    adopt_config(run, state)  # the next checkpoint records this run's settings


def adopt_config(run: Run, state: TrainState) -> None:
    """The loaded train state takes this run's config, model arguments and config hash."""
    cfg = run.cfg
    state.config, state.model, state.config_sha256 = cfg.to_dict(), asdict(cfg.model), cfg.sha256()


def load_resharded(run: Run, progress: Progress, world: int, step: int, durable: int | None) -> None:
    """Restore this rank's rows of the `world`-rank memory snapshot `step` (same run and config, another
    world size: its parts on the ranks' nodes), as a durable checkpoint of another world reshards."""
    state = run.memory.load_resharded(world, step, run.model, run.optimizer)
    progress.state, progress.resumed_tier = state, "memory-reshard"
    progress.restored_records = [RecordDraft.from_json(d) for d in run.memory.restoring.extra.get("records", [])]
    adopt_config(run, state)
    run.loader.load_state_dict(state.data or {})
    log.info("resumed from step %d (memory snapshot of %d rank(s) in %s, resharded to %d; newest durable "
             "checkpoint: %s)", state.step, world, run.memory.dir, run.info.world,
             "none" if durable is None else f"step {durable}")


def load_snapshot(run: Run, progress: Progress, step: int, givers: dict[int, int], parts: dict,
                  durable: int | None) -> None:
    """Restore this rank's part of memory snapshot `step` (same run, config and world size: nothing to
    check or reshard), sent by the rank holding it when its own node does not have it (collective)."""
    moved = sorted(rank for rank, giver in givers.items() if giver != rank)
    state = run.memory.load(*run.memory.fetch(step, givers, parts), run.model, run.optimizer)
    progress.state = state
    progress.restored_records = [RecordDraft.from_json(d) for d in run.memory.restoring.extra.get("records", [])]
    adopt_config(run, state)  # a snapshot is of this very config (config_sha256 less where memory lives): not kept
    progress.resumed_tier = "memory-peer" if moved else "memory-local"
    run.loader.load_state_dict(state.data or {})
    sent = f"; the part(s) of rank(s) {moved} sent by the rank(s) holding them" if moved else ""
    log.info("resumed from step %d (memory snapshot in %s%s; newest durable checkpoint: %s)", state.step,
             run.memory.dir, sent, "none" if durable is None else f"step {durable}")
