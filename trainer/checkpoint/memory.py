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
mixed: every rank loads the same step. A world of another size (a lost node under `--nnodes MIN:MAX`,
another `--nproc-per-node`) loads the newest step of which the ranks' nodes hold every part between them
(a part a node lacks is sent by a rank whose node holds it), each rank reading its rows of each tensor
(memory-reshard; trainer.checkpoint.memory_reshard). Another run (a new
run id, kept in run.dir) or another config never loads them. The run's directory (with `owner.json`, its
run.dir) is made at the first part written and removed when the run ends; a launcher's start removes
those of other runs whose run.dir is gone or that are older than checkpoint.memory_max_age_h
(trainer.runtime.memory_sweep).

This module is the tier (MemoryTier) and the run's identity; the files on a node are memory_slots,
what a part holds of the state and its restore memory_state, what crosses ranks memory_peers, the restore
in another world memory_reshard.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import storage
from trainer.checkpoint import memory_auto, memory_peers, memory_reshard, memory_slots
from trainer.checkpoint.background import BackgroundWriter
from trainer.checkpoint.commit import TrainState
from trainer.checkpoint.memory_slots import SLOTS, VERSION, Found
from trainer.checkpoint.memory_state import Layout, PartLayout, hyper_parameters, restore
from trainer.config import CheckpointConfig
from trainer.distributed.parallel import DistInfo
from trainer.observability import logs
from trainer.runtime.memory_sweep import MEMORY_DIR_ENV, OWNER, RUN_ID_FILE, default_dir, owner_record

log = logs.get_logger("memory")

# The names of where snapshots live (the base, `owner.json`, run.dir's record) are trainer.runtime.memory_sweep's.
__all__ = ["MEMORY_DIR_ENV", "OWNER", "RUN_ID_FILE", "SLOTS", "MemoryTier", "TierSetup", "config_identity",
           "default_dir", "run_record"]


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
            storage.atomic_write(path, json.dumps(record).encode(), durable=True)
    if world > 1:
        box = [record]
        dist.broadcast_object_list(box, src=0)
        record = box[0]
    return record


def config_identity(config: dict) -> str:
    """The config hash snapshots are tagged with: the run's config less the settings that do not touch
    the state (where each node keeps its memory and how long; how the launcher restarts ranks)."""
    import hashlib

    kept = ("memory_dir", "memory_max_age_h")
    rest = {**config, "checkpoint": {k: v for k, v in config.get("checkpoint", {}).items() if k not in kept},
            "fault": {k: v for k, v in config.get("fault", {}).items() if k not in ("warm_restarts", "in_process",
                                                                                     "node_silence_s")}}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()



@dataclass(frozen=True)
class TierSetup:
    """What a rank's memory tier is built for, beside the checkpoint settings: the run's id (`run_record`) and
    config hash (`config_identity`), which tag its snapshots; the run's directory, which owns the run's memory
    directory; the ranks per node (None: all on one node); what a failed snapshot calls with its error."""

    run_id: str
    config_sha256: str
    run_dir: str
    local_world: int | None = None
    on_failure: Callable[[str], None] | None = None  # once per run of failures in a row


@dataclass(frozen=True)
class TierRanks:
    """This rank among the tier's: nodes hold contiguous blocks of `local_world` ranks; with `replicas` (0
    or 1) each part also goes to the buddy, the rank with the same local rank on the next node, and this
    rank keeps the part of its source, the rank with its local rank on the previous node."""

    rank: int
    world: int
    local_world: int
    replicas: int

    @property
    def buddy(self) -> int:
        return (self.rank + self.local_world) % self.world

    @property
    def source(self) -> int:
        return (self.rank - self.local_world) % self.world


