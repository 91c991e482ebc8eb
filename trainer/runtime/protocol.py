"""The trainer <-> launcher contract, imported by both sides: environment variable names, exit codes,
the heartbeat record each rank rewrites, and the `events.jsonl` ledger. Torch-free, so the launcher
and `--help` stay light.

Heartbeat file: one per rank in `$REKINDLE_HEARTBEAT_DIR/rank-<r>.json`, a fixed-size JSON record
rewritten in place (one `pwrite`, no rename) once per step and at each phase change. Its fields are
declared once, here: `HeartbeatRecord` and its sections (`StartupTimes`, `TrainingProgress`,
`RecoveryTimes`), each field with its meaning. On disk the record is one flat JSON object keyed by the
field names (`HEARTBEAT_KEYS`); `Heartbeat` writes it, `read_heartbeats` reads it back as records.

Ledger: `run.dir/events.jsonl`, one JSON object per line with an `event` field, appended by the
launcher (start, failure, restart, resume, preempt, done) and by rank 0 (commit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from common.exits import (  # noqa: F401 - the contract's exit codes (common.exits), read here by the trainer
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_FAULTY,
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


# --- the heartbeat record: declared once, here. `Heartbeat` writes it, `read_heartbeats` reads it; on disk it is
# one flat JSON object whose keys are the field names below (HEARTBEAT_KEYS), the sections' included.
@dataclass(slots=True)
class StartupTimes:
    """How far this rank's start got, as unix times (0.0: not yet). The ledger splits a recovery's time by
    them; an in-process recovery sets the last three back to 0.0 until the new generation gets there."""

    t_proc: float = 0.0  # the process started (a forked rank: when it was forked)
    t_load: float = 0.0  # the checkpoint load began (the groups formed, the model built)
    t_loaded: float = 0.0  # the checkpoint load ended
    t_first: float = 0.0  # the first training step of this attempt or generation finished: arms the watchdog


@dataclass(slots=True)
class TrainingProgress:
    """Where this attempt (or in-process generation) resumed from, and what it has trained since."""

    resumed_step: int = 0  # the step of the state loaded (0: a fresh start)
    resumed_tier: str = ""  # where that state came from: memory-local | memory-peer | memory-reshard | durable
    # | none; '' before the load (the ledger reads '' as durable, as it did an older record without the key)
    tier_why: str = ""  # why that tier and not another (at most 200 characters)
    busy_s: float = 0.0  # seconds spent inside training steps since the load
    steps_run: int = 0  # steps finished since the load


@dataclass(slots=True)
class RecoveryTimes:
    """A surviving rank's latest in-process recovery (trainer.recovery.inplace), as unix times; all zero/empty
    for a rank that has not been through one. `recovering` and `t_error` are set as soon as it notices the
    lost peer (phase `recover`), the rest once the new generation has restored its state."""

    recovering: int = 0  # the generation it is recovering into (0: none)
    t_error: float = 0.0  # it noticed the lost peer (the collective failed)
    t_left: float = 0.0  # it was out of the failed collective, the old groups left
    t_joined: float = 0.0  # every rank of the new generation (the replacement too) had arrived
    t_reformed: float = 0.0  # the groups formed again (or the smaller world's)
    t_restored: float = 0.0  # the state was restored (the snapshot agreed on and loaded)
    replaced: list[int] = field(default_factory=list)  # the ranks started again as replacements
    in_process: bool = False  # this process went on through the recovery (not restarted)
    kept_pid: bool = False  # and so kept its pid (set with in_process)


@dataclass(slots=True)
class HeartbeatRecord:
    """One rank's heartbeat: who it is, what it is doing, and the three sections above. The launcher's
    watchdog, ledger, failure attribution and recovery coordinator read it (through trainer.contract)."""

    pid: int = 0  # the trainer's own pid (a warm rank's, not its torchelastic stub's)
    rank: int = 0  # its global rank (a survivor renumbered in a smaller world: the new one)
    attempt: int = 0  # the worker group's restart count on this node (TORCHELASTIC_RESTART_COUNT)
    group: str = ""  # the worker group's name, its rendezvous round (worker_group()): the same on every node
    generation: int = 0  # the generation of the groups it trains in (in-process recovery; 0: the first)
    phase: str = "init"  # init | load | loaded | train | eval | save | preempt | recover | done
    step: int = 0  # the last step finished (or loaded)
    t: float = 0.0  # when the record was last written (unix time)
    signalled: bool = False  # on a preemption: this rank itself got SIGTERM (the launcher names it)
    startup: StartupTimes = field(default_factory=StartupTimes)
    progress: TrainingProgress = field(default_factory=TrainingProgress)
    recovery: RecoveryTimes = field(default_factory=RecoveryTimes)

    def update(self, **fields: Any) -> None:
        """Set fields by their on-disk names (a section's too: `t_first=...`); a name not declared raises
        TypeError, so that a typo cannot write a key of its own."""
        for name, value in fields.items():
            setattr(self._holder(name), name, value)

    def _holder(self, name: str) -> Any:
        section = _SECTION_OF.get(name)
        if section is None:
            raise TypeError(f"the heartbeat record has no field {name!r} (declared: {', '.join(HEARTBEAT_KEYS)})")
        return getattr(self, section) if section else self

    def to_json(self) -> dict[str, Any]:
        """The flat on-disk form: every field by its name."""
        flat = {name: getattr(self, name) for name in _TOP_FIELDS}
        for section, names in _SECTION_FIELDS.items():
            part = getattr(self, section)
            flat.update({name: getattr(part, name) for name in names})
        return flat

    @classmethod
    def from_json(cls, flat: dict[str, Any]) -> HeartbeatRecord:
        """A record from its flat form: a missing key keeps its default (an older writer), an unknown one is
        ignored (a newer writer)."""
        sections = {section: _SECTIONS[section](**{name: flat[name] for name in names if name in flat})
                    for section, names in _SECTION_FIELDS.items()}
        return cls(**{name: flat[name] for name in _TOP_FIELDS if name in flat}, **sections)


_SECTIONS = {"startup": StartupTimes, "progress": TrainingProgress, "recovery": RecoveryTimes}
_TOP_FIELDS = tuple(f.name for f in dataclasses.fields(HeartbeatRecord) if f.name not in _SECTIONS)
_SECTION_FIELDS = {section: tuple(f.name for f in dataclasses.fields(c)) for section, c in _SECTIONS.items()}
_SECTION_OF = {name: "" for name in _TOP_FIELDS} | {n: s for s, names in _SECTION_FIELDS.items() for n in names}
HEARTBEAT_KEYS = tuple(_SECTION_OF)  # every key of the on-disk record, each declared once
assert len(HEARTBEAT_KEYS) == len(_TOP_FIELDS) + sum(map(len, _SECTION_FIELDS.values())), "a key declared twice"


class Heartbeat:
    """This rank's progress record for the launcher's watchdog. Without $REKINDLE_HEARTBEAT_DIR it does nothing."""

    def __init__(self, rank: int) -> None:
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        self._fd: int | None = None
        self._written = 0.0  # the record's `t` when it was last written
        self._size = HEARTBEAT_BYTES  # the file's length (records are padded to it with spaces)
        self.record = HeartbeatRecord(pid=os.getpid(), rank=rank, attempt=attempt(), group=worker_group(),
                                      generation=generation(), t=time.time(),
                                      startup=StartupTimes(t_proc=process_start_time()))
        self._dir = Path(directory) if directory else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._dir / f"rank-{rank}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write()

    def renumber(self, rank: int) -> None:
        """This rank goes on as `rank` (a smaller world): its record moves to that rank's file, written whole
        under a name of its own first and renamed into place, so that another survivor's file under either
        name (its own, being renumbered too) is never written to. The old name goes if it is still ours."""
        old, self.record.rank = self.record.rank, rank
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
        """Update the record and rewrite it: `fields` by their names in `HeartbeatRecord` (an undeclared name
        raises TypeError, written or not). A beat that would change nothing but the time `t` (the same
        phase again, no step or field) is written only when the file is REFRESH_S old, so that the
        record of a step is one write."""
        if self._fd is None:
            self.record.update(**fields)  # checked: a typo fails without a heartbeat directory too
            return
        now = time.time()
        record = self.record
        if not fields and step is None and phase in (None, record.phase) and now - self._written < REFRESH_S:
            return
        if phase:
            record.phase = phase
        if step is not None:
            if record.startup.t_first == 0.0 and phase == "train":
                record.startup.t_first = now
            record.step = step
        record.update(**fields)
        record.t = now
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.record.to_json()).encode()
        self._size = max(self._size, len(data))  # never shorter: no tail of a longer record is left
        os.pwrite(self._fd, data.ljust(self._size), 0)
        self._written = self.record.t

    def close(self, phase: str = "done") -> None:
        if self._fd is not None:
            self.beat(phase)
            os.close(self._fd)
            self._fd = None


STORE_FILE = "store.json"  # in the heartbeat directory: where the ranks' coordination store moved


def write_store_moved(directory: str | Path, old: tuple[str, str], new: tuple[str, str]) -> None:
    """The launcher's side: the ranks' coordination store at `old` (host:port, and the name their keys live
    under) is now at `new` (the previous endpoint's store was lost with its node; trainer.recovery.regroup
    follows). A rank of another store ignores it."""
    from common.storage import atomic_file

    said = {"from": list(old), "store": new[0], "group": new[1]}
    with atomic_file(str(Path(directory) / STORE_FILE)) as f:
        f.write(json.dumps(said).encode())


def forget_store_moves(directory: str | Path) -> None:
    """A new worker group starts: the ranks' store is where their environment says."""
    (Path(directory) / STORE_FILE).unlink(missing_ok=True)


def read_store_moved(directory: str | Path, where: str, group: str) -> tuple[str, str] | None:
    """(store, group) the launcher said the ranks' coordination store at (`where`, `group`) moved to; None when
    it did not move."""
    try:
        said = json.loads((Path(directory) / STORE_FILE).read_bytes())
        if [str(x) for x in said["from"]] != [where, group]:
            return None
        return str(said["store"]), str(said["group"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_heartbeats(directory: str | Path) -> dict[int, HeartbeatRecord]:
    """Every readable heartbeat record in a directory, by rank (a torn or empty file is skipped; missing keys
    keep their defaults, unknown ones are ignored: `HeartbeatRecord.from_json`)."""
    beats = {}
    for path in Path(directory).glob("rank-*.json"):
        try:
            record = json.loads(path.read_bytes().decode().strip() or "null")
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "rank" in record:
            beats[int(record["rank"])] = HeartbeatRecord.from_json(record)
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
