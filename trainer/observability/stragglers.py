"""Straggler detection (report only, no restart). Every metrics record has each rank's own work per step
in its log window (data wait + forward/backward + optimizer, without the time spent waiting in
collectives, see trainer.observability.metrics.LogWindow) and its score: that time over the median of the other ranks'.
Whether a rank is a straggler is judged over periods of at least `fault.straggler_s` seconds of
training (whole log windows, so a few noisy steps on a busy machine do not count): a rank whose score
over a period (its work over the period against the others') is at least `fault.straggler_factor` is a
straggler from then on, until its score over a later period is below the factor. The loop reports each
change once: a log line, and a `straggler` event in the ledger on rank 0.

Why the median of the *other* ranks: with two ranks the median of all is their mean, so a rank twice
as slow as its peer would score 1.33 and one three times as slow only 1.5."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def straggler_scores(times: list[float]) -> list[float]:
    """Each rank's time divided by the median of the other ranks' times (1.0 for a lone rank, or when
    the others took no measurable time)."""
    scores = []
    for rank, own in enumerate(times):
        others = times[:rank] + times[rank + 1:]
        median = statistics.median(others) if others else 0.0
        scores.append(own / median if median > 0 else 1.0)
    return scores


@dataclass
class Change:
    """A rank that became a straggler (`slow`) or stopped being one (`recovered`) over the last period."""

    rank: int
    status: str  # slow | recovered
    score: float  # over the period
    time_s: float  # the rank's own work per step over the period
    others_s: float  # the median of the other ranks' own work per step over the period
    period_s: float  # how long the period was (seconds of training)


@dataclass
class StragglerWatch:
    """Scores every log window, judges every period of at least `period_s` seconds, and keeps which
    ranks are stragglers now (`flagged`). factor 0 = off."""

    factor: float
    period_s: float
    flagged: set[int] = field(default_factory=set)
    _work: list[float] = field(default_factory=list)  # per rank: seconds of own work in this period
    _steps: int = 0  # steps in this period
    _elapsed: float = 0.0  # seconds in this period

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def update(self, times: list[float], steps: int, elapsed_s: float,
               judged: bool = True) -> tuple[list[float], list[Change]]:
        """A log window of `steps` steps that took `elapsed_s`, with each rank's own work per step (`times`):
        the window's scores (one per rank), and the ranks whose state changed with the period it ended.
        `judged=False`: the window only gets its scores (the one with a run's first step, whose one-off
        costs differ between ranks)."""
        scores = straggler_scores(times)
        if not judged:
            return scores, []
        if len(self._work) != len(times):
            self._work, self._steps, self._elapsed = [0.0] * len(times), 0, 0.0
        self._work = [total + t * steps for total, t in zip(self._work, times, strict=True)]
        self._steps += steps
        self._elapsed += elapsed_s
        if not self.enabled or self._elapsed < self.period_s:
            return scores, []
        per_step = [total / max(self._steps, 1) for total in self._work]
        period, elapsed = straggler_scores(per_step), self._elapsed
        self._work, self._steps, self._elapsed = [0.0] * len(times), 0, 0.0
        changes = []
        for rank, score in enumerate(period):
            slow = score >= self.factor
            if slow == (rank in self.flagged):
                continue
            (self.flagged.add if slow else self.flagged.discard)(rank)
            others = per_step[:rank] + per_step[rank + 1:]
            changes.append(Change(rank, "slow" if slow else "recovered", score, per_step[rank],
                                  statistics.median(others) if others else 0.0, elapsed))
        return scores, changes
