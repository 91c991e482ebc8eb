"""Hang detection for one node's ranks: reads the heartbeat records the trainer rewrites after every
step (`trainer.runtime.protocol.Heartbeat`) and declares a rank hung when no step has finished for
`hang_timeout_s`. It arms only once a rank has finished its first step of the current attempt
(start-up, compile and checkpoint loading are not steps), and it says *why* a rank is stuck:
stopped (SIGSTOP, state T), spinning (busy CPU), or waiting (asleep in a collective or in I/O)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.contract import HeartbeatRecord, is_alive, proc_stat, read_heartbeats

log = logging.getLogger(__name__)


@dataclass
class Hang:
    rank: int
    pid: int
    step: int
    stale_s: float
    state: str  # stopped | spinning | waiting | gone
    cpu: float = 0.0  # recent CPU use, fraction of one core
    phase: str = "train"  # what the rank said it was doing last (its heartbeat's phase)

    def describe(self) -> str:
        what = {"stopped": "is stopped (SIGSTOP or a debugger)", "spinning": "is spinning (busy CPU, no progress)",
                "waiting": "is waiting (in a collective or I/O)", "gone": "has vanished"}[self.state]
        during = PHASES.get(self.phase, "")
        return (f"rank {self.rank} (pid {self.pid}) {what}{during}: no step finished for {self.stale_s:.1f}s "
                f"after step {self.step}")


# A rank writing a checkpoint, or recovering in process (waiting, bounded, for a replacement rank).
SAVE_PHASES = ("save", "preempt", "recover")

# Heartbeat phases that name where a rank was stuck; a storage that stops answering shows up in a save.
PHASES = {"save": " while saving a checkpoint (is the checkpoint storage answering?)",
          "preempt": " while saving its emergency checkpoint (is the checkpoint storage answering?)",
          "eval": " while evaluating"}


class Watchdog:
    """Per-node hang detector over a heartbeat directory (one file per local rank)."""

    def __init__(self, directory: str | Path, hang_timeout_s: float, save_timeout_s: float = 0.0) -> None:
        self.directory = Path(directory)
        self.hang_timeout_s = hang_timeout_s
        # A rank in a checkpoint save bounds its own wait on the storage (storage.stall_s) and says which
        # URL stalled: the watchdog gives it that long (and a margin) before calling it a hang.
        self.save_timeout_s = max(hang_timeout_s, save_timeout_s)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cpu: dict[int, tuple[float, int]] = {}  # pid -> (time, cpu ticks) at the previous check

    def reset(self) -> None:
        """Forget the previous attempt's records (called before workers start)."""
        for path in self.directory.glob("rank-*.json"):
            path.unlink(missing_ok=True)
        self._cpu.clear()

    def beats(self, attempt: int) -> dict[int, HeartbeatRecord]:
        """This attempt's heartbeat records by global rank."""
        return {r: b for r, b in read_heartbeats(self.directory).items() if b.attempt == attempt}

    def check(self, attempt: int, now: float | None = None, ignore: frozenset[int] = frozenset()) -> Hang | None:
        """The most likely culprit when some armed rank has not finished a step within the timeout. `ignore`:
        pids of ranks known dead and being replaced (their records stand until the replacement writes)."""
        now = time.time() if now is None else now
        beats = {r: b for r, b in self.beats(attempt).items() if b.pid not in ignore}
        armed = [b for b in beats.values() if b.startup.t_first]
        hangs = []
        if any(now - b.t > self._limit(b.phase) for b in armed):
            # A stopped rank (SIGSTOP, a debugger) is the culprit even when its last step ended a moment
            # after the overdue rank's: that rank waits for it in the next collective.
            hangs = [Hang(b.rank, b.pid, b.step, now - b.t, *self._state(b.pid, now), phase=b.phase)
                     for b in armed]
            hangs = [h for h in hangs if h.stale_s > self._limit(h.phase) or h.state == "stopped"]
        for b in beats.values():  # CPU time sampled about once a second tells spinning from waiting
            stat = proc_stat(b.pid)
            if stat and now - self._cpu.get(b.pid, (0.0, 0))[0] >= 1.0:
                self._cpu[b.pid] = (now, stat[1])
        if not hangs:
            return None
        order = {"stopped": 0, "spinning": 1, "gone": 2, "waiting": 3}
        return min(hangs, key=lambda h: (order[h.state], -h.cpu, h.step, h.rank))

    def _limit(self, phase: str) -> float:
        return self.save_timeout_s if phase in SAVE_PHASES else self.hang_timeout_s

    def _state(self, pid: int, now: float) -> tuple[str, float]:
        """(state, recent CPU use as a fraction of one core). A rank waiting in a collective sleeps
        (state S, little CPU); a spinning one is runnable (R) or burns CPU even on a crowded machine."""
        stat = proc_stat(pid)
        if stat is None:
            return "gone", 0.0
        letter, ticks = stat
        if letter in "Tt":
            return "stopped", 0.0
        then, then_ticks = self._cpu.get(pid, (0.0, 0))
        busy = (ticks - then_ticks) / os.sysconf("SC_CLK_TCK") / (now - then) if 0.2 <= now - then <= 10 else 0.0
        return ("spinning" if letter == "R" or busy > 0.3 else "waiting"), busy

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _this_host() -> str:
    return f"heartbeats-{socket.gethostname()}-"


def heartbeat_prefix(pid: int | None = None) -> str:
    """A launcher's heartbeat directories in run.dir are named `heartbeats-<host>-<launcher pid>-...`: a
    run.dir may be shared by the nodes of a job, and by a launcher and its successor."""
    return f"{_this_host()}{os.getpid() if pid is None else pid}-"


def abandoned_progress(run_dir: str | Path) -> HeartbeatRecord | None:
    """The furthest heartbeat left by launchers of this node that no longer exist (a launcher killed
    outright never removes its directory), and their directories removed; None if there were none.
    Its `step` is the step the lost launcher's group had reached."""
    furthest = None
    for directory in Path(run_dir).glob(f"{_this_host()}*"):
        pid = directory.name.removeprefix(_this_host()).split("-", 1)[0]
        if not pid.isdigit() or is_alive(int(pid)):
            continue
        for beat in read_heartbeats(directory).values():
            if furthest is None or beat.step > furthest.step:
                furthest = beat
        shutil.rmtree(directory, ignore_errors=True)
    return furthest


def print_stacks(beats: dict[int, HeartbeatRecord], why: str) -> None:
    """Have these ranks print their stacks (SIGUSR1: trainer.runtime.fault.stacks_on_sigusr1) before they
    are killed: where the ones a recovery waited for in vain, or a preemption's grace period, were stuck. Ranks
    that have exited (a rank that committed, say) are left out."""
    beats = {rank: beat for rank, beat in beats.items() if is_alive(beat.pid)}
    for rank, beat in sorted(beats.items()):
        log.info(f"rank {rank} (pid {beat.pid}, {beat.phase}) {why}: its stacks")
        with contextlib.suppress(OSError):
            os.kill(beat.pid, signal.SIGUSR1)
    time.sleep(0.5 if beats else 0.0)
