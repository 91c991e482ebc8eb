"""What a replay compares: each rank's fingerprint of a step's results, the bits of its loss and a checksum
of the bits of its gradient shards (after the gradients were reduced and clipped), gathered on every rank.
A run is bit-identical to an uninterrupted one, so the same step computed twice on healthy hardware gives
the same fingerprints on every rank; a rank whose fingerprint differs computed something else.

A fault that computes wrong the same way every time replays the same. To see it, a rank's micro-batches are
computed elsewhere: each rank computes the micro-batches of the rank before it (`theirs`), and the signatures
of those computations (`probed`: the loss bits, and the bits of the gradient that reached the token
embeddings through every layer's backward, both local to the rank that computed them) are compared with the
owner's own (`wrong_ranks`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# The integer type of each float type's width: its bits read as a number.
AS_INTEGER = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
               torch.float64: torch.int64}


def local_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's gradient tensors (its shards, under FSDP2)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's bits read as integers (int64): any flipped bit changes it."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(AS_INTEGER[flat.dtype]).sum(dtype=torch.int64)


def fingerprint(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """This rank's (loss bits, gradient bits checksum), int64, on the loss's device."""
    return signature(loss, [_bits_sum(g) for g in local_gradients(model)])


def gathered(mine: torch.Tensor) -> torch.Tensor:
    """Every rank's fingerprint, (world, 2), the same on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine.reshape(1, -1)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out)


def differing(a: torch.Tensor, b: torch.Tensor) -> dict[int, list[str]]:
    """Ranks whose fingerprints differ between two computations of one step -> what differed."""
    out: dict[int, list[str]] = {}
    for rank in range(a.shape[0]):
        what = [name for i, name in enumerate(("loss", "gradients")) if int(a[rank, i]) != int(b[rank, i])]
        if what:
            out[rank] = what
    return out


@contextmanager
def probed(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within: each backward's gradient at the token embeddings' output, as a bits sum, appended to the list."""
    sums: list[torch.Tensor] = []

    def on_forward(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda grad: sums.append(_bits_sum(grad)))

    handle = model.tok_embeddings.register_forward_hook(on_forward)
    try:
        yield sums
    finally:
        handle.remove()


def signature(loss: torch.Tensor, sums: list[torch.Tensor]) -> torch.Tensor:
    """(loss bits, the sum of `sums`: bits sums of gradients), int64, on the loss's device: a fingerprint's
    (gradient shards), or a computation's signature local to the rank that made it (embedding gradients)."""
    total = torch.stack([t.to(loss.device) for t in sums]).sum() if sums else torch.zeros(
        (), dtype=torch.int64, device=loss.device)
    return torch.stack([_bits_sum(loss.float().reshape(1)).to(loss.device), total])


def theirs(t: torch.Tensor | None) -> torch.Tensor | None:
    """The same tensor of the rank before this one (of its micro-batches, to compute here); None stays None."""
    if t is None:
        return None
    sent = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()  # gloo gathers no bool
    every = [torch.empty_like(sent) for _ in range(dist.get_world_size())]
    dist.all_gather(every, sent)
    return every[(dist.get_rank() - 1) % len(every)].to(t.dtype)


def wrong_ranks(own: torch.Tensor, moved: torch.Tensor) -> list[int]:
    """Ranks that computed wrong: `own[r]` is rank r's signature of its micro-batches, `moved[r]` rank r's of
    rank r-1's. A rank is wrong when both its own micro-batches, computed by the next rank, and those it
    computed for the rank before disagree. With two ranks both are named: nothing tells which one it is."""
    world = own.shape[0]
    off = {o for o in range(world) if not torch.equal(own[o], moved[(o + 1) % world])}
    return [r for r in range(world) if r in off and (r - 1) % world in off]
