"""Preemption, as one node's launcher handles it: SIGTERM (or Ctrl-C) to the launcher is passed to the
ranks, which finish the step, commit an emergency checkpoint and exit 75 within `fault.preempt_grace_s`.
The ranks still running when the grace period (less a reserve to finish in) runs out print their stacks
and are SIGKILLed; a second signal AGAIN_AFTER_S after the first stops at once (sooner, it is the one
signal sent to the pid and to the process group). Between worker groups (a rendezvous, a backoff) nothing
is left to ask, and the launcher stops soon (`patience`)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from common.timing import AGAIN_AFTER_S, IDLE_PATIENCE_S, OUTCOME_RESERVE_S
from launch.watchdog import print_stacks


@dataclass
class Preemption:
    """A signal to the launcher: when it came (None: none came), whether ranks were running then, the ranks
    told already, whether a second one asked to stop at once, and the newest commit once asked."""

    grace_s: float
    at: float | None = None
    ranks_running: bool = False
    told: set[int] = field(default_factory=set)
    hard: bool = False
    committed_step: int | None = None

    def signalled(self, signum: int, now: float, ranks_running: bool) -> str | None:
        """The launcher got `signum`: the first time, the signal's name (the caller says so); a later one
        asks to stop at once, when it came AGAIN_AFTER_S after the first or more."""
        if self.at is not None:
            self.hard = self.hard or now - self.at >= AGAIN_AFTER_S
            return None
        self.at, self.ranks_running = now, ranks_running
        return signal.Signals(signum).name

    def forward(self, agent, now: float, beats: Callable[[], dict]) -> None:
        """SIGTERM each rank of the agent's group once; SIGKILL them when the grace period is over (`beats`:
        where they are, for their stacks) or a second signal came."""
        agent.stop_restarts()
        pids = set(agent.worker_pids().values())
        agent.terminate(pids - self.told)
        self.told |= pids
        if self.hard or now > self.at + self.grace_s - min(5.0, 0.25 * self.grace_s):  # a reserve to finish in
            if not self.hard:  # once: where the ranks that did not commit in time are stuck
                print_stacks(beats(), "did not commit its emergency checkpoint in time")
            self.hard = True
            agent.kill()

    def patience(self, now: float) -> float:
        """How long to wait, signalled, with no rank running, before stopping: IDLE_PATIENCE_S, or less once
        the end of the grace period nears."""
        return min(IDLE_PATIENCE_S, max(0.0, self.at + self.grace_s - OUTCOME_RESERVE_S - now))
