"""The run's event ledger (`run.dir/events.jsonl`, shared with the trainer's `commit` events) and
the end-of-run accounting: restarts, lost steps, recovery times, goodput and cost.

Goodput = productive step time / wall time. Productive time is the time ranks spent in training
steps whose results survived: steps redone after a restart (lost steps) and all start-up, loading,
eval and checkpoint time count as unproductive."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.contract import HeartbeatRecord, append_event, cost_report


@dataclass
class Attempt:
    """One start of the worker group, seen through the heartbeats of this node's lowest rank."""

    n: int
    started: float
    resumed_step: int | None = None
    last_step: int = 0
    busy_s: float = 0.0
    steps_run: int = 0
    first_step_at: float = 0.0
    interrupted_at: float | None = None  # when the previous group was stopped (failure noticed, or a restart)
    reason: str = ""  # why: "failure", "membership change" or "launcher lost" ("" for a first attempt)
    path: str = "restart"  # restart (every rank started again) | in-process (the failed ranks alone)


@dataclass
class Ledger:
    run_dir: Path
    node: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    started: float = field(default_factory=time.time)
    attempts: list[Attempt] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    resumes: list[dict] = field(default_factory=list)
    previous_last_step: int | None = None  # the step a launcher lost before this one had reached
    interrupted: tuple[float, str] | None = None  # (when, why) the running group was stopped: the next attempt's

    def event(self, name: str, **fields: Any) -> dict:
        return append_event(self.run_dir, name, node=self.node, **fields)

    # ------------------------------------------------------------------ attempts
    def attempt_started(self, n: int, interrupted_at: float | None = None, reason: str = "",
                        path: str = "restart") -> None:
        """A new start of the group (`restart`), or of its failed ranks alone (`in-process`: a new segment
        of the same attempt, its heartbeats those of the new generation)."""
        self.attempts.append(Attempt(n=n, started=time.time(), interrupted_at=interrupted_at, reason=reason,
                                     path=path))

    def observe(self, beat: HeartbeatRecord) -> dict | None:
        """Fold in the current attempt's heartbeat; returns the `resume` event once its first step is done."""
        if not self.attempts:
            return None
        a, times, progress, recovery = self.attempts[-1], beat.startup, beat.progress, beat.recovery
        if a.resumed_step is None and times.t_loaded:
            a.resumed_step = progress.resumed_step
        a.last_step, a.busy_s, a.steps_run = beat.step, progress.busy_s, progress.steps_run
        if a.first_step_at or not times.t_first:
            return None
        a.first_step_at = times.t_first
        previous = self.attempts[-2].last_step if len(self.attempts) > 1 else self.previous_last_step
        if previous is None or a.interrupted_at is None:
            return None
        since = a.interrupted_at  # this attempt's own cause, not an older failure
        if recovery.t_error:  # a survivor noticed the lost peer itself, before the launcher did
            since = min(since, recovery.t_error)
        lost = max(previous - a.resumed_step, 0)
        resume = {
            "step": a.resumed_step, "lost_steps": lost, "reason": a.reason, "path": a.path,
            "tier": progress.resumed_tier or "durable",  # memory-local | memory-peer | memory-reshard | durable | none
            "tier_why": progress.tier_why,
            "recovery_s": round(times.t_first - since, 3), "restart_s": round(times.t_load - since, 3),
            "load_s": round(times.t_loaded - times.t_load, 3),
            "first_step_s": round(times.t_first - times.t_loaded, 3),
        }
        if a.path == "in-process" and recovery.t_left:  # a survivor's account of its recovery
            resume.update(
                leave_s=round(recovery.t_left - recovery.t_error, 3),  # out of the collective, groups left
                wait_s=round(recovery.t_joined - recovery.t_left, 3),  # until every rank (the replacement) arrived
                reform_s=round(recovery.t_reformed - recovery.t_joined, 3),  # the groups formed again
                restore_s=round(times.t_loaded - recovery.t_reformed, 3),  # the snapshot agreed on and loaded
                replaced=recovery.replaced, kept_pid=beat.pid)
        else:
            resume.update(spawn_s=round(times.t_proc - since, 3),  # stop the group, rendezvous, fork/exec
                          startup_s=round(times.t_load - times.t_proc, 3))  # join the group, build the model
        self.resumes.append(resume)
        return self.event("resume", **resume)

    def failure(self, **fields: Any) -> dict:
        record = self.event("failure", **fields)
        self.failures.append(record)
        return record

    # ------------------------------------------------------------------ accounting
    def productive_s(self) -> float:
        total = 0.0
        for i, a in enumerate(self.attempts):
            if not a.steps_run:
                continue
            kept = a.steps_run
            if i + 1 < len(self.attempts) and self.attempts[i + 1].resumed_step is not None:
                start = a.last_step - a.steps_run
                kept = max(min(a.last_step, self.attempts[i + 1].resumed_step) - start, 0)
            total += a.busy_s * kept / a.steps_run
        return total

    def lost_s(self) -> float:
        """Time failures cost: each recovery (failure noticed -> first step after resume) plus the
        step time of work that had to be redone."""
        busy = sum(a.busy_s for a in self.attempts)
        return sum(r["recovery_s"] for r in self.resumes) + max(busy - self.productive_s(), 0.0)

    def steps_kept(self) -> int:
        """Steps trained in this launch whose results survived."""
        first = next((a.resumed_step for a in self.attempts if a.resumed_step is not None), 0)
        return max((self.attempts[-1].last_step if self.attempts else 0) - first, 0)

    def summary(self, ended: float | None = None) -> dict:
        wall = (ended or time.time()) - self.started
        return {
            "wall_s": round(wall, 3), "restarts": max(len(self.attempts) - 1, 0), "failures": len(self.failures),
            "lost_steps": sum(r["lost_steps"] for r in self.resumes),
            "recovery_s": [r["recovery_s"] for r in self.resumes],
            "tiers": [r.get("tier", "durable") for r in self.resumes],
            "productive_s": round(self.productive_s(), 3), "lost_s": round(self.lost_s(), 3),
            "steps_kept": self.steps_kept(),
            "goodput": round(self.productive_s() / wall, 4) if wall > 0 else 0.0,
            "final_step": self.attempts[-1].last_step if self.attempts else 0,
        }

    def done(self, exit_code: int, outcome: str, devices: int = 1, tokens_per_step: int = 0,
             price: float = 0.0, **extra: Any) -> dict:
        """Write the `done` event: the summary, plus what this node cost when `price` (per device-hour) is
        set, and `extra` fields (a preempted launcher's `committed_step`)."""
        summary = self.summary()
        if price:
            summary["cost"] = cost_report(devices, summary["wall_s"], summary["steps_kept"] * tokens_per_step,
                                          summary["lost_s"], price)
        self.event("done", exit_code=exit_code, outcome=outcome, **summary, **extra)
        return summary


