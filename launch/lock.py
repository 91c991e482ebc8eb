"""Who owns a run directory: each launcher holds an exclusive `flock` on a file of its own in
`run.dir/.launchers/`, which records the job it belongs to. A launcher refuses to start where a live
launcher of another job holds one (two jobs on one run.dir would resume from each other's checkpoints
and interleave their ledgers); the launchers of one job (the nodes of a multi-node run sharing a
run.dir, same rendezvous endpoint and id) may share it. The kernel drops a lock when its process
dies, so a launcher killed with SIGKILL leaves a file that the next one removes.

The trainer's lease (trainer.runtime.lease) says "one job per directory" too, and both are needed: this
lock is local, taken before any rank starts (a second job's launcher stops before it starts anything)
and shared by the launchers of one job; the lease covers checkpoint.dir on object storage as well, and
plain torchrun or a single process, where no launcher runs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from trainer.contract import atomic_file

LOCKS = ".launchers"


class RunDirInUse(RuntimeError):
    """A live launcher of another job holds the run directory."""


def job_key(rdzv_endpoint: str, rdzv_id: str) -> str:
    """The same for the nodes of one job; unique for a standalone launcher (no endpoint)."""
    if not rdzv_endpoint:
        return f"standalone:{socket.gethostname()}:{os.getpid()}"
    return f"{rdzv_endpoint}|{rdzv_id}"


def _holder(path: Path) -> dict | None:
    """The record of the live launcher holding `path`; None (and the file removed) if nobody holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(Path(path).read_text() or "{}")
            except FileNotFoundError:  # its launcher ended (and removed it) between the two looks
                return None
            except (ValueError, OSError):
                return {}
        path.unlink(missing_ok=True)  # its launcher is gone
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def claim(run_dir: str | Path, key: str) -> Iterator[Path]:
    """Hold this launcher's lock in `run_dir` while the block runs. Raises RunDirInUse, naming the
    holder, when a live launcher of another job holds one."""
    directory = Path(run_dir) / LOCKS
    directory.mkdir(parents=True, exist_ok=True)
    for other in sorted(directory.glob("*.lock")):
        holder = _holder(other)
        if holder is not None and holder.get("job") != key:
            raise RunDirInUse(
                f"{run_dir} is in use by another job: the launcher with pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, running since {time.ctime(holder.get('since', 0))}; stop it, or "
                "give this run another run.dir")
    path = directory / f"{socket.gethostname()}-{os.getpid()}.lock"
    fd = None
    try:
        with atomic_file(str(path)) as f:  # visible only once locked and written
            fd = os.dup(f.fileno())  # the lock is the open file's: this copy holds it once `f` is closed
            fcntl.flock(fd, fcntl.LOCK_EX)
            f.write(json.dumps({"job": key, "pid": os.getpid(), "host": socket.gethostname(),
                                "since": time.time()}).encode())
        yield path
    finally:
        path.unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)