@dataclass
class WriteStats:
    """How this rank's snapshot writes went; memory_auto times the snapshots by the last three."""

    bytes: int = 0  # the size of the last part written
    failed_in_a_row: int = 0
    sized: bool = False  # the sizes were said (at the first write that succeeded, and after failures)
    waited_s: float = 0.0  # the training thread's total wait for a write in flight
    call_s: float = 0.0  # the last snapshot() on the training thread, less its wait for the previous one
    write_s: float = 0.0  # the last background write (and exchange) that finished


@dataclass
class Restoring:
    """What restoring found beside the parts it loads."""

    skipped: list[str] = field(default_factory=list)  # why the last scan passed over parts on this node
    elsewhere: memory_slots.Elsewhere = field(default_factory=dict)  # the last scan's parts of another world size
    extra: dict = field(default_factory=dict)  # what the loaded snapshot carried besides the state: {"records"}


class MemoryTier:
    """One rank's snapshots (write in the background, scan, agree, load); see the module docstring. Fixed
    when built: its `setup`, its `ranks` and its directory; then changing: the interval (`every`, settled
    when `auto` stops `measuring`), how the writes went (`writes`) and what restoring found (`restoring`)."""

    def __init__(self, settings: CheckpointConfig, info: DistInfo, setup: TierSetup, every: int | None) -> None:
        """`settings`: checkpoint.memory_dir (empty: `default_dir()`) and checkpoint.memory_replicas; `every`:
        the interval in use (memory_every, or what `auto` chose), None while `auto` still times the first
        steps (`measuring`; a snapshot every step meanwhile)."""
        local_world = setup.local_world or info.world
        nodes = info.world // local_world if info.world % local_world == 0 else 1
        replicas = min(settings.memory_replicas, 1) if nodes > 1 else 0
        self.setup, self.ranks = setup, TierRanks(rank=info.rank, world=info.world, local_world=local_world,
                                                  replicas=replicas)
        self.every, self.measuring = every or 1, every is None
        self.dir = Path(settings.memory_dir or default_dir()) / setup.run_id
        # The peer copies travel on a group of their own (the training thread's collectives are on the
        # default one). Made by every rank, in the same order, when the tier is built.
        self._group = dist.new_group(backend="gloo") if replicas else None
        self._made = False  # the directory and its owner record are made at the first write into it
        if info.rank % local_world == 0:  # one rank per node sweeps (and rank 0 says so)
            self._sweep(owner_record(setup.run_dir))
        self._writer = BackgroundWriter("memory")
        self._parts = PartLayout()
        self.writes = WriteStats()
        self.restoring = Restoring()

    def rebind_groups(self, mapping: dict) -> None:
        """In-process recovery: the peer copies' group, re-formed (trainer.recovery.regroup)."""
        if self._group is not None:
            self._group = mapping[self._group]

    def _make_dir(self) -> None:
        """The run's directory on this node and its owner record (trainer.runtime.memory_sweep), at the first
        part written or received: a run refused at start (bad config or input, exit 2) leaves nothing here."""
        if self._made and self.dir.is_dir():  # (removed under the run: made again)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / OWNER).exists():
            storage.atomic_write(self.dir / OWNER, json.dumps(owner_record(self.setup.run_dir)).encode())
        self._made = True

    def _sweep(self, owner: dict) -> None:
        """Remove the snapshots that earlier runs of this run.dir left on this node (a run.dir made afresh
        gets a new run id; one job per run.dir holds its lease, so they are no one's). A launcher sweeps
        those of other runs at its start (trainer.runtime.memory_sweep)."""
        try:
            others = list(self.dir.parent.iterdir())
        except OSError:
            return  # no snapshots on this node yet
        for other in others:
            try:
                stale = other != self.dir and json.loads((other / OWNER).read_text()) == owner
            except (OSError, ValueError):
                continue
            if stale:
                shutil.rmtree(other, ignore_errors=True)
                if self.ranks.rank == 0:
                    log.info("removed the memory snapshots of an earlier run of this run.dir (%s)", other)

    def _slot(self, step: int) -> int:
        return memory_slots.slot_of(step, self.every)

    def _paths(self, slot: int, rank: int | None = None, peer: bool = False) -> tuple[Path, Path]:
        return memory_slots.part_paths(self.dir, slot, self.ranks.rank if rank is None else rank, peer)

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
        self._writer.hold_steps(optimizer, self.wait)
        layout = self._parts.of(model, optimizer)
        # The train state without the config and model arguments (the same as the run's: config_sha256)
        # and without copies: none of its values is changed in place while the writer runs.
        kept = {f.name: getattr(state, f.name) for f in fields(state) if f.name not in ("config", "model", "rng")}
        header = {
            "version": VERSION, "run_id": self.setup.run_id, "config_sha256": self.setup.config_sha256,
            "rank": self.ranks.rank, "world": self.ranks.world, "step": state.step,
            "state": kept, "rng": base64.b64encode(torch.get_rng_state().numpy()).decode(),
            "param_groups": hyper_parameters(optimizer), "records": list(records),
        }
        self._writer.submit(self._write, header, layout)
        self.writes.call_s = time.perf_counter() - start

    @torch.no_grad()
    def _write(self, header: dict, layout: Layout) -> None:
        """This rank's part into its slot, then (with replicas) the exchange with the buddies. The
        exchange happens whatever became of the write, so that no peer waits for a part that never comes."""
        error: Exception | None = None
        start = time.perf_counter()
        try:
            self._make_dir()
            self._write_part(header, layout)
        except Exception as e:  # noqa: BLE001 - raised after the exchange
            error = e
        if self._group is not None:
            slot, ranks = self._slot(header["step"]), self.ranks
            memory_peers.exchange(self._paths(slot) if error is None else None,
                                  self._paths(slot, ranks.source, peer=True), ranks.buddy, ranks.source, self._group)
        self.writes.write_s = time.perf_counter() - start
        if error is not None:
            raise error

    def _write_part(self, header: dict, layout: Layout) -> None:
        """The tensors' bytes, then the header with their checksum (memory_slots)."""
        table, _, size = layout
        binary, head = self._paths(self._slot(header["step"]))
        checksum = memory_slots.write_data(binary, head, self._parts.views(layout), size)
        header.update(bytes=size, checksum=checksum, tensors=table, records=[r.to_json() for r in header["records"]])
        memory_slots.write_header(head, header, self._parts.table_json(table))
        self.writes.bytes = size

    def wait(self) -> None:
        """Block until the snapshot in flight is written. A failed one (memory full, ...) is a warning:
        training goes on with the durable tier and the older snapshots."""
        if not self._writer.pending:
            return
        start = time.perf_counter()
        error, writes = self._writer.wait(), self.writes
        if error is None:
            if writes.failed_in_a_row or not writes.sized:
                writes.sized = True
                if self.ranks.rank == 0:
                    held = SLOTS * (2 if self.ranks.replicas else 1)
                    log.info("memory tier: %.1f MB per snapshot on rank 0, at most %.1f MB held per rank",
                             writes.bytes / 1e6, held * writes.bytes / 1e6)
            writes.failed_in_a_row = 0
        else:  # a lost snapshot must not stop the training
            writes.failed_in_a_row += 1
            if writes.failed_in_a_row == 1 and self.setup.on_failure is not None:
                self.setup.on_failure(f"{type(error).__name__}: {error}")
        writes.waited_s += time.perf_counter() - start

    # ------------------------------------------------------------------ reading
    def scan(self) -> Found:
        """The parts on this node that this rank looks after (those of ranks with its local rank: its own
        and the peer copies it received), complete, of this run, config and world size, that verify:
        {(rank, step): (bin, header)}. A part that does not is skipped and said."""
        ranks = self.ranks
        mine = {p for p in range(ranks.world) if p % ranks.local_world == ranks.rank % ranks.local_world}
        identity = {"run_id": self.setup.run_id, "world": ranks.world, "config_sha256": self.setup.config_sha256}
        found, self.restoring.skipped, self.restoring.elsewhere = memory_slots.scan(self.dir, mine, identity)
        return found

    def plan(self, found: dict[tuple[int, int], Any]) -> tuple[int | None, dict[int, int]]:
        """Collective: the newest step of which every rank's part is held by some rank, and who gives
        each rank its part ({rank: holder}; the rank itself where it holds it)."""
        return memory_peers.plan(found, self.ranks.world)

    def fetch(self, step: int, givers: dict[int, int], found: Found) -> tuple[Path, dict]:
        """Collective: every part whose rank does not hold it is sent by its holder and kept as that rank's
        own slot. Returns this rank's part of `step` (bin, header)."""
        self._make_dir()
        return memory_peers.fetch(self.ranks.rank, step, givers, found, self._paths(self._slot(step)))

    def plan_reshard(self) -> tuple[int, int] | None:
        """Collective, after a `scan` and a `plan` that found nothing of this world: (world, step) of the
        newest snapshot of another world size of which the ranks' nodes hold every part between them (a lost
        node's parts as peer copies), or None."""
        return memory_peers.reshard_plan(self.restoring.elsewhere, self.ranks.world)

    def load_resharded(self, world: int, step: int, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> TrainState:
        """Collective: restore this rank's rows of the `world`-rank snapshot of `step` from its parts, those this
        node lacks sent by a rank whose node holds them (trainer.checkpoint.memory_reshard); returns its train
        state (of the old world)."""
        rank, into = self.ranks.rank, self.dir / f"reshard-{world}-{step}-rank{self.ranks.rank}"
        parts = self.restoring.elsewhere.get((world, step), {})
        parts = memory_peers.share_parts(rank, self.ranks.world, world, parts, into)
        try:
            state = memory_reshard.restore(parts, model, optimizer, rank, self.ranks.world)
        finally:
            shutil.rmtree(into, ignore_errors=True)
        self.restoring.extra = {"records": parts[rank % world][1].get("records", [])}
        return state

    def load(self, binary: Path, header: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Restore this rank's part of a verified snapshot in place: tensors, hyper-parameters, RNG;
        returns its train state. The optimizer's state is made first if it has none yet."""
        state = restore(binary, header, model, optimizer)
        self.restoring.extra = {"records": header.get("records", [])}
        return state

    # ------------------------------------------------------------------ the end
    def close(self, remove: bool = False) -> None:
        """Stop the writer (waiting for a snapshot in flight); with `remove`, delete this rank's slots
        (the run is over), and the run's directory once it is empty."""
        try:
            self.wait()
        finally:
            self._writer.close()
        if remove:
            for slot in range(SLOTS):
                for path in (*self._paths(slot), *self._paths(slot, self.ranks.source, peer=True)):
                    path.unlink(missing_ok=True)
                    for torn in storage.leftover_temps(str(path)):  # a header write a kill cut short
                        Path(torn).unlink(missing_ok=True)
            for parts in self.restoring.elsewhere.values():  # an earlier world's parts (this world resumed from them)
                for binary, _ in parts.values():
                    binary.unlink(missing_ok=True)
                    memory_slots.head_of(binary).unlink(missing_ok=True)
            try:
                if not any(p.name != OWNER for p in self.dir.iterdir()):  # the last rank out
                    (self.dir / OWNER).unlink(missing_ok=True)
                self.dir.rmdir()
            except OSError:
                pass  # another rank's slots are still there: that rank removes the directory

    def describe(self, how_often: str = "") -> str:
        """Where and how much, for the start-up line; `how_often` replaces "every N step(s)"."""
        free = memory_auto.free_bytes(self.dir)
        copies = f" + {SLOTS} peer copies (on the next node)" if self.ranks.replicas else ""
        return (f"{how_often or f'every {self.every} step(s)'} to {self.dir}: {SLOTS} slots per rank{copies}, "
                f"each the size of the rank's shard of the model and optimizer; {free / 1e9:,.1f} GB free there")