def format_summary(s: dict) -> str:
    tiers = s.get("tiers") or ["durable"] * len(s["recovery_s"])
    recov = ", ".join(f"{r:.1f}s ({tier})" for r, tier in zip(s["recovery_s"], tiers, strict=False)) or "none"
    return (f"{s['restarts']} restart(s), {s['lost_steps']} lost step(s), recovery {recov}, "
            f"goodput {100 * s['goodput']:.1f}% ({s['productive_s']:.1f}s productive of {s['wall_s']:.1f}s wall)")


def recovery_after(events: list[dict], at: float) -> tuple[dict, dict] | None:
    """The first failure the ledger recorded at or after time `at` (a fault injected then) and the
    resume that followed it; None while either is missing (benchmarks and chaos runs match their faults
    to recoveries with it)."""
    failure = next((e for e in events if e["event"] == "failure" and e["time"] >= at), None)
    resume = failure and next((e for e in events if e["event"] == "resume" and e["time"] >= failure["time"]), None)
    return (failure, resume) if resume else None


def resume_line(event: dict) -> str:
    """The launcher's line for a `resume` event: tier, lost steps, the recovery and its split, why that tier."""
    if "wait_s" in event:
        split = (f"in process: left {event['leave_s']:.2f}s, waited {event['wait_s']:.2f}s, re-formed "
                 f"{event['reform_s']:.2f}s, load {event['load_s']:.2f}s, first step {event['first_step_s']:.2f}s")
    else:
        split = (f"restart {event['restart_s']:.1f}s, load {event['load_s']:.1f}s, first step "
                 f"{event['first_step_s']:.1f}s")
    why = f"; {event['tier_why']}" if event["tier_why"] else ""
    return (f"resumed at step {event['step']} from the {event['tier']} tier: {event['lost_steps']} step(s) lost, "
            f"recovery {event['recovery_s']:.2f}s ({split}){why}")
