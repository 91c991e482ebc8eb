"""The trainer <-> launcher contract, imported by both sides: environment variable names, exit codes,
the heartbeat record each rank rewrites, and the `events.jsonl` ledger. Torch-free, so the launcher
and `--help` stay light.

Heartbeat file: one per rank in `$REKINDLE_HEARTBEAT_DIR/rank-<r>.json`, a fixed-size JSON record
rewritten in place (one `pwrite`, no rename) once per step and at each phase change:
`{pid, rank, attempt, phase, step, t, t_proc, t_load, t_loaded, t_first, resumed_step, busy_s, steps_run}`.
`t_*` are unix times: process start, checkpoint load start/end, first step done in this attempt.
On a preemption the record also says whether this rank itself got SIGTERM (`signalled`).

Ledger: `run.dir/events.jsonl`, one JSON object per line with an `event` field, appended by the
launcher (start, failure, restart, resume, preempt, done) and by rank 0 (commit).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

from common.exits import (  # noqa: F401 - the contract's exit codes (common.exits), read here by the trainer
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
)
from common.process import process_start_time
from common.timing import REFRESH_S

# --- environment variables set by the launcher for its ranks (and by tests for fault injection)
HEARTBEAT_DIR_ENV = "REKINDLE_HEARTBEAT_DIR"  # where each rank rewrites its heartbeat record
LAUNCHER_PID_ENV = "REKINDLE_LAUNCHER_PID"  # ranks die with this process (PR_SET_PDEATHSIG)
COORD_STORE_ENV = "REKINDLE_COORD_STORE"  # host:port of the launcher's store (in-process recovery: trainer.recovery)
GENERATION_ENV = "REKINDLE_GENERATION"  # a replacement rank joins this generation of the groups (absent: 0)
ROUND_ENV = "REKINDLE_ROUND"  # the worker group's rendezvous round: the same on every node (the restart count is not)
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchelastic's: the worker group's attempt number
FAIL_AT_ENV = "REKINDLE_FAIL_AT"  # "step[:rank]": raise at that step (every attempt): a deterministic crash
HANG_AT_ENV = "REKINDLE_HANG_AT"  # "step[:rank]": spin forever at that step (first attempt only)
CRASH_AT_ENV = "REKINDLE_CRASH_AT"  # "point@step[:rank]": a fault inside a checkpoint save (trainer.runtime.fault)
SLOW_RANK_ENV = "REKINDLE_SLOW_RANK"  # "rank:seconds[@first[-last]]": that rank sleeps in those steps (a straggler)

HEARTBEAT_BYTES = 1024
EVENTS_FILE = "events.jsonl"


def attempt() -> int:
    """The worker group's attempt number on this node (0 without torchelastic)."""
    return int(os.environ.get(RESTART_COUNT_ENV, 0))


def generation() -> int:
    """The generation of the groups this process was started into: 0, or a later one for a rank that
    replaces a failed one in process (`GENERATION_ENV`)."""
    return int(os.environ.get(GENERATION_ENV, 0))


def first_start() -> bool:
    """Whether this process is one of the launch's first ranks: not restarted (attempt 0), and not a
    replacement forked into a later generation of the groups (in-process recovery), whose every
    start-up cost is on the other ranks' wait."""
    return attempt() == 0 and generation() == 0


def worker_group() -> str:
    """The worker group's name on the ranks' coordination store, the same on every node: its rendezvous
    round (the launcher's `ROUND_ENV`). A node's restart count is not: a membership change does not count
    one, and nodes that restarted for different reasons differ."""
    return os.environ.get(ROUND_ENV) or f"a{attempt()}"


def injection_target(spec: str) -> tuple[int, int | None] | None:
    """`step[:rank]` -> (step, rank or None for every rank); '' -> None."""
    if not spec:
        return None
    step, _, rank = spec.partition(":")
    return int(step), (int(rank) if rank else None)


def slow_rank(spec: str) -> tuple[int, float, int, int | None] | None:
    """`rank:seconds[@first[-last]]` -> (rank, seconds, first step, last step or None); '' -> None."""
    if not spec:
        return None
    target, _, steps = spec.partition("@")
    rank, _, seconds = target.partition(":")
    first, _, last = steps.partition("-")
    return int(rank), float(seconds), int(first) if first else 1, int(last) if last else None


