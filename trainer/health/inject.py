"""Test-only hooks for faults that crash nothing, each a no-op unless its environment variable is set:

    REKINDLE_FLIP_GRAD="rank@step"        one bit of `rank`'s gradient flipped in the first computation of
                                          `step` (a transient corruption: a replay computes it right)
    REKINDLE_CORRUPT_RANK="rank[@first]"  a bit of `rank`'s gradient flipped in every computation from step
                                          `first` (default 1), a different bit each time (a faulty rank;
                                          rank `*`: every rank of the processes that have the variable)
    REKINDLE_WRONG_RANK="rank[@first]"    `rank` computes every micro-batch's loss (and so its gradients)
                                          3x too large from step `first`, the same way every time: a replay
                                          agrees, only a computation elsewhere disagrees

(A poisoned stretch of data, whose loss spikes the same every time: data.stream's REKINDLE_POISON.)

The flips are of a mantissa bit of the first element of the rank's first gradient shard: the values stay
finite and close, so only a replay sees them."""

from __future__ import annotations

import os

import torch

from trainer.health.replay import AS_INTEGER, local_gradients

FLIP_GRAD_ENV = "REKINDLE_FLIP_GRAD"
CORRUPT_RANK_ENV = "REKINDLE_CORRUPT_RANK"
WRONG_RANK_ENV = "REKINDLE_WRONG_RANK"
WRONG_FACTOR = 3.0


def _rank_at(value: str, rank_here: int) -> tuple[int, int] | None:
    """(rank, step) of "rank@step"; rank `*`: whichever this process is (set on one node's launcher only)."""
    if not value:
        return None
    rank, _, step = value.partition("@")
    return (rank_here if rank == "*" else int(rank)), int(step or 1)


def corrupt_gradients(model: torch.nn.Module, rank: int, step: int, computation: int) -> None:
    """Flip a gradient bit on this rank when a hook names it (`computation`: 0 for a step's first, 1, 2 for
    its replays)."""
    flip = _rank_at(os.environ.get(FLIP_GRAD_ENV, ""), rank)
    faulty = _rank_at(os.environ.get(CORRUPT_RANK_ENV, ""), rank)
    if flip is not None and flip == (rank, step) and computation == 0:
        _flip(model, bit=20)
    elif faulty is not None and faulty[0] == rank and step >= faulty[1]:
        _flip(model, bit=10 + computation % 10)


def computed_wrong(loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """A micro-batch's loss as a rank whose hardware computes wrong the same way every time has it."""
    wrong = _rank_at(os.environ.get(WRONG_RANK_ENV, ""), rank)
    return loss * WRONG_FACTOR if wrong is not None and wrong[0] == rank and step >= wrong[1] else loss


def _flip(model: torch.nn.Module, bit: int) -> None:
    grads = [g for g in local_gradients(model) if g.numel()]
    if not grads:
        return
    flat = grads[0].detach().reshape(-1)
    as_int = flat.view(AS_INTEGER[flat.dtype])
    as_int[0] ^= 1 << (bit if flat.dtype == torch.float32 else bit % 7)

