"""The memory tier: every `checkpoint.memory_every` steps each rank writes its own shard of the training
state to node-local memory that outlives the process (`checkpoint.memory_dir`, default a directory in
/dev/shm), so a restarted rank resumes from the last step or the one before it instead of the last
durable checkpoint. The durable tier (trainer.checkpoint.checkpointer) is unchanged beside it.

What a snapshot holds, per rank: the model's and the optimizer's tensors exactly as they lie on this rank
(FSDP2's local shards: no collective, no resharding), the optimizer's hyper-parameters, the train state
(step, tokens, data-loader position; not the config, which config_sha256 pins), this rank's RNG state, and
the metrics records not written yet (the ranks exchange them every few steps; a resume writes them).
It is written in the background while the next step computes; `optimizer.step()`, the only thing that
changes those tensors, waits for it. The tensors are written straight from their memory in one
`pwritev` (on a GPU after one copy into a reused pinned buffer) and checksummed; on the training thread
a snapshot costs a few list lookups (the tensor list is kept while the optimizer's state is the same
objects).

Peer replicas (`checkpoint.memory_replicas`, with more than one node): after writing its part, each
rank sends it to its buddy, the rank with the same local rank on the next node ((r + local world) mod
world), over a process group of the tier's own, and keeps the part it receives from the previous node's
rank as a peer copy. Losing a whole node (its processes and its memory) then loses nothing in memory.

Files, in `<memory_dir>/<run id>/`: `slot-<k>.rank-<r>.bin` (the tensors' bytes of rank r's part) and
`.json` (the header: run id, config hash, world size, rank, step, the tensors' names, dtypes, shapes and
offsets, the xxh3-128 checksum of the .bin, train state, RNG, unwritten records); a peer copy is
`peer-slot-<k>.rank-<r>`.
Step s goes to slot s // memory_every % 3: the slot's header is deleted, the .bin overwritten in place,
and the new header written last (temp file, rename), so a rank killed mid-write leaves a slot without a
header, which is never used. Three slots because ranks write in the background: when one rank starts
step s, every other rank has finished at least the step two snapshots back (FSDP's gradient
reduce-scatter in step s needs every rank's backward of s, which comes after that rank's
optimizer.step of s-1, which waited for its snapshot before that), and a rank never overwrites that
one. So each rank holds at most two complete steps plus the one in flight (and as many peer copies).

Commit rule: a step is usable when every rank's part of it verifies somewhere (header of this run,
config and world size; the .bin's size and checksum), on its own node or as a peer copy. Ranks agree on
it at restore (`plan`, one all_gather); nothing is collective while training but the peer copies. Each
rank loads its own part from its node's memory when it is there (memory-local), else the rank holding it
sends it (memory-peer: a lost node, or ranks that moved between nodes). Parts of two steps are never
mixed: every rank loads the same step. Another run (a new run id, kept in run.dir) or another config
never loads them; the run's directory is removed when the run ends.
"""

from __future__ import annotations

import base64
import json
import operator
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer import storage
from trainer.checkpoint.commit import TrainState
from trainer.observability import logs

log = logs.get_logger("memory")

SLOTS = 3
IOV_MAX = 1024  # buffers per pwritev (Linux's limit)
VERSION = 1
RUN_ID_FILE = "memory-tier.json"  # in run.dir: {"run_id": ..., "auto_every": ...}, made by the run's first start
OWNER = "owner.json"  # in the run's memory directory: {"run_dir": ...}


MEMORY_DIR_ENV = "REKINDLE_MEMORY_DIR"  # the default checkpoint.memory_dir, where set


def default_dir() -> str:
    """$REKINDLE_MEMORY_DIR; else /dev/shm/rekindle-memory when there is a /dev/shm (memory, survives the
    process); else $TMPDIR."""
    if os.environ.get(MEMORY_DIR_ENV):
        return os.environ[MEMORY_DIR_ENV]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return str(base / "rekindle-memory")


