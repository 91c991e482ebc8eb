"""The check between a step's gradients and its update: anomaly -> replay -> verdict. A step whose loss is
anomalous (trainer.health.anomaly), or one that a spot check picks (`fault.verify_every`),
is computed again from its starting state, which is still in place (the optimizer has not stepped), and each
rank's results are compared bit for bit (trainer.health.replay):

- the replay agrees, on a spot check: nothing to say.
- the replay agrees, on an anomalous step: each rank's micro-batches are computed elsewhere (on the next
  rank). Those agree too: the data is at fault. The step's update is not applied and its samples are skipped
  (recorded in the data state); training goes on. A rank whose micro-batches disagree elsewhere (and which
  disagrees on the ones it computed for another) computes wrong the same way every time: it is faulty.
- the replay differs: some rank computed something else. Its micro-batches are computed elsewhere, and the
  step a third time. When that agrees with the replay and the computation elsewhere with the rank, the first
  computation was a transient corruption (the ranks that differed are named): the replay's results are
  applied. A rank named `REPEATS` times, one whose results differ again, or one that disagrees elsewhere is
  faulty: `FaultyRank` ends it (the launcher sets its node aside).

Every verdict but a clean spot check comes back with the step's outcome (the loop puts it in the ledger).
The decision is the same on every rank: it is taken from values every rank holds (the global loss and
norm, the gathered fingerprints). Its history is part of the training state (`state_dict`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.health.anomaly import AnomalyRule
from trainer.health.replay import differing, fingerprint, gathered, wrong_ranks

REPEATS = 2  # transient corruptions on one rank that make it faulty


class FaultyRank(RuntimeError):
    """This rank computes wrong results: its node should be set aside."""


@dataclass
class Computed:
    """One computation of a step: this rank's loss (mean over its micro-batches), the global gradient norm,
    the global mean loss."""

    loss: torch.Tensor
    grad_norm: float
    mean_loss: float
    signature: torch.Tensor | None = None  # of a replay: what this rank computed (trainer.health.replay)


@dataclass(frozen=True)
class Verdict:
    kind: str  # "data" | "transient" | "faulty"
    step: int
    ranks: list[int]  # the ranks named (none for data)
    evidence: str
    spot_check: bool = False

    def fields(self) -> dict:
        return {"kind": self.kind, "step": self.step, "ranks": self.ranks, "evidence": self.evidence,
                "spot_check": self.spot_check}


@dataclass
class Outcome:
    """What the step does: apply `computed` (the replay's after a transient corruption), or skip it."""

    computed: Computed
    apply: bool = True
    verdict: Verdict | None = None


@dataclass
class StepHealth:
    """The rule, the spot checks' interval, and what was found on each rank so far."""

    rule: AnomalyRule
    verify_every: int = 0
    named: Counter = field(default_factory=Counter)  # rank -> transient corruptions found on it
    replays: int = 0  # steps computed again in this process

    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "named": {str(r): n for r, n in self.named.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state.get("rule", {}))
        self.named = Counter({int(r): n for r, n in state.get("named", {}).items()})

    def check(self, step: int, model: torch.nn.Module, first: Computed,
              recompute: Callable[..., Computed]) -> Outcome:
        """Judge the step's first computation `first`; `recompute()` computes it again from its starting
        state (the gradients replaced), `recompute(elsewhere=True)` with the rank before's micro-batches."""
        reason = self.rule.judge(first.mean_loss, first.grad_norm)
        spot = bool(self.verify_every) and step % self.verify_every == 0
        if not reason and not spot:
            self.rule.accept(first.mean_loss)
            return Outcome(first)
        self.replays += 1
        a = gathered(fingerprint(model, first.loss))
        second = recompute()
        b = gathered(fingerprint(model, second.loss))
        changed = differing(a, b)
        if not changed and not reason:
            self.rule.accept(second.mean_loss)
            return Outcome(second)
        wrong = self._elsewhere(second, recompute, suspects=sorted(changed))
        why = f"{reason}; " if reason else "spot check; "
        if not changed:  # anomalous, and the same again: the data, or a rank wrong the same way every time
            if wrong:
                return self._faulty(step, wrong, f"{why}the replay agrees, but rank(s) {wrong} disagree with the "
                                    f"ranks that computed their micro-batches elsewhere", spot, second)
            return Outcome(second, apply=False, verdict=Verdict(
                "data", step, [], f"{reason}; the replay agrees on every rank, and so do other ranks computing "
                f"each rank's micro-batches", spot))
        third = recompute()
        again = differing(b, gathered(fingerprint(model, third.loss)))
        named = sorted(changed)
        what = "; ".join(f"rank {r}: {', '.join(w)}" for r, w in sorted(changed.items()))
        if again or wrong:
            found = f"again: {sorted(again)}" if again else f"computed elsewhere, rank(s) {wrong} disagree"
            return self._faulty(step, sorted(set(again) | set(wrong) | set(named)), f"{why}the results differ "
                                f"every time ({what}; {found})", spot, third)
        self.named.update(named)
        if repeat := [r for r in named if self.named[r] >= REPEATS]:
            return self._faulty(step, repeat, f"{why}{what} differ from two replays that agree; "
                                f"{REPEATS} transient corruptions on rank(s) {repeat}", spot, third)
        self.rule.accept(third.mean_loss)
        return Outcome(third, verdict=Verdict(
            "transient", step, named, f"{why}{what} differ from two replays that agree, and computed elsewhere "
            f"their micro-batches give what they gave: the replay's results applied", spot))

    @staticmethod
    def _elsewhere(replayed: Computed, recompute: Callable[..., Computed], suspects: list[int]) -> list[int]:
        """The ranks found wrong by computing each rank's micro-batches on another (trainer.health.replay);
        of several candidates, those the replay named (`suspects`) when it named any of them."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return []
        own = gathered(replayed.signature)
        wrong = wrong_ranks(own, gathered(recompute(elsewhere=True).signature))
        return sorted(set(wrong) & set(suspects)) or wrong

    @staticmethod
    def _faulty(step: int, ranks: list[int], evidence: str, spot: bool, computed: Computed) -> Outcome:
        return Outcome(computed, apply=False, verdict=Verdict("faulty", step, ranks, evidence, spot))
