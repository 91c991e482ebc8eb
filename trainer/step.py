"""One optimizer step: forward and backward over the micro-batches (gradient accumulation), clipping,
the step's check (trainer.health: computed again when anomalous), the non-finite guard, the optimizer
step. `train_step` returns a small `StepResult`; what happens after the step (eval, logging, checkpoints)
is the loop's."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from data.stream import BatchWithPositions
from trainer.config import Config
from trainer.distributed import parallel
from trainer.health import replay
from trainer.health.check import Computed, Outcome, StepHealth, Verdict
from trainer.health.inject import computed_wrong, corrupt_gradients
from trainer.observability.metrics import StepTimer
from trainer.recovery.grad_norm import clip_grad_norm

log = logging.getLogger("rekindle.step")

Micro = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # tokens, RoPE positions, loss mask


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's loss of the step (mean over its micro-batches), detached, not synced
    grad_norm: float  # global (every rank has the same)
    skipped: bool  # the optimizer step was not taken: a non-finite loss or gradient, or data found at fault
    verdict: Verdict | None = None  # what the step's check found (trainer.health), when it found something


def micro_batches(batch: torch.Tensor | BatchWithPositions, size: int, cfg: Config,
                  device: torch.device) -> list[Micro]:
    """Split a loader batch into micro-batches of (tokens, positions or None, loss mask or None),
    keeping only what data.reset_positions / data.mask_boundary_loss ask for."""
    if isinstance(batch, torch.Tensor):
        return [(m, None, None) for m in batch.to(device).split(size)]
    tokens = batch.tokens.to(device).split(size)
    positions = batch.positions.to(device).split(size) if cfg.data.reset_positions else [None] * len(tokens)
    masks = batch.loss_mask.to(device).split(size) if cfg.data.mask_boundary_loss else [None] * len(tokens)
    return list(zip(tokens, positions, masks, strict=True))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micros: list[Micro], cfg: Config,
               info: parallel.DistInfo, timer: StepTimer, delay_s: float = 0.0, health: StepHealth | None = None,
               step: int = 0) -> StepResult:
    """Forward/backward over `micros` (gradients synced on the last), clip, check (`health`: the step may be
    computed again, trainer.health.check), and step unless non-finite or skipped.
    `delay_s`: sleep that long in the forward/backward phase (an injected straggler, trainer.runtime.fault.slowdown)."""
    timer.start()
    if delay_s:
        time.sleep(delay_s)
    rng = torch.get_rng_state() if health is not None else None
    step_loss = _forward_backward(model, micros, cfg, info, step)
    timer.mark()  # forward + backward done
    computed = _reduced(model, step_loss, cfg, info, step, 0)
    outcome = Outcome(computed)
    if health is not None:
        replays = iter(range(1, 4))

        def recompute(elsewhere: bool = False) -> Computed:
            """The step again from its starting state; `elsewhere`: the rank before's micro-batches here."""
            torch.set_rng_state(rng)
            model.zero_grad(set_to_none=True)
            work = [tuple(map(replay.theirs, m)) for m in micros] if elsewhere else micros
            with replay.probed(model) as sums:
                step_loss = _forward_backward(model, work, cfg, info, step)
            done = _reduced(model, step_loss, cfg, info, step, next(replays))
            done.signature = replay.signature(step_loss, sums)
            return done

        outcome = health.check(step, model, computed, recompute)
    taken = outcome.apply and math.isfinite(outcome.computed.grad_norm)  # the norm is global: the same branch
    if taken:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    timer.mark()  # optimizer done
    return StepResult(outcome.computed.loss, outcome.computed.grad_norm, skipped=not taken, verdict=outcome.verdict)


def _forward_backward(model: torch.nn.Module, micros: list[Micro], cfg: Config, info: parallel.DistInfo,
                      step: int = 0) -> torch.Tensor:
    """The step's gradients (reduced on the last micro-batch); its loss here (mean over the micro-batches)."""
    step_loss = torch.zeros((), device=info.device)
    for i, (micro, positions, mask) in enumerate(micros):
        parallel.set_gradient_sync(model, i == len(micros) - 1)
        with parallel.autocast(cfg.dist, info):
            loss = model(micro[:, :-1], positions, targets=micro[:, 1:], mask=mask) / len(micros)
        loss = computed_wrong(loss, info.rank, step)  # a test-only hook (trainer.health.inject)
        loss.backward()
        step_loss += loss.detach()
    return step_loss


def _reduced(model: torch.nn.Module, step_loss: torch.Tensor, cfg: Config, info: parallel.DistInfo, step: int,
             computation: int) -> Computed:
    """One computation of the step, its gradients clipped: the global norm and mean loss (one all-reduce)."""
    total = step_loss.float().clone()
    grad_norm = clip_grad_norm(model.parameters(), cfg.train.grad_clip or float("inf"), also=total)
    corrupt_gradients(model, info.rank, step, computation)  # test-only hooks (trainer.health.inject)
    return Computed(step_loss, grad_norm, float(total) / info.world)


class NonFiniteGuard:
    """Counts skipped steps; `max_bad` in a row raise NonFiniteError."""

    def __init__(self, max_bad: int) -> None:
        self.max_bad, self.in_a_row, self.total = max_bad, 0, 0

    def check(self, step: int, result: StepResult) -> None:
        if not result.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        log.info("step %d: non-finite loss/gradient (norm %s); step skipped (%d/%d in a row)",
                 step, result.grad_norm, self.in_a_row, self.max_bad)
        if self.in_a_row >= self.max_bad:
            raise NonFiniteError(f"{self.in_a_row} steps in a row had a non-finite loss or gradient "
                                 f"(last at step {step}); lower train.lr or check the data")
