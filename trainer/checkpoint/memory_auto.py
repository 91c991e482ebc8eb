"""`checkpoint.memory_every=auto`: how often the memory tier snapshots, chosen for the run.

Before training, `choose` turns the tier off, with one line saying why, when `memory_dir` is not in memory
(a disk would take a write of every rank's shard every step) or lacks room (the snapshots a node holds must
fit in a quarter of its free space: /dev/shm is the same memory the training uses). Otherwise the tier
snapshots every step while `Measure` times the first steps of the run and the snapshots' writes; it then
settles on the smallest interval at which a snapshot costs at most COST_SHARE of the steps it covers. On a
CPU the background write competes with training for the cores, so its whole time counts; on a GPU only the
training thread's part (starting the snapshot, waiting for the previous one). The ranks agree on the
largest interval any of them needs. The choice is kept in run.dir (memory-tier.json, beside the run id)
for this config: a restarted run uses it at once, and every attempt snapshots the same steps.
An explicit `memory_every` (a number, or 0 = off) is used as it is.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from common import storage

COST_SHARE = 0.01  # a snapshot may cost this share of the steps it covers
ROOM_SHARE = 0.25  # the snapshots of a node's ranks may take this share of memory_dir's free space
MEASURED_STEPS = 8  # steps timed before the interval is chosen
WARM_UP_STEPS = 3  # of them left out: the first step, and the first write into each of the 3 slots (new pages)
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")
CHOICE_KEY = "auto_every"  # in run.dir/memory-tier.json: {"run_id", "auto_every": {"config", "every"}}


def filesystem_type(path: str | Path) -> str:
    """The type of the file system `path` is on ("tmpfs", "ext4", ...), from /proc/self/mounts; "" if unknown."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def free_bytes(directory: str | Path) -> int:
    """The free space of the file system `directory` is on, or would be made on (it is made at the first
    snapshot): that of its nearest existing ancestor."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def snapshot_bytes(model: torch.nn.Module) -> int:
    """What one rank's snapshot will hold, before the optimizer has state: its parameters' local shards
    and AdamW's two moments of each (the step counters are a few bytes)."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return 3 * sum(t.numel() * t.element_size() for t in local)


def choose(setting: int | str, directory: str, shard_bytes: int, copies: int, local_world: int,
           kept: int | None) -> tuple[int | None, str]:
    """This rank's interval before training: (n, "") for an explicit n or a choice kept from an earlier
    attempt; (0, why) when auto turns the tier off; (None, "") when auto measures first. `copies`: slots
    held per rank (own and peer); `kept`: the interval an earlier attempt of this run settled on."""
    if setting != "auto":
        return int(setting), ""
    kind = filesystem_type(Path(directory).parent if not Path(directory).exists() else directory)
    if kind and kind not in MEMORY_FILESYSTEMS:
        return 0, (f"checkpoint.memory_dir {directory} is on a disk ({kind}), not in memory: a snapshot of every "
                   f"rank each step would cost disk writes; set checkpoint.memory_every=N to use it anyway")
    need = copies * local_world * shard_bytes
    free = free_bytes(directory)
    if need > ROOM_SHARE * free:
        return 0, (f"not enough room in {directory}: the snapshots of this node's {local_world} rank(s) take "
                   f"{need / 1e9:,.2f} GB, more than {ROOM_SHARE:.0%} of the {free / 1e9:,.2f} GB free there")
    if kept:
        return kept, ""
    return None, ""


def agree(every: int | None, why: str, world: int) -> tuple[int | None, str]:
    """Collective: every rank the same decision; off on every rank when auto turned it off on any."""
    if world == 1:
        return every, why
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (every, why))
    off = [(rank, w) for rank, (e, w) in enumerate(everyone) if e == 0]
    if off:
        rank, why = off[0]
        return 0, why if rank == dist.get_rank() else f"on rank {rank}: {why}"
    return everyone[0]


@dataclass
class Measure:
    """The first steps' times and the snapshots' costs, then the interval (`settle`, collective)."""

    on_cpu: bool
    steps_s: list[float] = field(default_factory=list)
    costs_s: list[float] = field(default_factory=list)
    waited_s: float = 0.0  # the tier's total wait for its writes at the last `note`

    def due(self) -> bool:
        return len(self.steps_s) >= MEASURED_STEPS

    def note(self, step_s: float, call_s: float, waited_total_s: float, write_s: float) -> None:
        """One step: its time, and what a snapshot costs: starting it, waiting for the previous one (the
        tier's total wait so far, `MemoryTier.writes.waited_s`), and the last background write, which counts on
        a CPU."""
        waited, self.waited_s = waited_total_s - self.waited_s, waited_total_s
        self.steps_s.append(step_s)
        self.costs_s.append(call_s + waited + (write_s if self.on_cpu else 0.0))

    def settle(self, world: int) -> tuple[int, float, float]:
        """(interval, cost of a snapshot, step time): the smallest interval at which a snapshot costs at
        most COST_SHARE of the steps it covers, the largest any rank needs."""
        step_s = statistics.median(self.steps_s[WARM_UP_STEPS:])
        cost_s = statistics.median(self.costs_s[WARM_UP_STEPS:])
        every = max(1, math.ceil(cost_s / (COST_SHARE * step_s)))
        if world > 1:
            box = torch.tensor([every], dtype=torch.int64)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            every = int(box.item())
        return every, cost_s, step_s


def kept_choice(record: dict, config: str) -> int | None:
    """The interval an earlier attempt settled on for this config ({"config", "every"} under CHOICE_KEY)."""
    choice = record.get(CHOICE_KEY) or {}
    return choice.get("every") if choice.get("config") == config else None


def keep_choice(run_dir: str, config: str, every: int) -> None:
    """Rank 0: the choice, in run.dir/memory-tier.json beside the run id."""
    from trainer.checkpoint.memory import RUN_ID_FILE

    path = Path(run_dir) / RUN_ID_FILE
    record = json.loads(path.read_text())
    record[CHOICE_KEY] = {"config": config, "every": every}
    storage.atomic_write(str(path), json.dumps(record).encode(), durable=True)
