"""A memory snapshot of another world size, put back in this world (trainer.checkpoint.memory describes
the tier): a lost node under `--nnodes MIN:MAX` leaves a smaller world whose nodes hold every part of the
larger one between them (their own parts and the peer copies of the lost node's; a part a rank's node lacks
is sent to it first, trainer.checkpoint.memory_peers.share_parts), and a run started again with another
`--nproc-per-node` finds its old parts on its node. Each rank then reads from those files, not from the
durable checkpoint, the rows of each tensor it holds now.

FSDP2 shards every parameter (and its optimizer state) along dim 0 over a one-dimensional mesh: the
local shards of ranks 0..W-1, in rank order, are the whole tensor. So the rows a rank holds in this world
are found in the old parts by row offsets alone: the old offsets from the old headers' shapes, this
rank's from its peers' local sizes (one all_gather). A tensor every part holds whole (the optimizer's
step counts; everything at world 1, where nothing is sharded) comes from the first part. The data position is global (it
re-slices); the RNG is per rank and, as with a durable checkpoint of another world, not restored."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from trainer.checkpoint.commit import TrainState
from trainer.checkpoint.memory_state import listed_tensors, make_optimizer_state, read_into, restore_hyper_parameters

Parts = dict[int, tuple[Path, dict]]  # {old rank: (bin, header)}: every part of one step of the old world


class ReshardError(ValueError):
    """The snapshot cannot be laid out on this world (another layout than FSDP2's dim-0 shards)."""


def row_offsets(sizes: list[int]) -> list[int]:
    """Where each rank's rows start, given each rank's number of rows, in rank order."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def overlaps(old_offsets: list[int], old_sizes: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """The pieces of rows [start, stop) and the old part each lies in: (part, first row, end row)."""
    pieces = []
    for part, (at, n) in enumerate(zip(old_offsets, old_sizes, strict=True)):
        lo, hi = max(start, at), min(stop, at + n)
        if lo < hi:
            pieces.append((part, lo, hi))
    return pieces


def _layout_of(t: torch.Tensor, name: str) -> bool:
    """Whether `t` is sharded along dim 0 (FSDP2); raises for a layout this module does not read."""
    if not isinstance(t, DTensor):
        return False
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ReshardError(f"{name}: placements {t.placements} on a {t.device_mesh.ndim}-D mesh, not dim-0 shards")
    return True


@torch.no_grad()
def restore(parts: Parts, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
            world: int) -> TrainState:
    """Collective (over this world's `world` ranks): this rank's rows of every tensor of `parts` (every
    part of one step of the old world, verified) written in place, and the old hyper-parameters; returns
    the train state (its `world` is the old one)."""
    make_optimizer_state(model, optimizer)
    listed = listed_tensors(model, optimizer)
    tables = [{row[0]: row for row in parts[p][1]["tensors"]} for p in range(len(parts))]
    for part, table in enumerate(tables):
        if set(table) != {name for name, _ in listed}:
            raise ReshardError(f"the snapshot's part {part} lists other tensors than this model and optimizer")
    sharded = [_layout_of(t, name) for name, t in listed]  # here (at world 1 nothing is)
    mine = [t.to_local().shape[0] if s else 0 for (_, t), s in zip(listed, sharded, strict=True)]
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    files = [open(parts[p][0], "rb") for p in range(len(parts))]  # noqa: SIM115 - closed below
    try:
        for i, ((name, full), s) in enumerate(zip(listed, sharded, strict=True)):
            rows = [table[name] for table in tables]  # [name, dtype, shape, offset, nbytes] in each part
            t = full.to_local() if s else full
            if any(r[1] != str(t.dtype).removeprefix("torch.") for r in rows):
                raise ReshardError(f"{name}: snapshot {rows[0][1]}, here {t.dtype}")
            shape = list(full.shape)
            if all(r[2] == shape for r in rows):  # not sharded there: every part holds it whole
                rows, sizes = rows[:1], [shape[0] if shape else 0]
            else:
                sizes = [r[2][0] if r[2] else 0 for r in rows]
                if not shape or sum(sizes) != shape[0] or any(r[2][1:] != shape[1:] for r in rows if r[4]):
                    raise ReshardError(f"{name}: shards {[r[2] for r in rows]} do not make {shape}")
            if not shape:
                read_into(files[0], rows[0][3], t)
                continue
            start = row_offsets([n[i] for n in everyone])[rank] if s else 0
            offsets, row_bytes = row_offsets(sizes), t[0].numel() * t.element_size() if t.shape[0] else 0
            for part, lo, hi in overlaps(offsets, sizes, start, start + t.shape[0]):
                read_into(files[part], rows[part][3] + (lo - offsets[part]) * row_bytes, t[lo - start:hi - start])
    finally:
        for f in files:
            f.close()
    restore_hyper_parameters(optimizer, parts[0][1]["param_groups"])
    return TrainState(**parts[0][1]["state"])

