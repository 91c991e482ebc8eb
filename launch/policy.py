"""Restart policy: what to do after a failure. Restart at once after a failure that came after
progress; back off (doubling) when restarts make no progress; stop early on a crash loop (the same
failure at the same step `repeats` times in a row) or on bad input, instead of spending the budget.
Storage that could not be used may come back: its failures are no crash loop, they back off until the
budget is spent (then exit EXIT_STORAGE).

A node whose own ranks fail again and again (`node_failure_limit` crashes, kills or hangs of ranks here within
`node_failure_window_s`, more than the failures seen elsewhere in the job in that time) is set aside, when
the job can go on without it (`can_set_aside`: several nodes under --nnodes MIN:MAX): exit EXIT_FAULTY, its
host named in run.dir/excluded-nodes; a spare takes its place, or the world shrinks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from launch.failures import Failure, lost_peer
from trainer.contract import EXIT_CRASH_LOOP, EXIT_FAILED, EXIT_FAULTY, EXIT_STORAGE, EXIT_USAGE


@dataclass
class Decision:
    restart: bool
    delay_s: float = 0.0
    exit_code: int = 0
    reason: str = ""
    set_aside: bool = False  # this node's ranks failed too often: name it in run.dir/excluded-nodes


OWN_CAUSES = ("exit", "signal", "hang")  # a failure of a rank here (not a victim's, not a node elsewhere)


@dataclass
class RestartPolicy:
    max_restarts: int
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    crash_loop_repeats: int = 3
    node_failure_limit: int = 0  # 0: never set this node aside for its failures
    node_failure_window_s: float = 3600.0
    can_set_aside: bool = False
    clock: Callable[[], float] = time.time
    history: list[Failure] = field(default_factory=list)
    restarts: int = 0
    here: list[float] = field(default_factory=list)  # when ranks here failed
    elsewhere: list[float] = field(default_factory=list)  # when a failure elsewhere was seen

    @classmethod
    def of(cls, fault, max_restarts: int, can_set_aside: bool) -> RestartPolicy:
        """The policy of the config's `fault` group (trainer.config.groups.FaultConfig)."""
        return cls(max_restarts, fault.restart_backoff_s, crash_loop_repeats=fault.crash_loop_repeats,
                   node_failure_limit=fault.node_failure_limit, node_failure_window_s=fault.node_failure_window_s,
                   can_set_aside=can_set_aside)

    def failed_elsewhere(self) -> None:
        """A failure of another node's rank, recovered without this launcher's decision (it followed)."""
        self.elsewhere.append(self.clock())

    def sets_aside(self, failure: Failure) -> str:
        """Why `failure`, not decided yet, makes this node one to set aside ('' if it does not)."""
        if not (self.node_failure_limit and self.can_set_aside and self._own(failure)):
            return ""
        since = self.clock() - self.node_failure_window_s
        here = sum(t >= since for t in self.here) + 1
        elsewhere = sum(t >= since for t in self.elsewhere)
        if here < self.node_failure_limit or here <= elsewhere:
            return ""
        return (f"the ranks of this node failed {here} times in {self.node_failure_window_s:g} s "
                f"(fault.node_failure_limit={self.node_failure_limit}; failures elsewhere meanwhile: {elsewhere})")

    @staticmethod
    def _own(failure: Failure) -> bool:
        return failure.cause in OWN_CAUSES and not (failure.cause == "exit" and (
            failure.exit_code in (EXIT_USAGE, EXIT_STORAGE, EXIT_FAULTY) or lost_peer(failure.message)))

    def decide(self, failure: Failure) -> Decision:
        why_aside = self.sets_aside(failure)
        self.history.append(failure)
        if self._own(failure):
            self.here.append(self.clock())
        elif failure.cause == "node":
            self.elsewhere.append(self.clock())
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
        if why_aside:  # after the crash loop: a bug that crashes the same way on any node is no node's fault
            return Decision(False, exit_code=EXIT_FAULTY, set_aside=True, reason=(
                f"{failure.describe()}\n{why_aside}: this node is set aside (named in run.dir/excluded-nodes): the "
                f"other nodes go on without it, a spare in its place; launch again elsewhere to resume here"))
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