def run_record(run_dir: str, is_main: bool, world: int) -> dict:
    """This run's record (run.dir/memory-tier.json): its id, made once by rank 0, and what
    `checkpoint.memory_every=auto` settled on (trainer.checkpoint.memory_auto); the same on every rank. A
    run.dir made afresh gets a new id, so snapshots of an earlier run under the same name are never loaded."""
    record: dict = {}
    if is_main:
        path = Path(run_dir) / RUN_ID_FILE
        try:
            record = json.loads(path.read_text())
            if not isinstance(record.get("run_id"), str):
                raise ValueError("no run id")
        except (OSError, ValueError, AttributeError):
            record = {"run_id": uuid.uuid4().hex[:16]}
            storage.write_file(storage.filesystem(str(path))[0], str(path), json.dumps(record).encode(), durable=True)
    if world > 1:
        box = [record]
        dist.broadcast_object_list(box, src=0)
        record = box[0]
    return record


def config_identity(config: dict) -> str:
    """The config hash snapshots are tagged with: the run's config less the settings that do not touch
    the state (where each node keeps its memory; how the launcher restarts ranks)."""
    import hashlib

    rest = {**config, "checkpoint": {k: v for k, v in config.get("checkpoint", {}).items() if k != "memory_dir"},
            "fault": {k: v for k, v in config.get("fault", {}).items() if k != "warm_restarts"}}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _held(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local data: the DTensor's local shard, else the parameter."""
    return p.to_local() if isinstance(p, DTensor) else p


def local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors of the training state, in a fixed order: the model's parameters and persistent
    buffers, then each parameter's optimizer state. Writing into them restores the state in place.

    The parameters are the optimizer's (always the sharded ones), named through the model. `state_dict()`
    comes first: FSDP2's pre-save hook reshards the modules that a forward without backward (an eval)
    left unsharded, whose attributes are until then the unsharded parameters, not the optimizer's."""
    persistent = set(model.state_dict().keys())
    names = {p: name for name, p in model.named_parameters()}  # keyed by the objects (held), not their ids
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if p not in names]
    if missing:
        raise ValueError(f"optimizer parameter(s) {missing} are not among the model's parameters")
    out = [(f"model.{name}", _held(p.detach())) for name, p in model.named_parameters()]
    out += [(f"model.{name}", _local(b)) for name, b in model.named_buffers() if name in persistent]
    for p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                out.append((f"optim.{names[p]}.{key}", _local(value)))
    return out


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
                addresses.append(_held(p).data_ptr())
    return objects, addresses


def _hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple, list))}
            for g in optimizer.param_groups]


