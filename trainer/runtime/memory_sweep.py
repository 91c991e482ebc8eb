"""Where the memory tier's snapshots live on a node, and the sweep of those no run will use again.

The tier (trainer.checkpoint.memory) keeps each run's snapshots in `<base>/<run id>/`: the base is
checkpoint.memory_dir, else `default_dir()`; the run id is 16 hex digits (run.dir/memory-tier.json); the
directory holds `owner.json` (`{"run_dir": ...}`, the run.dir's absolute path or its URL, `owner_record`)
and the parts' files (`slot-<k>.rank-<r>.bin/.json`, `peer-slot-...`, and the temp files of a header
write cut short). The tier makes it at the run's first snapshot and removes it when the run ends; a run
that fails leaves it for the next start of its run.dir.

`sweep` (at a launcher's start, before its ranks) removes, under each base, the snapshot directories of
other runs not written for `MEMORY_IDLE_S` (a running job writes its own: its run.dir may be out of this
process's view, in another container sharing /dev/shm) whose run.dir no longer exists (a local path; a URL
is not judged by existence) or whose newest file is older than checkpoint.memory_max_age_h (0: never by
age). A directory without `owner.json` (an
older layout) is removed by age only. It never removes the current run's snapshots (those whose owner is
this run.dir, or named by its run id) and never anything it does not recognise: a directory (not a
symlink) named as a run id that holds only the tier's plain files. It follows no symlink, and an entry it
cannot read is kept. Torch-free."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from common import storage
from common.timing import MEMORY_IDLE_S

MEMORY_DIR_ENV = "REKINDLE_MEMORY_DIR"  # the default checkpoint.memory_dir, where set
OWNER = "owner.json"  # in a run's memory directory: {"run_dir": ...}
RUN_ID_FILE = "memory-tier.json"  # in run.dir: {"run_id": ..., "auto_every": ...}, made by the run's first start
RUN_ID = re.compile(r"[0-9a-f]{16}")  # uuid4().hex[:16] (trainer.checkpoint.memory.run_record)
# The files of a run's memory directory (trainer.checkpoint.memory_slots.part_paths), and the temp files
# of an atomic write of a header or the owner record cut short (common.storage.temp_name).
TIER_FILE = re.compile(rf"({re.escape(OWNER)}|(peer-)?slot-\d+\.rank-\d+\.(bin|json))(\.tmp-.+)?")

__all__ = ["MEMORY_DIR_ENV", "OWNER", "RUN_ID_FILE", "Removed", "bases", "default_dir", "owner_record", "sweep"]


def default_dir() -> str:
    """$REKINDLE_MEMORY_DIR; else /dev/shm/rekindle-memory when there is a /dev/shm (memory, survives the
    process); else $TMPDIR."""
    if os.environ.get(MEMORY_DIR_ENV):
        return os.environ[MEMORY_DIR_ENV]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return str(base / "rekindle-memory")


def bases(memory_dir: str) -> list[str]:
    """The bases a launcher sweeps: the default one and checkpoint.memory_dir (`memory_dir`), once each."""
    found: dict[str, str] = {}
    for base in (default_dir(), memory_dir):
        if base:
            found.setdefault(os.path.realpath(base), base)
    return list(found.values())


def owner_record(run_dir: str) -> dict:
    """What a run's memory directory records of its run.dir: the absolute path of a local one, a URL as it is."""
    if not storage.is_local(run_dir):
        return {"run_dir": run_dir}
    return {"run_dir": str(Path(storage.local_path(run_dir)).resolve())}


@dataclass(frozen=True)
class Removed:
    """One snapshot directory the sweep removed: where, why, and the bytes its files held."""

    path: str
    why: str
    bytes: int

    def line(self) -> str:
        return f"removed the memory snapshots in {self.path} ({self.bytes / 1e6:,.1f} MB): {self.why}"


@dataclass(frozen=True)
class Seen:
    """What the sweep read of one directory: its owner's run.dir ('' unknown), its newest time, its size."""

    run_dir: str
    newest: float
    bytes: int


def _read(path: str) -> Seen | None:
    """The directory at `path` if it is a run's memory directory (see the module docstring), else None."""
    if not RUN_ID.fullmatch(os.path.basename(path)):
        return None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):  # a symlink or a file
        return None
    newest, size, owner = info.st_mtime, 0, ""
    with os.scandir(path) as entries:
        for entry in entries:
            held = entry.stat(follow_symlinks=False)
            if not (TIER_FILE.fullmatch(entry.name) and stat.S_ISREG(held.st_mode)):
                return None  # something the tier does not write: not ours to remove
            newest, size = max(newest, held.st_mtime), size + held.st_size
            if entry.name == OWNER:
                try:
                    owner = json.loads(Path(entry.path).read_text())["run_dir"]
                except (ValueError, KeyError, TypeError):
                    return None
                if not isinstance(owner, str):
                    return None
    return Seen(run_dir=owner, newest=newest, bytes=size)


def _gone(run_dir: str) -> bool:
    """Whether a local run.dir no longer exists (a URL, or one that cannot be asked: not gone)."""
    if not run_dir or not storage.is_local(run_dir):
        return False
    try:
        os.stat(storage.local_path(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def _why(found: Seen, max_age_s: float, now: float) -> str:
    """Why a directory of another run goes ('' when it stays)."""
    owner = f"run.dir {found.run_dir}" if found.run_dir else f"no {OWNER} (an older layout)"
    if now - found.newest < MEMORY_IDLE_S:  # written lately: a running job's (its run.dir may be out of view)
        return ""
    if _gone(found.run_dir):
        return f"their run.dir {found.run_dir} no longer exists"
    age = now - found.newest
    if max_age_s > 0 and age > max_age_s:
        return (f"not written for {age / 3600:,.1f} h, more than checkpoint.memory_max_age_h="
                f"{max_age_s / 3600:g} ({owner})")
    return ""


def _current_run_id(run_dir: str) -> str:
    """The run id run.dir/memory-tier.json holds ('' when it has none)."""
    try:
        run_id = json.loads(Path(storage.local_path(run_dir), RUN_ID_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return ""
    return run_id if isinstance(run_id, str) else ""


def sweep(where: Iterable[str], run_dir: str, max_age_s: float, now: float | None = None,
          on_removed: Callable[[Removed], None] | None = None) -> list[Removed]:
    """Remove, in each base of `where`, the memory directories of runs other than `run_dir`'s that are gone
    or older than `max_age_s` (0: never by age; see the module docstring); `on_removed` is called with
    each as it goes. Returns what was removed. Errors of one entry skip that entry."""
    now = time.time() if now is None else now
    ours = owner_record(run_dir)["run_dir"]
    own_id = _current_run_id(run_dir) if storage.is_local(run_dir) else ""
    removed: list[Removed] = []
    for base in where:
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            try:
                found = _read(path)
                why = _why(found, max_age_s, now) if found and found.run_dir != ours and name != own_id else ""
                if why:
                    shutil.rmtree(path)
            except OSError:
                continue
            if why:
                removed.append(Removed(path=path, why=why, bytes=found.bytes))
                if on_removed is not None:
                    on_removed(removed[-1])
    return removed
