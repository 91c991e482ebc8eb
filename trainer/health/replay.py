"""What a replay compares: each rank's fingerprint of a step's results, the bits of its loss and a checksum
of the bits of its gradient shards (after the gradients were reduced and clipped), gathered on every rank.
A run is bit-identical to an uninterrupted one, so the same step computed twice on healthy hardware gives
the same fingerprints on every rank; a rank whose fingerprint differs computed something else."""

from __future__ import annotations

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
    grads = local_gradients(model)
    checksum = torch.stack([_bits_sum(g).to(loss.device) for g in grads]).sum() if grads else torch.zeros(
        (), dtype=torch.int64, device=loss.device)
    return torch.stack([_bits_sum(loss.float().reshape(1)).to(loss.device), checksum])


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
