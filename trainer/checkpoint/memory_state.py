"""What a memory-tier part holds of a rank's training state, and how it is put back
(trainer.checkpoint.memory describes the tier): the rank's tensors in a fixed order, their layout as one
part's bytes (kept from snapshot to snapshot while the tensors are the same), and the restore in place."""

from __future__ import annotations

import base64
import json
import operator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpoint.commit import TrainState

# (tensor table: [name, dtype, shape, offset, nbytes] per tensor; flat byte views of the non-empty ones;
# the total size)
Layout = tuple[list, list[torch.Tensor], int]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's data on this rank: a DTensor's local shard, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def listed_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The training state's tensors, in a fixed order: the model's parameters and persistent buffers, then
    each parameter's optimizer state (DTensors as they are; `local_tensors` takes their local shards).

    The parameters are the optimizer's (always the sharded ones), named through the model. `state_dict()`
    comes first: FSDP2's pre-save hook reshards the modules that a forward without backward (an eval)
    left unsharded, whose attributes are until then the unsharded parameters, not the optimizer's."""
    persistent = set(model.state_dict().keys())
    names = {p: name for name, p in model.named_parameters()}  # keyed by the objects (held), not their ids
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if p not in names]
    if missing:
        raise ValueError(f"optimizer parameter(s) {missing} are not among the model's parameters")
    out = [(f"model.{name}", p.detach()) for name, p in model.named_parameters()]
    out += [(f"model.{name}", b) for name, b in model.named_buffers() if name in persistent]
    for p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                out.append((f"optim.{names[p]}.{key}", value))
    return out


def local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors of the training state (`listed_tensors`' local shards), in that order. Writing
    into them restores the state in place."""
    return [(name, _local(t)) for name, t in listed_tensors(model, optimizer)]


def state_key(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[int]]:
    """What a listing of `local_tensors` stands for: the objects (the model, the optimizer, each parameter
    and each optimizer state tensor: a load may replace these) and the address of each parameter's local
    shard (FSDP2's lazy init may move it; `to_local()` returns a new view object each time)."""
    objects: list[Any] = [model, optimizer]
    addresses: list[int] = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                objects += (p, *(v for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)))
                addresses.append(_local(p).data_ptr())
    return objects, addresses


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple, list))}
            for g in optimizer.param_groups]


def reshard(model: torch.nn.Module) -> None:
    """Reshard the FSDP2 modules a forward without backward (an eval) left unsharded, at every snapshot
    on every rank. Listing the tensors (`local_tensors`, on a cache miss) reshards them through
    `state_dict()`'s pre-save hook; whether a rank's cache misses depends on its history (a rank that
    replaced a lost one in process has none), and a module left unsharded skips its all-gather at the next
    forward: so ranks with different histories would run different collectives and deadlock. Done on every
    snapshot, the next forward's collectives are the same on every rank (public API; no collective)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def make_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its state tensors if it has none yet (a step with lr 0, as DCP's load does), so
    that a restore has them to write into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not optimizer.state:
        get_state_dict(model, optimizer)


def read_into(f, at: int, dst: torch.Tensor) -> None:
    """Copy the bytes at `at` of an open part into `dst` (a tensor or rows of one, on any device)."""
    nbytes = dst.numel() * dst.element_size()
    if not nbytes:
        return
    f.seek(at)
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise ValueError(f"a part ends early: {len(data)} of {nbytes} bytes at offset {at}")
    dst.copy_(torch.frombuffer(bytearray(data), dtype=dst.dtype).view(dst.shape))


def restore_hyper_parameters(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """Put back what `hyper_parameters` kept (lists back to the tuples they were)."""
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})


class PartLayout:
    """One rank's tensors as the bytes of its part: the layout on the training thread, the bytes to write
    on the writer's."""

    def __init__(self) -> None:
        self._cache: tuple[list, list[int], Layout] | None = None
        self._staging: torch.Tensor | None = None  # on a GPU: the part's bytes in pinned memory, reused
        self._views: tuple[Layout, list[memoryview]] | None = None  # on the CPU: the cached layout's buffers
        self._table_json: tuple[list, str] | None = None  # the cached layout's tensor table, encoded

    def of(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Layout:
        """The part's layout: the header's tensor table (`local_tensors`), flat byte views of the non-empty
        tensors and the total size. Kept from one snapshot to the next while `state_key` is the same (the
        tensors are updated in place) and the tensors are contiguous (the views then alias them), so
        that a snapshot does not list the tensors anew. The cache holds the objects themselves, and its
        views hold the shards' memory, so neither an id nor an address can be reused by a replacement
        while it is kept (a load frees the optimizer's state: a key of ids matched the new objects)."""
        reshard(model)
        objects, addresses = state_key(model, optimizer)
        if self._cache is not None:
            kept, kept_addresses, layout = self._cache
            if kept_addresses == addresses and len(kept) == len(objects) and all(map(operator.is_, kept, objects)):
                return layout
            self._cache = self._views = self._table_json = None
        tensors = local_tensors(model, optimizer)
        table, at = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            table.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), at, nbytes])
            at += nbytes
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in tensors if t.numel()]
        layout = (table, flat, at)
        if all(t.is_contiguous() for _, t in tensors):
            self._cache = (objects, addresses, layout)
        return layout

    def views(self, layout: Layout) -> list[memoryview]:
        """The part's bytes, as buffers to write straight from their memory: the tensors' own on the CPU
        (writing them one by one would hold the interpreter lock the training thread waits for); on a GPU,
        one reused pinned buffer they are first copied into."""
        if self._views is not None and self._views[0] is layout:
            return self._views[1]
        table, flat, at = layout
        if any(v.device.type != "cpu" for v in flat):
            if self._staging is None or self._staging.numel() != at:
                self._staging = torch.empty(at, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            for v, (_, _, _, offset, nbytes) in zip(flat, [row for row in table if row[4]], strict=True):
                self._staging[offset:offset + nbytes].copy_(v)
            flat = [self._staging]
            return [memoryview(self._staging.numpy())]
        views = [memoryview(v.numpy()) for v in flat]
        if self._cache is not None and self._cache[2] is layout:  # they alias the tensors: kept with the layout
            self._views = (layout, views)
        return views

    def table_json(self, table: list) -> str:
        """The tensor table as JSON, encoded once while the layout is kept (most of a header's bytes)."""
        if self._table_json is None or self._table_json[0] is not table:
            self._table_json = (table, json.dumps(table))
        return self._table_json[1]


@torch.no_grad()
def restore(binary: Path, header: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Put a verified part back in place: tensors, hyper-parameters, RNG; returns its train state. The
    optimizer's state is made first if it has none yet."""
    make_optimizer_state(model, optimizer)
    tensors = local_tensors(model, optimizer)
    table = header["tensors"]
    if [row[0] for row in table] != [name for name, _ in tensors]:
        raise ValueError("the snapshot's tensors are not this model's and optimizer's")
    with open(binary, "rb") as f:
        for (name, dtype, shape, at, _nbytes), (_, t) in zip(table, tensors, strict=True):
            if list(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"{name}: snapshot {shape} {dtype}, here {list(t.shape)} {t.dtype}")
            read_into(f, at, t)
    restore_hyper_parameters(optimizer, header["param_groups"])
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(header["rng"])), dtype=torch.uint8))
    return TrainState(**header["state"])
