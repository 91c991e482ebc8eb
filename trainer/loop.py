"""The training run, top to bottom: `train()` builds the run (trainer.run), resumes it
(trainer.resume), then loops `train_step` -> `after_step` until the last step, and finishes with a
summary. Each component decides when it acts (the evaluator, the metrics log, the checkpointer);
teardown happens once, in `train`'s `finally`. The step itself is trainer.step; the metrics records
are trainer.records."""

from __future__ import annotations

import os
import time

import torch

from common import storage
from common.errors import peer_lost
from trainer.checkpoint import memory_auto
from trainer.config import Config
from trainer.distributed import parallel
from trainer.health.check import FaultyRank, Verdict
from trainer.health.exclusion import set_aside
from trainer.observability import logs
from trainer.observability.cost import cost_report, format_cost
from trainer.observability.metrics import BREAKDOWN, format_breakdown, with_other
from trainer.optim import lr_at, set_lr
from trainer.records import exchange_records, log_record
from trainer.recovery import inplace
from trainer.recovery.regroup import Regroup
from trainer.resume import resume, start_meters
from trainer.run import Meters, ProcessParts, Progress, Run, build, hold_directories, release, release_leases
from trainer.runtime import fault, host, protocol
from trainer.runtime.lease import Lease
from trainer.step import StepResult, micro_batches, train_step

log = logs.get_logger()


def train(cfg: Config) -> dict:
    """Run (or resume) the training job described by cfg; returns the final summary.

    Raises fault.Preempted after committing an emergency checkpoint when SIGTERM arrives."""
    fault.die_with_launcher()
    fault.stacks_on_sigusr1()
    if cfg.dist.tune_malloc:
        host.tune_malloc()
    storage.bound_requests(cfg.storage.timeout_s)
    regroup = in_process_recovery(cfg)
    info = parallel.init_distributed(cfg.dist, regroup)
    logs.setup(rank=info.rank, verbose=info.is_main)
    heartbeat, preemption, run, meters = protocol.Heartbeat(info.rank), fault.PreemptionFlag(), None, None
    stalls = storage.StallWatch(cfg.storage.stall_s, fault.storage_stalled)
    leases: list[Lease] = []
    joining = inplace.joining_setup(regroup) if regroup is not None and regroup.generation else None
    try:
        with stalls.guard("taking the leases on run.dir and checkpoint.dir", cfg.checkpoint_dir):
            leases = hold_directories(cfg, info, alone=joining is not None)
        run = build(cfg, info, ProcessParts(heartbeat=heartbeat, preemption=preemption, stalls=stalls, regroup=regroup),
                    joining)
        progress = resume(run)
        meters = start_meters(run, progress)
        while progress.state.step < cfg.train.steps:
            try:
                step_start = time.perf_counter()
                micros, data_wait = next_batch(run, progress)
                result = take_step(run, meters, progress, micros)
                after_step(run, meters, progress, result, step_start, data_wait)
            except Exception as error:
                if regroup is None or not peer_lost(error):
                    raise
                run, progress, meters = inplace.recover(run, meters, progress, error)
        return finish(run, meters, progress)
    finally:
        try:
            if run is not None:
                release(run, meters, clean=False)  # a no-op after finish() or an emergency checkpoint
        finally:
            release_leases(leases)
            stalls.close()
            preemption.close()
            heartbeat.close()
            parallel.shutdown()


def in_process_recovery(cfg: Config) -> Regroup | None:
    """The handle on in-process recovery (trainer.recovery.inplace) when the launcher offers it and fault.in_process
    is on; None otherwise (a lost peer then ends this process, and the launcher restarts the group)."""
    if not cfg.fault.in_process:
        return None
    return Regroup.from_env(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), cfg.dist.timeout_s)


# ---------------------------------------------------------------------- the step and what follows it
def next_batch(run: Run, progress: Progress) -> tuple[list, float]:
    """The next batch as micro-batches, and the seconds spent waiting for it; sets this step's lr."""
    step = progress.state.step + 1
    fault.inject_faults(step, run.info.rank)
    start = time.perf_counter()
    with run.process.stalls.guard("waiting for training data", run.shards.root):
        batch = next(run.loader)
    micros = micro_batches(batch, run.micro_batch, run.cfg, run.info.device)
    data_wait = time.perf_counter() - start
    set_lr(run.optimizer, lr_at(step, run.cfg))
    return micros, data_wait


def take_step(run: Run, meters: Meters, progress: Progress, micros: list) -> StepResult:
    """The step, checked (trainer.health); not computed when the run skipped its data before (a step run again
    after a resume: its update was not applied then either)."""
    step, stream = progress.state.step + 1, run.loader.stream
    if stream.was_skipped(*stream.last_batch()):
        meters.timer.start()
        meters.timer.mark()
        meters.timer.mark()
        return StepResult(torch.full((), float("nan")), float("nan"), skipped=True)
    return train_step(run.model, run.optimizer, micros, run.cfg, run.info, meters.timer,
                      fault.slowdown(step, run.info.rank), health=meters.health, step=step)


