"""Restart policy: what to do after a failure. Restart at once after a failure that came after
progress; back off (doubling) when restarts make no progress; stop early on a crash loop (the same
failure at the same step `repeats` times in a row) or on bad input, instead of spending the budget.
Storage that could not be used may come back: its failures are no crash loop, they back off until the
budget is spent (then exit EXIT_STORAGE)."""

from __future__ import annotations

from dataclasses import dataclass, field

from launch.failures import Failure
from trainer.contract import EXIT_CRASH_LOOP, EXIT_FAILED, EXIT_FAULTY, EXIT_STORAGE, EXIT_USAGE


@dataclass
class Decision:
    restart: bool
    delay_s: float = 0.0
    exit_code: int = 0
    reason: str = ""


@dataclass
class RestartPolicy:
    max_restarts: int
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    crash_loop_repeats: int = 3
    history: list[Failure] = field(default_factory=list)
    restarts: int = 0

    def decide(self, failure: Failure) -> Decision:
        self.history.append(failure)
        if failure.cause == "exit" and failure.exit_code == EXIT_USAGE:
            return Decision(False, exit_code=EXIT_USAGE,
                            reason=f"{failure.describe()}\nbad input (exit code 2): restarting cannot fix it")
        if failure.cause == "faulty":
            return Decision(False, exit_code=EXIT_FAULTY, reason=(
                f"{failure.describe()}\nthis node is set aside (named in run.dir/excluded-nodes): the other nodes go "
                f"on without it, a spare in its place; launch again elsewhere to resume here"))
        tail = self.history[-self.crash_loop_repeats:]
        looping = len(tail) == self.crash_loop_repeats and len({f.signature() for f in tail}) == 1
        if looping and failure.cause != "storage":
            return Decision(False, exit_code=EXIT_CRASH_LOOP, reason=(
                f"crash loop: the same failure {self.crash_loop_repeats} times in a row, each at step "
                f"{failure.step}: {failure.describe()}\nnot restarting again ({self.max_restarts - self.restarts} "
                f"restart(s) of the budget left); fix the cause, then launch again to resume"))
        if self.restarts >= self.max_restarts:
            code = EXIT_STORAGE if failure.cause == "storage" else EXIT_FAILED
            return Decision(False, exit_code=code, reason=(
                f"restart budget spent ({self.max_restarts} restart(s)); last failure: {failure.describe()}"))
        # Back off only while restarts do not get past the furthest step any attempt reached.
        best, streak = -1, 0
        for f in self.history:
            if f.cause == "preemption":
                continue
            best, streak = (f.step, 0) if f.step > best else (best, streak + 1)
        self.restarts += 1
        delay = min(self.backoff_s * 2 ** (streak - 1), self.max_backoff_s) if streak else 0.0
        return Decision(True, delay_s=delay)