class MemoryTier:
    """One rank's snapshots (write in the background, scan, agree, load); see the module docstring."""

    def __init__(self, directory: str, run: str, config_sha256: str, rank: int, world: int, every: int,
                 run_dir: str, on_failure: Callable[[str], None] | None = None, local_world: int | None = None,
                 replicas: int = 0) -> None:
        self.dir = Path(directory) / run
        self.run, self.config_sha256, self.rank, self.world, self.every = run, config_sha256, rank, world, every
        self.local_world = local_world or world  # ranks per node: nodes hold contiguous blocks of ranks
        nodes = world // self.local_world if world % self.local_world == 0 else 1
        self.replicas = min(replicas, 1) if nodes > 1 else 0
        # The peer copies travel on a group of their own (the training thread's collectives are on the
        # default one). Made by every rank, in the same order, when the tier is built.
        self._group = dist.new_group(backend="gloo") if self.replicas else None
        self.buddy = (rank + self.local_world) % world  # gets this rank's part
        self.source = (rank - self.local_world) % world  # sends its part here
        self.dir.mkdir(parents=True, exist_ok=True)
        owner = {"run_dir": str(Path(run_dir).resolve())}
        if not (self.dir / OWNER).exists():
            storage.write_file(storage.filesystem(str(self.dir))[0], str(self.dir / OWNER), json.dumps(owner).encode())
        if rank % self.local_world == 0:  # one rank per node sweeps (and rank 0 says so)
            self._sweep(owner)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="memory")
        self._pending: Future | None = None
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # optimizers that wait for the writes (not ids)
        self._staging: torch.Tensor | None = None  # on a GPU: the part's bytes in pinned memory, reused
        self.on_failure = on_failure or (lambda message: None)
        self.failed_in_a_row = 0
        self.bytes = 0
        self._sized = False
        self.waited_s = 0.0
        self.call_s = 0.0  # the last snapshot() on the training thread, less its wait for the previous one
        self.write_s = 0.0  # the last background write (and exchange) that finished
        self.skipped: list[str] = []  # why the last scan passed over parts on this node
        self.restored_extra: dict = {}  # what the loaded snapshot carried besides the state
        self._layout_cache: tuple[list, list[int], tuple[list, list[torch.Tensor], int]] | None = None

    def _sweep(self, owner: dict) -> None:
        """Remove the snapshots that earlier runs of this run.dir left on this node (a run.dir made afresh
        gets a new run id; one job per run.dir holds its lease, so they are no one's)."""
        for other in self.dir.parent.iterdir():
            try:
                stale = other != self.dir and json.loads((other / OWNER).read_text()) == owner
            except (OSError, ValueError):
                continue
            if stale:
                shutil.rmtree(other, ignore_errors=True)
                if self.rank == 0:
                    log.info("removed the memory snapshots of an earlier run of this run.dir (%s)", other)

    # ------------------------------------------------------------------ writing
    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def snapshot(self, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 records: list = ()) -> None:
        """Start writing this rank's part of `state.step`; returns at once. The previous snapshot must be
        finished (optimizer.step() waited for it). `records`: the metrics records not written yet
        (objects with `to_json()`, serialized by the writer), given back by `load` as `restored_extra`."""
        self.wait()
        start = time.perf_counter()
        if optimizer not in self._hooked:
            optimizer.register_step_pre_hook(lambda *_: self.wait())
            self._hooked.add(optimizer)
        layout = self._layout(model, optimizer)
        # The train state without the config and model arguments (the same as the run's: config_sha256)
        # and without copies: none of its values is changed in place while the writer runs.
        kept = {f.name: getattr(state, f.name) for f in fields(state) if f.name not in ("config", "model", "rng")}
        header = {
            "version": VERSION, "run_id": self.run, "config_sha256": self.config_sha256, "rank": self.rank,
            "world": self.world, "step": state.step,
            "state": kept, "rng": base64.b64encode(torch.get_rng_state().numpy()).decode(),
            "param_groups": _hyper_parameters(optimizer), "records": list(records),
        }
        self._pending = self._writer.submit(self._write, header, layout)
        self.call_s = time.perf_counter() - start

    def _layout(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list[torch.Tensor], int]:
        """The part's layout: the header's tensor table (`local_tensors`), flat byte views of the non-empty
        tensors and the total size. Kept from one snapshot to the next while `state_key` is the same (the
        tensors are updated in place) and the tensors are contiguous (the views then alias them): listing
        them anew cost more than a millisecond a step. The cache holds the objects themselves, and its
        views hold the shards' memory, so neither an id nor an address can be reused by a replacement
        while it is kept (a load frees the optimizer's state: a key of ids matched the new objects)."""
        objects, addresses = state_key(model, optimizer)
        if self._layout_cache is not None:
            kept, kept_addresses, layout = self._layout_cache
            if kept_addresses == addresses and len(kept) == len(objects) and all(map(operator.is_, kept, objects)):
                return layout
            self._layout_cache = None
        tensors = local_tensors(model, optimizer)
        table, at = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            table.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), at, nbytes])
            at += nbytes
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in tensors if t.numel()]
        layout = (table, flat, at)
        if all(t.is_contiguous() for _, t in tensors):
            self._layout_cache = (objects, addresses, layout)
        return layout

    def _slot(self, step: int) -> int:
        return step // max(self.every, 1) % SLOTS

    def _paths(self, slot: int, rank: int | None = None, peer: bool = False) -> tuple[Path, Path]:
        base = f"{'peer-' if peer else ''}slot-{slot}.rank-{self.rank if rank is None else rank}"
        return self.dir / f"{base}.bin", self.dir / f"{base}.json"

    @torch.no_grad()
    def _write(self, header: dict, layout: tuple[list, list[torch.Tensor], int]) -> None:
        """This rank's part into its slot, then (with replicas) the exchange with the buddies. The
        exchange happens whatever became of the write, so that no peer waits for a part that never comes."""
        error: Exception | None = None
        start = time.perf_counter()
        try:
            self._write_part(header, layout)
        except Exception as e:  # noqa: BLE001 - raised after the exchange
            error = e
        if self._group is not None:
            self._exchange(header["step"], ok=error is None)
        self.write_s = time.perf_counter() - start
        if error is not None:
            raise error

    def _write_part(self, header: dict, layout: tuple[list, list[torch.Tensor], int]) -> None:
        """The tensors' bytes written straight from their memory in one `pwritev`, then checksummed (on a
        GPU they are first copied into one reused pinned buffer): writing them one by one held the
        interpreter lock for about 15 us each, time the training thread waited for."""
        table, flat, at = layout
        if any(v.device.type != "cpu" for v in flat):
            if self._staging is None or self._staging.numel() != at:
                self._staging = torch.empty(at, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            for v, (_, _, _, offset, nbytes) in zip(flat, [row for row in table if row[4]], strict=True):
                self._staging[offset:offset + nbytes].copy_(v)
            flat = [self._staging]
        views = [memoryview(v.numpy()) for v in flat]
        binary, head = self._paths(self._slot(header["step"]))
        head.unlink(missing_ok=True)  # from here until the new header is written, the slot is unusable
        fd = os.open(binary, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _write_all(fd, views)
            if os.fstat(fd).st_size != at:
                os.ftruncate(fd, at)
        finally:
            os.close(fd)
        digest = storage.new_digest()
        for view in views:
            digest.update(view)
        header.update(bytes=at, checksum=digest.hexdigest(), tensors=table,
                      records=[r.to_json() for r in header["records"]])
        _write_header(head, header)
        self.bytes = at

    def _exchange(self, step: int, ok: bool) -> None:
        """Send this rank's part of `step` to the buddy; keep the one the source rank sends as a peer copy."""
        slot = self._slot(step)
        payload = _read_part(*self._paths(slot)) if ok else (b"", b"")
        peer_binary, peer_head = self._paths(slot, self.source, peer=True)
        peer_head.unlink(missing_ok=True)
        header, data = _send_recv(payload, self.buddy, self.source, self._group)
        if header:
            peer_binary.write_bytes(data)
            _write_header(peer_head, json.loads(header))

    def wait(self) -> None:
        """Block until the snapshot in flight is written. A failed one (memory full, ...) is a warning:
        training goes on with the durable tier and the older snapshots."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        start = time.perf_counter()
        try:
            pending.result()
            if self.failed_in_a_row or not self._sized:
                self._sized = True
                if self.rank == 0:
                    held = SLOTS * (2 if self.replicas else 1)
                    log.info("memory tier: %.1f MB per snapshot on rank 0, at most %.1f MB held per rank",
                             self.bytes / 1e6, held * self.bytes / 1e6)
            self.failed_in_a_row = 0
        except Exception as e:  # noqa: BLE001 - a lost snapshot must not stop the training
            self.failed_in_a_row += 1
            if self.failed_in_a_row == 1:
                self.on_failure(f"{type(e).__name__}: {e}")
        self.waited_s += time.perf_counter() - start

    # ------------------------------------------------------------------ reading
    def scan(self) -> dict[tuple[int, int], tuple[Path, dict]]:
        """The parts on this node that this rank looks after (those of ranks with its local rank: its own
        and the peer copies it received), complete, of this run, config and world size, that verify:
        {(rank, step): (bin, header)}. A part that does not is skipped and said."""
        found: dict[tuple[int, int], tuple[Path, dict]] = {}
        self.skipped = []
        mine = {p for p in range(self.world) if p % self.local_world == self.rank % self.local_world}
        for head in sorted(self.dir.glob("*slot-*.rank-*.json")):
            part = int(head.name.removesuffix(".json").rsplit("-", 1)[1])
            if part not in mine:
                continue
            binary = head.parent / f"{head.name.removesuffix('.json')}.bin"
            problem, header = self._check(binary, head, part)
            if problem:
                log.warning("memory snapshot %s not used: %s", head, problem)
                self.skipped.append(problem)
                continue
            key = (part, header["step"])
            if key not in found or not head.name.startswith("peer-"):  # its own copy first
                found[key] = (binary, header)
        return found

    def _check(self, binary: Path, head: Path, part: int) -> tuple[str, dict]:
        try:
            header = json.loads(head.read_text())
        except (OSError, ValueError) as e:
            return f"unreadable header ({e})", {}
        for key, want in (("version", VERSION), ("run_id", self.run), ("world", self.world), ("rank", part)):
            if header.get(key) != want:
                return f"{key} {header.get(key)!r}, this run's is {want!r}", {}
        if header.get("config_sha256") != self.config_sha256:
            return "written with another config", {}
        try:
            size = binary.stat().st_size
            if size != header["bytes"]:
                return f"{binary.name} is {size} bytes, its header says {header['bytes']}", {}
            digest = storage.new_digest()
            with open(binary, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
        except OSError as e:
            return f"unreadable ({e})", {}
        if digest.hexdigest() != header["checksum"]:
            return f"{binary.name} fails its checksum", {}
        return "", header

    def plan(self, found: dict[tuple[int, int], Any]) -> tuple[int | None, dict[int, int]]:
        """Collective: the newest step of which every rank's part is held by some rank, and who gives
        each rank its part ({rank: holder}; the rank itself where it holds it)."""
        everyone: list[Any] = [sorted(found)]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, sorted(found))
        holders: dict[tuple[int, int], list[int]] = {}
        for holder, keys in enumerate(everyone):
            for part, step in keys:
                holders.setdefault((part, step), []).append(holder)
        steps = {step for _, step in holders}
        usable = [s for s in steps if all((p, s) in holders for p in range(self.world))]
        if not usable:
            return None, {}
        step = max(usable)
        return step, {p: p if p in holders[(p, step)] else min(holders[(p, step)]) for p in range(self.world)}

    def fetch(self, step: int, givers: dict[int, int], found: dict[tuple[int, int], tuple[Path, dict]]
              ) -> tuple[Path, dict]:
        """Collective: every part whose rank does not hold it is sent by its holder and kept as that rank's
        own slot. Returns this rank's part of `step` (bin, header)."""
        for part, giver in sorted(givers.items()):
            if giver == part:
                continue
            if self.rank == giver:
                _send_recv(_read_part(found[(part, step)][0], _head_of(found[(part, step)][0])), part, None, None)
            elif self.rank == part:
                header, data = _send_recv((b"", b""), None, giver, None)
                binary, head = self._paths(self._slot(step))
                head.unlink(missing_ok=True)
                binary.write_bytes(data)
                _write_header(head, json.loads(header))
                found[(part, step)] = (binary, json.loads(header))
        return found[(self.rank, step)]

    @torch.no_grad()
    def load(self, binary: Path, header: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Restore this rank's part of a verified snapshot in place: tensors, hyper-parameters, RNG;
        returns its train state. The optimizer's state is made first if it has none yet."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not optimizer.state:
            get_state_dict(model, optimizer)  # makes the optimizer's state (a step with lr 0), as DCP's load does
        tensors = local_tensors(model, optimizer)
        table = header["tensors"]
        if [row[0] for row in table] != [name for name, _ in tensors]:
            raise ValueError("the snapshot's tensors are not this model's and optimizer's")
        with open(binary, "rb") as f:
            for (name, dtype, shape, at, nbytes), (_, t) in zip(table, tensors, strict=True):
                if list(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                    raise ValueError(f"{name}: snapshot {shape} {dtype}, here {list(t.shape)} {t.dtype}")
                f.seek(at)
                data = f.read(nbytes)
                src = torch.frombuffer(bytearray(data), dtype=t.dtype).view(t.shape) if nbytes else t
                t.copy_(src)
        for group, saved in zip(optimizer.param_groups, header["param_groups"], strict=True):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(header["rng"])), dtype=torch.uint8))
        self.restored_extra = {"records": header.get("records", [])}
        return TrainState(**header["state"])

    # ------------------------------------------------------------------ the end
    def close(self, remove: bool = False) -> None:
        """Stop the writer (waiting for a snapshot in flight); with `remove`, delete this rank's slots
        (the run is over), and the run's directory once it is empty."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
        if remove:
            for slot in range(SLOTS):
                for path in (*self._paths(slot), *self._paths(slot, self.source, peer=True)):
                    path.unlink(missing_ok=True)
            try:
                if not any(p.name != OWNER for p in self.dir.iterdir()):  # the last rank out
                    (self.dir / OWNER).unlink(missing_ok=True)
                self.dir.rmdir()
            except OSError:
                pass  # another rank's slots are still there: that rank removes the directory

    def describe(self, how_often: str = "") -> str:
        """Where and how much, for the start-up line; `how_often` replaces "every N step(s)"."""
        free = shutil.disk_usage(self.dir).free
        copies = f" + {SLOTS} peer copies (on the next node)" if self.replicas else ""
        return (f"{how_often or f'every {self.every} step(s)'} to {self.dir}: {SLOTS} slots per rank{copies}, "
                f"each the size of the rank's shard of the model and optimizer; {free / 1e9:,.1f} GB free there")


def _head_of(binary: Path) -> Path:
    return binary.parent / f"{binary.name.removesuffix('.bin')}.json"


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write the buffers one after another from offset 0, in as few system calls as the kernel allows."""
    at, views = 0, [v.cast("B") for v in views if v.nbytes]
    while views:
        batch = views[:IOV_MAX]
        done = os.pwritev(fd, batch, at)
        at += done
        while views and done >= views[0].nbytes:  # drop what was written whole; cut the one written in part
            done -= views[0].nbytes
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def _write_header(head: Path, header: dict) -> None:
    """The header last, whole (temp file, rename): the part exists once it is there."""
    tmp = head.parent / f"{head.name}.tmp"
    tmp.write_text(json.dumps(header))
    os.replace(tmp, head)


def _read_part(binary: Path, head: Path) -> tuple[bytes, bytes]:
    return head.read_bytes(), binary.read_bytes()


def _send_recv(payload: tuple[bytes, bytes], to: int | None, source: int | None, group: Any) -> tuple[bytes, bytes]:
    """Send `payload` (header, data) to rank `to` and receive one from rank `source` (either may be
    None), on `group` (None: the default group). Empty header: nothing this time."""
    header, data = payload
    works, sizes = [], torch.zeros(2, dtype=torch.int64)
    if to is not None:
        out = torch.tensor([len(header), len(data)], dtype=torch.int64)
        works.append(dist.isend(out, to, group=group))
    if source is not None:
        works.append(dist.irecv(sizes, source, group=group))
    for w in works:
        w.wait()
    works = []
    if to is not None and header:
        blob = torch.frombuffer(bytearray(header + data), dtype=torch.uint8)
        works.append(dist.isend(blob, to, group=group))
    received = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    if source is not None and int(sizes[0]):
        works.append(dist.irecv(received, source, group=group))
    for w in works:
        w.wait()
    if source is None or not int(sizes[0]):
        return b"", b""
    raw = received.numpy().tobytes()
    return raw[:int(sizes[0])], raw[int(sizes[0]):]
