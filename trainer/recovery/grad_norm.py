"""The global gradient norm and clipping to it, on each rank's own shards.

`torch.nn.utils.clip_grad_norm_` on FSDP2's sharded (DTensor) gradients goes through DTensor's
dispatch for every operation: a per-step cost in Python, and, in a process that has not run it yet (a
rank that replaces a failed one, trainer.recovery.inplace), DTensor's sharding-rule caches are cold, which
makes that rank's first clip many times slower than a survivor's (docs/performance.md).
When every gradient is sharded on one mesh dimension, as FSDP2 shards them, the norm is the square root
of the sum over the ranks of each rank's sum of squares: one all-reduce of one number, on plain local
tensors. Anything else (a replicated or multi-dimensional placement) takes torch's path."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

EPS = 1e-6  # as torch.nn.utils.clip_grads_with_norm_


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                   also: torch.Tensor | None = None) -> float:
    """Scale the gradients in place so that their global L2 norm is at most `max_norm` (inf: measure
    only), as `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping (the same on
    every rank; inf or nan when a gradient is not finite). `also` (a float32 scalar) is summed over the
    ranks in place, in the same all-reduce."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return 0.0
    group = shard_group(grads)
    if group is False:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if also is not None and dist.is_initialized():
            dist.all_reduce(also)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squares = torch.stack([n.float() for n in torch._foreach_norm(local, 2.0)]).square().sum()
    if group is not None:
        both = squares if also is None else torch.stack([squares, also.reshape(())])
        dist.all_reduce(both, group=group)
        squares = both if also is None else both[0]
        if also is not None:
            also.copy_(both[1].reshape(also.shape))
    total = squares.sqrt()
    if max_norm != float("inf"):
        torch._foreach_mul_(local, torch.clamp(max_norm / (total + EPS), max=1.0))
    return float(total)


def shard_group(grads: list[torch.Tensor]) -> dist.ProcessGroup | None | bool:
    """The process group over which the gradients are sharded, when every one is a DTensor sharded on
    the same one-dimensional mesh; None when none is a DTensor (one process: the tensors are whole);
    False otherwise (torch's path)."""
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return None
    mesh = sharded[0].device_mesh
    if len(sharded) != len(grads) or mesh.ndim != 1:
        return False
    if any(g.device_mesh != mesh or not all(p.is_shard() for p in g.placements) for g in sharded):
        return False
    return mesh.get_group()
