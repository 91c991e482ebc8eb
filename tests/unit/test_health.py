"""The step checks (trainer.health) in one process: the anomaly rule (a robust bar, upward only, judged from a
full window, its history kept in the training state) and the verdicts of anomaly -> replay -> verdict, on a
real model's real gradients, with bits flipped in chosen computations."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.health.anomaly import AnomalyRule
from trainer.health.check import REPEATS, Computed, StepHealth
from trainer.health.replay import wrong_ranks


def test_the_rule_judges_a_loss_far_above_the_window_and_non_finite_values_only():
    rule = AnomalyRule(window=10, threshold=5.0)
    assert rule.judge(100.0, 1.0) == ""  # before a full window: not judged
    for i in range(12):
        rule.accept(3.0 + 0.01 * (i % 3))
    assert len(rule.history) == 10
    assert rule.judge(3.02, 50.0) == ""  # the gradient norm's own range is not judged
    assert rule.judge(1.0, 1.0) == ""  # a loss that falls is no fault
    assert rule.judge(3.5, 1.0).startswith("loss 3.5 is ")
    assert rule.judge(3.0, math.inf).startswith("non-finite") and rule.judge(math.nan, 1.0).startswith("non-finite")
    again = AnomalyRule(window=10, threshold=5.0)
    again.load_state_dict(rule.state_dict())
    assert list(again.history) == list(rule.history) and again.judge(3.5, 1.0) == rule.judge(3.5, 1.0)
    assert AnomalyRule(window=0).judge(1e9, 1.0) == ""  # off: non-finite values only


class Steps:
    """A real model's step, computed as often as asked; `flips`: the computations (0 = the first) whose first
    gradient gets a bit flipped (a corruption on this, the only, rank)."""

    def __init__(self, flips=(), loss_scale: float = 1.0) -> None:
        torch.manual_seed(0)
        self.model, self.x = torch.nn.Linear(4, 2), torch.randn(8, 4)
        self.flips, self.scale, self.n = set(flips), loss_scale, 0

    def compute(self) -> Computed:
        self.model.zero_grad(set_to_none=True)
        loss = self.model(self.x).square().mean() * self.scale
        loss.backward()
        if self.n in self.flips:
            self.model.weight.grad.view(-1).view(torch.int32)[0] ^= 1 << (12 + self.n)
        self.n += 1
        norm = float(torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]).norm())
        return Computed(loss.detach(), norm, float(loss.detach()))


def check(health: StepHealth, steps: Steps, step: int):
    return health.check(step, steps.model, steps.compute(), steps.compute)


def rule_at(loss: float) -> AnomalyRule:
    rule = AnomalyRule(window=5, threshold=5.0)
    for _ in range(5):
        rule.accept(loss)
    return rule


@pytest.mark.parametrize("flips, kind, applied, computations", [
    ((), None, True, 2),  # a spot check that agrees: nothing to say
    ((0,), "transient", True, 3),  # the first differs, two replays agree: the replay's results
    ((0, 1, 2), "faulty", False, 3),  # different every time
])
def test_a_spot_check_finds_nothing_a_transient_corruption_or_a_faulty_rank(flips, kind, applied, computations):
    steps = Steps(flips)
    health = StepHealth(AnomalyRule(window=0), verify_every=10)
    outcome = check(health, steps, 20)
    assert (outcome.verdict.kind if outcome.verdict else None, outcome.apply, steps.n) == (kind, applied, computations)
    if kind:
        assert outcome.verdict.ranks == [0] and outcome.verdict.spot_check and "rank 0: gradients" in \
            outcome.verdict.evidence


def test_a_step_neither_anomalous_nor_spot_checked_is_computed_once_and_joins_the_history():
    steps, health = Steps(), StepHealth(rule_at(0.5), verify_every=10)
    outcome = check(health, steps, 7)
    assert outcome.apply and outcome.verdict is None and steps.n == 1 and health.replays == 0
    assert len(health.rule.history) == 5 and health.rule.history[-1] == outcome.computed.mean_loss


def test_an_anomalous_loss_that_replays_the_same_is_the_datas_fault_and_not_applied():
    steps, health = Steps(loss_scale=100.0), StepHealth(rule_at(0.5))
    outcome = check(health, steps, 7)
    assert (outcome.verdict.kind, outcome.apply, steps.n) == ("data", False, 2), outcome
    assert "the replay agrees on every rank" in outcome.verdict.evidence
    assert list(health.rule.history) == [0.5] * 5  # the spike does not move the bar


def test_a_rank_found_with_transient_corruptions_repeatedly_is_faulty():
    health = StepHealth(AnomalyRule(window=0), verify_every=1)
    kinds = [check(health, Steps(flips=(0,)), step).verdict.kind for step in range(1, REPEATS + 1)]
    assert kinds == ["transient"] * (REPEATS - 1) + ["faulty"]
    again = StepHealth(AnomalyRule(window=0), verify_every=1)
    again.load_state_dict(health.state_dict())
    assert again.named == health.named


def test_a_rank_wrong_the_same_way_every_time_is_named_by_its_work_computed_elsewhere():
    """`own[r]`: rank r's signature of its micro-batches; `moved[r]`: rank r's of rank r-1's. A wrong rank
    disagrees on both; with two ranks nothing tells which one is wrong, so both are named."""
    own = torch.tensor([[1, 10], [2, 20], [3, 30], [4, 40]])
    moved = own.roll(1, dims=0)  # rank r computed rank r-1's micro-batches right
    assert wrong_ranks(own, moved) == []
    bad_own, bad_moved = own.clone(), moved.clone()
    bad_own[2, 1] += 1  # rank 2 wrong on its own micro-batches
    bad_moved[2, 0] += 1  # and on rank 1's
    assert wrong_ranks(bad_own, bad_moved) == [2]
    assert wrong_ranks(bad_own, moved) == []  # one disagreement alone names nobody
    two, two_moved = own[:2].clone(), own[:2].roll(1, dims=0)
    two[0, 0] += 1
    two_moved[0, 0] += 1  # rank 0 computed rank 1's wrong too
    assert wrong_ranks(two, two_moved) == [0, 1]
