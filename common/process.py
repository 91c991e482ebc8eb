"""Process life, shared by the trainer, its loader workers and the launcher (torch-free, so `--help`
stays fast): how a process ends (`exit_now`), whether another one is alive, what /proc says about it,
signalling one or its process group (`send_signal`, the one signal helper; `kill_group` on it), and dying with a parent
(PR_SET_PDEATHSIG)."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path


def exit_now(code: int) -> None:
    """Exit with `code` after the atexit handlers, skipping the rest of interpreter teardown.

    Called once the program has closed and flushed everything it writes (checkpoints committed,
    metrics, loader workers, the process group destroyed). What teardown would still do is destroy
    torch's C++ objects and stop daemon threads in no set order, and now and then a gloo or TCPStore
    thread that is still joinable aborts a process whose run succeeded ("terminate called without an
    active exception", exit -6: about once in 50 two-rank runs under CI load)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, utime + stime in clock ticks) of a process, or None once it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[11]) + int(fields[12]))


def parent_pid(pid: int) -> int | None:
    """The pid of a process's parent, or None once it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def is_alive(pid: int) -> bool:
    """Running: not exited and not a zombie waiting to be reaped. Without /proc: signal 0 answers."""
    if Path("/proc/self/stat").exists():
        stat = proc_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: somebody else's process
        return True
    return True


def process_start_time(pid: int | None = None) -> float:
    """Unix time at which a process started, to ~10 ms (from /proc; now if unavailable)."""
    fields = _stat_fields(pid or os.getpid())
    try:
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: field 22 of stat
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError, TypeError):
        return time.time()


def send_signal(pid: int, sig: int, *, group: bool) -> bool:
    """Send `sig` to process `pid`, or (`group`) to the process group it leads; False when there is no
    such process (group) or it is not ours to signal, True when the signal was sent."""
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(pid: int) -> None:
    """SIGKILL a rank's process group (its loader workers), and the rank itself should it have left that
    group: how the launcher kills a trainer it no longer waits for (a hung rank, a survivor that never
    noticed a failure, a forked rank whose stub is gone)."""
    send_signal(pid, signal.SIGKILL, group=True)
    send_signal(pid, signal.SIGKILL, group=False)


def die_with_parent(parent_alive: Callable[[], bool]) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; False elsewhere).
    `parent_alive()` is asked afterwards: if the parent died before the request took effect, this
    process exits at once."""
    if not sys.platform.startswith("linux"):
        return False
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if not parent_alive():
        os.kill(os.getpid(), signal.SIGKILL)
    return True