def say_verdict(run: Run, step: int, verdict: Verdict) -> None:
    """A step's check found something (trainer.health.check): data at fault (its samples skipped, in the data
    state), a transient corruption (the replay's results applied), or a faulty rank (this one ends)."""
    stream = run.loader.stream
    first, end = stream.last_batch()
    if verdict.kind == "data":
        stream.skip(first, end)
    if run.info.is_main:
        what = {"data": f"the data is at fault: step {step}'s update not applied, samples [{first}, {end}) skipped",
                "transient": f"a transient corruption on rank(s) {verdict.ranks}: the step redone from the replay",
                "faulty": f"rank(s) {verdict.ranks} compute wrong results: faulty"}[verdict.kind]
        log.warning("step %d: %s (%s)", step, what, verdict.evidence)
        protocol.append_event(run.cfg.run.dir, "verdict", **verdict.fields(), samples=[first, end])
    if verdict.kind == "faulty" and run.info.rank in verdict.ranks:
        host = set_aside(run.cfg.run.dir, run.info.rank, step, verdict.evidence)
        raise FaultyRank(f"step {step}: this rank (rank {run.info.rank}) computes wrong results: its node {host} is "
                         f"set aside ({verdict.evidence})")


def after_step(run: Run, meters: Meters, progress: Progress, result: StepResult, step_start: float,
               data_wait: float) -> None:
    """Account for the step, then evaluate, log, save and honour a preemption, each when it is due."""
    cfg, info, state = run.cfg, run.info, progress.state
    step = state.step + 1
    if result.verdict is not None:
        say_verdict(run, step, result.verdict)
    meters.guard.check(step, result)
    state.step, state.tokens_seen = step, state.tokens_seen + run.tokens_per_step
    run.checkpointer.poll()  # completes (or fails loudly) a background save once every rank has written it
    progress.busy_s += time.perf_counter() - step_start
    meters.window.add(float(result.loss), data_wait)
    meters.metrics.step(step)

    evaluated = run.evaluator.due(step)
    if evaluated:
        run.process.heartbeat.beat("eval")
        progress.eval_loss = run.evaluator.run(run.model)
    if meters.metrics.should_log(step):
        log_record(run, meters, progress, step, result, evaluated)
    exchange_records(run, meters, step)
    final = step == cfg.train.steps
    saved = run.checkpointer.should_save(step, final)
    if saved:
        run.process.heartbeat.beat("save")
        state.data, state.health = run.loader.state_dict(), meters.health.state_dict()
        path = run.checkpointer.save(state, run.model, run.optimizer, blocking=final or not cfg.checkpoint.async_,
                                     required=final)
        if path is not None:  # else: a periodic save failed, and said so
            log.info("checkpoint step %d -> %s (%.2fs blocking)", step, path, run.checkpointer.last_blocking_s)
    if run.memory is not None and run.memory.due(step) and not final:
        state.data, state.health = run.loader.state_dict(), meters.health.state_dict()
        run.memory.snapshot(state, run.model, run.optimizer, records=meters.records.unwritten())
        if meters.memory_measure is not None:
            measure_memory_tier(run, meters, time.perf_counter() - step_start)
    # The step is reported done (the launcher counts lost steps from it) once its snapshot is under way:
    # a failure in the bookkeeping before it would otherwise redo a step that had been reported.
    run.process.heartbeat.beat("train", step=step, busy_s=progress.busy_s, steps_run=step - progress.start_step)
    synced = run.process.preemption.blocking and not final  # then agreed() waits for every rank
    if run.process.preemption.agreed(step, info.world, info.device, last=final):
        emergency_checkpoint(run, meters, progress, saved)
    if step == progress.start_step + 1:
        start_up_over(run, synced)
    trace = meters.profiler.after_step(step)
    if trace is not None:
        log.info("profiler trace of steps %s -> %s", cfg.profile.steps, trace)


def start_up_over(run: Run, synced: bool) -> None:
    """After the first step of this process or of an in-process recovery: hangs from here on should fail
    fast. `synced`: every rank has just finished this step (the blocking preemption agreement), so no rank
    is still in its first step under the long timeout, and no barrier is needed to know it."""
    cfg, info = run.cfg, run.info
    parallel.set_collective_timeout(cfg.fault.collective_timeout_s, info, barrier=not synced)
    # The heap has its steady size now: back it with 2 MiB pages. Not after a restart, nor in a rank
    # that replaces a failed one: the collapse (on the training thread, in proportion to the heap; a
    # forked rank's heap is its fork server's, copied as it goes) would add to every recovery (0.3 s).
    if cfg.dist.tune_malloc and info.device.type == "cpu" and protocol.first_start():
        host.huge_pages_for_heap()


