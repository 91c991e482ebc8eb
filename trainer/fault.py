"""Worker-side fault handling: heartbeats the supervisor's watchdog reads, SIGTERM preemption
(finish the step, save, exit with EXIT_PREEMPTED), the events ledger append, and fault injection
for tests and chaos runs. Everything here is a no-op when the trainer runs without the launcher.

Heartbeat file: one per rank in `$REKINDLE_HEARTBEAT_DIR/rank-<r>.json`, a fixed-size JSON record
rewritten in place (one `pwrite`, no rename) after every step and at each phase change:
`{pid, rank, attempt, phase, step, t, t_proc, t_load, t_loaded, t_first, resumed_step, busy_s, steps_run}`.
`t_*` are unix times: process start, checkpoint load start/end, first step done in this attempt.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HEARTBEAT_ENV = "REKINDLE_HEARTBEAT_DIR"
FAIL_AT_ENV = "REKINDLE_FAIL_AT"  # "step[:rank]": raise at that step (every attempt): a deterministic crash
HANG_AT_ENV = "REKINDLE_HANG_AT"  # "step[:rank]": spin forever at that step (first attempt only)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after an emergency checkpoint; launch again to resume
RECORD_BYTES = 512


class Preempted(Exception):  # noqa: N818 - a request, not an error
    """SIGTERM was received; the emergency checkpoint of `step` is committed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"emergency checkpoint of step {step} committed after SIGTERM")
        self.step = step


def process_start_time(pid: int | None = None) -> float:
    """Unix time at which a process started, to ~10 ms (from /proc; now if unavailable)."""
    try:
        fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: field 22 of stat
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError):
        return time.time()


class Heartbeat:
    """This rank's progress record for the watchdog. Without $REKINDLE_HEARTBEAT_DIR it does nothing."""

    def __init__(self, rank: int) -> None:
        directory = os.environ.get(HEARTBEAT_ENV)
        self._fd: int | None = None
        self.record: dict[str, Any] = {
            "pid": os.getpid(), "rank": rank, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "phase": "init", "step": 0, "t": time.time(), "t_proc": process_start_time(), "t_load": 0.0,
            "t_loaded": 0.0, "t_first": 0.0, "resumed_step": 0, "busy_s": 0.0, "steps_run": 0,
        }
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._fd = os.open(Path(directory) / f"rank-{rank}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write()

    def beat(self, phase: str | None = None, step: int | None = None, **fields: Any) -> None:
        if self._fd is None:
            return
        now = time.time()
        if phase:
            self.record["phase"] = phase
        if step is not None:
            if self.record["t_first"] == 0.0 and phase == "train":
                self.record["t_first"] = now
            self.record["step"] = step
        self.record.update(fields, t=now)
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.record).encode().ljust(RECORD_BYTES)
        os.pwrite(self._fd, data, 0)

    def close(self, phase: str = "done") -> None:
        if self._fd is not None:
            self.beat(phase)
            os.close(self._fd)
            self._fd = None


def die_with_launcher() -> None:
    """Under the launcher, make the kernel SIGKILL this rank if the launcher dies (a lost node must
    not leave orphaned ranks holding ports and memory: torchrun starts them in their own session)."""
    launcher = os.environ.get("REKINDLE_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


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


class PreemptionFlag:
    """SIGTERM sets a flag; `requested()` makes all ranks agree on it at a step boundary."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self._set.set()

    def requested(self, world: int, device: torch.device) -> bool:
        """Collective when world > 1: true on every rank if any rank got SIGTERM."""
        if world == 1:
            return self._set.is_set()
        flag = torch.tensor([int(self._set.is_set())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def append_event(run_dir: str | Path, event: str, **fields: Any) -> dict:
    """Append one record to run_dir/events.jsonl (O_APPEND: one write per line)."""
    record = {"event": event, "time": time.time(), **fields}
    path = Path(run_dir) / "events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def _injection(env: str, rank: int) -> int | None:
    spec = os.environ.get(env, "")
    if not spec:
        return None
    step, _, only_rank = spec.partition(":")
    if only_rank and int(only_rank) != rank:
        return None
    return int(step)


def inject_faults(step: int, rank: int) -> None:
    """Test hooks: a deterministic exception or a spinning hang at a given step."""
    if _injection(FAIL_AT_ENV, rank) == step:
        raise RuntimeError(f"injected failure at step {step} ({FAIL_AT_ENV})")
    if _injection(HANG_AT_ENV, rank) == step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        while True:  # a runaway loop: 100% CPU, no progress
            pass
