"""The metrics records of closed log windows: when the ranks exchange their numbers (a few times a
second, asynchronously; at once before a commit), and rank 0 writing each record with its straggler
scores and verdicts."""

from __future__ import annotations

import time

from trainer.observability import logs
from trainer.observability.metrics import MetricsLog, RecordDraft, memory_mb
from trainer.observability.stragglers import Change, StragglerWatch
from trainer.optim import lr_at
from trainer.run import Meters, Progress, Run
from trainer.runtime import protocol
from trainer.step import StepResult

log = logs.get_logger()


def log_record(run: Run, meters: Meters, progress: Progress, step: int, result: StepResult, evaluated: bool) -> None:
    """Close the log window: its metrics.jsonl record is written once the other ranks' numbers are in
    (`exchange_records`: means over ranks, each rank's own work, straggler scores)."""
    fields = {"lr": lr_at(step, run.cfg), "grad_norm": result.grad_norm, "mem_mb": memory_mb(run.info.device),
              "tokens": progress.state.tokens_seen, "skipped_steps": meters.guard.total, "time": time.time()}
    if evaluated:
        fields["eval_loss"] = progress.eval_loss
    window = meters.window.close()
    meters.records.add(RecordDraft(step, window, fields, first=step - window.steps <= progress.start_step))
    meters.window.restart()


def write_record(run: Run, metrics: MetricsLog, stragglers: StragglerWatch, draft: RecordDraft, parts: dict) -> None:
    """Rank 0 writes the record of a closed window, given the ranks' numbers (`ClosedWindow.means`)."""
    if draft.restored and draft.step <= metrics.logged_through:
        return  # restored from a memory snapshot, and written by the attempt that took it
    f = draft.fields
    tokens_per_s = run.tokens_per_step / parts["step_time_s"]
    mfu = run.flops.per_token * tokens_per_s / (run.flops.peak * run.info.world) if run.flops.peak else 0.0
    record = {"step": draft.step, "lr": f["lr"], "grad_norm": f["grad_norm"], "tokens_per_s": tokens_per_s,
              "mfu": mfu, "mem_mb": f["mem_mb"], **parts, "tokens": f["tokens"], "skipped_steps": f["skipped_steps"],
              "time": f["time"]}
    if "eval_loss" in f:
        record["eval_loss"] = f["eval_loss"]
    if stragglers.enabled:
        scores, changes = stragglers.update(parts["rank_work_s"], draft.window.steps, draft.window.elapsed_s,
                                            judged=not draft.first)
        record["straggler_score"] = [round(score, 3) for score in scores]
        record["stragglers"] = sorted(stragglers.flagged)
        for change in changes:
            report_straggler(run, draft.step, change)
    metrics.log(record)


def exchange_records(run: Run, meters: Meters, step: int, now: bool = False) -> None:
    """Exchange the closed log windows' numbers between the ranks and write their records (collective:
    every rank, every step boundary, deciding alike). A blocking gather per log step would cost more than
    the rest of a small step's bookkeeping, so the ranks exchange them at the preemption check steps only
    (a few times a second on fast steps, every step on slow ones: trainer.runtime.fault), asynchronously:
    a check writes the records sent at the previous one. `now`, and at a step whose state may be committed
    to the durable tier at this boundary (`commits_at`), every record is written before going on: a step
    that is not redone after a failure must have its record on disk before its checkpoint is (a memory
    snapshot carries the unwritten ones instead). The time this takes is not counted in the current log
    window."""
    now = now or run.info.world == 1 or commits_at(run, step)
    if not (now or run.process.preemption.checks_at(step)):
        return
    start = time.perf_counter()
    meters.records.receive()  # sent at the previous check: finished since
    meters.records.send()
    if now or run.process.preemption.blocking:
        meters.records.receive()
    meters.window.started += time.perf_counter() - start


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