def measure_memory_tier(run: Run, meters: Meters, step_s: float) -> None:
    """checkpoint.memory_every=auto, the first steps: time them and their snapshots, then settle on the
    interval (collective, at the same step on every rank), say it and keep it in run.dir."""
    measure, memory = meters.memory_measure, run.memory
    measure.note(step_s, memory.writes.call_s, memory.writes.waited_s, memory.writes.write_s)
    if not measure.due():
        return
    memory.every, cost_s, step_s = measure.settle(run.info.world)
    meters.memory_measure, memory.measuring = None, False
    log.info("memory tier: auto chose every %d step(s): a snapshot costs %.2f ms, a step takes %.1f ms (at most "
             "%.0f%% of the steps it covers)", memory.every, cost_s * 1e3, step_s * 1e3,
             memory_auto.COST_SHARE * 100)
    if run.info.is_main:
        memory_auto.keep_choice(run.cfg.run.dir, memory.setup.config_sha256, memory.every)


def emergency_checkpoint(run: Run, meters: Meters, progress: Progress, saved: bool) -> None:
    """SIGTERM reached some rank: commit this step (or let its async save commit), then stop."""
    exchange_records(run, meters, progress.state.step, now=True)  # the records, before the checkpoint
    preemption = run.process.preemption
    run.process.heartbeat.beat("preempt", signalled=preemption.received)  # the launcher names the rank that got it
    if saved:
        run.checkpointer.wait()  # an async save of this very step: let it commit
    if not saved or run.checkpointer.failed_in_a_row:  # not saved, or that save failed: this one must not
        progress.state.data, progress.state.health = run.loader.state_dict(), meters.health.state_dict()
        run.checkpointer.save(progress.state, run.model, run.optimizer, blocking=True, required=True)
    release(run, meters)
    log.info("SIGTERM: emergency checkpoint of step %d committed; exiting with code %d", progress.state.step,
             protocol.EXIT_PREEMPTED)
    raise fault.Preempted(progress.state.step)


# ---------------------------------------------------------------------- finish and teardown
def finish(run: Run, meters: Meters, progress: Progress) -> dict:
    """The last async save committed, everything closed; the run summary (collective), said on rank 0."""
    trace = meters.profiler.stop()  # a range past the last step ends with the run
    if trace is not None:
        log.info("profiler trace -> %s", trace)
    run.checkpointer.wait()
    if run.memory is not None:
        run.memory.close(remove=True)  # the run is over: its snapshots go
    release(run, meters)
    cfg, info = run.cfg, run.info
    wall = time.perf_counter() - progress.started
    steps_done = progress.state.step - progress.start_step
    tokens = run.tokens_per_step * steps_done
    entropy = run.shards.manifest.stats.get("unigram_entropy_nats", float("nan"))
    summary = {"steps": progress.state.step, "steps_this_run": steps_done, "wall_s": wall,
               "eval_loss": progress.eval_loss, "unigram_entropy": entropy,
               "tokens_per_s": tokens / wall if wall else 0.0,
               "breakdown": run_breakdown(run, meters, wall / max(steps_done, 1))}
    if not steps_done:  # a requeued job, say, whose run had finished: nothing was trained, nothing to measure
        log.info("done: nothing to train, the run had reached its final step %d already", progress.state.step)
        return summary
    log.info("done: %d steps in %.1fs (%s tok/s) | %s", steps_done, wall, f"{summary['tokens_per_s']:,.0f}",
             f"final eval loss {progress.eval_loss:.3f} nats vs unigram entropy {entropy:.3f} nats"
             if run.evaluator.enabled else "no evaluation")
    log.info("time per step: %s", format_breakdown(summary["breakdown"]))
    if cfg.log.cost_per_device_hour:
        summary["cost"] = cost_report(info.world, wall, tokens, 0.0, cfg.log.cost_per_device_hour)
        log.info("%s (%d device(s), this process's %.1fs)", format_cost(summary["cost"]), info.world, wall)
    return summary


def run_breakdown(run: Run, meters: Meters, step_time_s: float) -> dict[str, float]:
    """Where the time went, per step, over this process's steps (means over ranks; collective)."""
    totals, n = meters.timer.totals, max(meters.timer.totals["steps"], 1)
    means = parallel.all_reduce_mean([meters.window.data_wait_total / n, totals["fwd_bwd_s"] / n,
                                      totals["optim_s"] / n, totals["comm_wait_s"] / n], run.info)
    breakdown = dict(zip(BREAKDOWN[:4], means, strict=True))
    if meters.comm is None:
        breakdown.pop("comm_wait_s")
    return with_other({**breakdown, "step_time_s": step_time_s})