def injected(spec: str, step: int, rank: int) -> bool:
    """Whether the fault-injection spec `step[:rank]` names this step on this rank."""
    target = injection_target(spec)
    return target is not None and target[0] == step and target[1] in (None, rank)


class Heartbeat:
    """This rank's progress record for the launcher's watchdog. Without $REKINDLE_HEARTBEAT_DIR it does nothing."""

    def __init__(self, rank: int) -> None:
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        self._fd: int | None = None
        self._written = 0.0  # the record's `t` when it was last written
        self._size = HEARTBEAT_BYTES  # the file's length (records are padded to it with spaces)
        self.record: dict[str, Any] = {
            "pid": os.getpid(), "rank": rank, "attempt": attempt(), "group": worker_group(),
            "generation": generation(),  # of the groups (in-process recovery)
            "phase": "init", "step": 0, "t": time.time(), "t_proc": process_start_time(), "t_load": 0.0,
            "t_loaded": 0.0, "t_first": 0.0, "resumed_step": 0, "busy_s": 0.0, "steps_run": 0,
        }
        self._dir = Path(directory) if directory else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._dir / f"rank-{rank}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write()

    def renumber(self, rank: int) -> None:
        """This rank goes on as `rank` (a smaller world): its record moves to that rank's file, written whole
        under a name of its own first and renamed into place, so that another survivor's file under either
        name (its own, being renumbered too) is never written to. The old name goes if it is still ours."""
        old, self.record["rank"] = self.record["rank"], rank
        if self._fd is None or old == rank:
            return
        staged = self._dir / f".rank-{rank}.{os.getpid()}.tmp"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        previous, self._fd, self._size = self._fd, fd, HEARTBEAT_BYTES
        self._write()
        os.rename(staged, self._dir / f"rank-{rank}.json")
        try:
            if os.stat(self._dir / f"rank-{old}.json").st_ino == os.fstat(previous).st_ino:
                os.unlink(self._dir / f"rank-{old}.json")
        except FileNotFoundError:
            pass
        os.close(previous)

    def beat(self, phase: str | None = None, step: int | None = None, **fields: Any) -> None:
        """Update the record and rewrite it; a beat that would change nothing but the time `t` (the same
        phase again, no step or field) is written only when the file is REFRESH_S old, so that the
        record of a step is one write."""
        if self._fd is None:
            return
        now = time.time()
        if not fields and step is None and phase in (None, self.record["phase"]) and now - self._written < REFRESH_S:
            return
        if phase:
            self.record["phase"] = phase
        if step is not None:
            if self.record["t_first"] == 0.0 and phase == "train":
                self.record["t_first"] = now
            self.record["step"] = step
        self.record.update(fields, t=now)
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.record).encode()
        self._size = max(self._size, len(data))  # never shorter: no tail of a longer record is left
        os.pwrite(self._fd, data.ljust(self._size), 0)
        self._written = self.record["t"]

    def close(self, phase: str = "done") -> None:
        if self._fd is not None:
            self.beat(phase)
            os.close(self._fd)
            self._fd = None


def read_heartbeats(directory: str | Path) -> dict[int, dict]:
    """Every readable heartbeat record in a directory, by rank (a torn or empty file is skipped)."""
    beats = {}
    for path in Path(directory).glob("rank-*.json"):
        try:
            record = json.loads(path.read_bytes().decode().strip() or "null")
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "rank" in record:
            beats[int(record["rank"])] = record
    return beats


def open_jsonl(path: str | Path) -> BinaryIO:
    """Open a JSON-lines file to append records to, one unbuffered O_APPEND write each. A torn last line
    (a writer killed mid-line) is ended first, so that it costs only itself and not the record after it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("ab+", buffering=0)
    if f.seek(0, os.SEEK_END) > 0:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
    return f


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one record to a JSON-lines file (`open_jsonl`)."""
    with open_jsonl(path) as f:
        f.write(json.dumps(record).encode() + b"\n")


def append_event(run_dir: str | Path, event: str, **fields: Any) -> dict:
    """Append one record to run_dir/events.jsonl."""
    record = {"event": event, "time": time.time(), **fields}
    append_jsonl(Path(run_dir) / EVENTS_FILE, record)
    return record


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file ([] without it); a torn line (a killed writer) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # blank or torn
            continue
    return records


def read_events(run_dir: str | Path) -> list[dict]:
    """Every record of run_dir/events.jsonl, oldest first ([] without the file)."""
    return read_jsonl(Path(run_dir) / EVENTS_FILE)
