"""Worker-side fault handling: SIGTERM preemption (the ranks agree on it at a step boundary, commit an
emergency checkpoint and exit with EXIT_PREEMPTED), dying with the launcher, and the fault injection
that tests and chaos runs use (a crash, a hang, a kill or a write error at a given step and rank,
named by environment variables of trainer.protocol). Everything here is a no-op without the launcher
or those variables."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer import protocol
from trainer.process import die_with_parent

FAULT_AFTER_BYTES = 4096  # `shards` / `write-error` fire once this much of the shard file is written


class Preempted(Exception):  # noqa: N818 - a request, not an error
    """SIGTERM was received; the emergency checkpoint of `step` is committed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"emergency checkpoint of step {step} committed after SIGTERM")
        self.step = step


def stop_now(message: str, code: int, error: type[Exception] = RuntimeError) -> None:
    """End this rank at once from any thread (the one that would raise is blocked, or is not this one):
    say `message` in one line, leave it in torchelastic's error file for the launcher's ledger, exit `code`."""
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    print(f"error: {message}", file=sys.stderr, flush=True)
    try:
        ErrorHandler().record_exception(error(message))
    finally:
        os._exit(code)


def storage_stalled(message: str) -> None:
    """A storage operation stalled past `storage.stall_s` (trainer.storage.StallWatch): EXIT_STORAGE."""
    from trainer.storage import StorageStalled

    stop_now(message, protocol.EXIT_STORAGE, StorageStalled)


def lease_lost(message: str) -> None:
    """Another job took over this run's directory (trainer.lease): stop before both write to it."""
    from trainer.lease import DirectoryInUse

    stop_now(message, protocol.EXIT_USAGE, DirectoryInUse)


def die_with_launcher() -> None:
    """Under the launcher, make the kernel SIGKILL this rank if the launcher dies (a lost node must
    not leave orphaned ranks holding ports and memory: torchrun starts them in their own session)."""
    launcher = os.environ.get(protocol.LAUNCHER_PID_ENV)
    if launcher:
        die_with_parent(lambda: os.getppid() == int(launcher))


class PreemptionFlag:
    """SIGTERM sets a flag; `requested()` makes all ranks agree on it at a step boundary."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self._set.set()

    @property
    def received(self) -> bool:
        """Whether this rank itself got SIGTERM (the others learn it through `requested`)."""
        return self._set.is_set()

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


# ---------------------------------------------------------------------- fault injection (tests, chaos)
def inject_faults(step: int, rank: int) -> None:
    """REKINDLE_FAIL_AT: a deterministic exception; REKINDLE_HANG_AT: a spinning hang (first attempt)."""
    if protocol.injected(os.environ.get(protocol.FAIL_AT_ENV, ""), step, rank):
        raise RuntimeError(f"injected failure at step {step} ({protocol.FAIL_AT_ENV})")
    if protocol.injected(os.environ.get(protocol.HANG_AT_ENV, ""), step, rank) and protocol.attempt() == 0:
        while True:  # a runaway loop: 100% CPU, no progress
            pass


def _checkpoint_fault(point: str, step: int, rank: int) -> bool:
    """REKINDLE_CRASH_AT="<point>@<step>[:rank]" names this point of the save of `step` on `rank`."""
    where, _, at = os.environ.get(protocol.CRASH_AT_ENV, "").partition("@")
    return where == point and protocol.injected(at, step, rank)


def crash_point(point: str, step: int, rank: int) -> None:
    """`commit`: SIGKILL rank 0 after every shard is written but before COMMIT.json."""
    if _checkpoint_fault(point, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def write_fault(step: int, rank: int) -> Callable[[int], None] | None:
    """The injected fault (if any) for this rank's shard write of `step`, called with the bytes written
    so far: `shards` SIGKILLs the rank in the middle of its shard file, `write-error` fails the write
    with ENOSPC (disk full)."""
    if _checkpoint_fault("shards", step, rank):
        def kill(written: int) -> None:
            if written >= FAULT_AFTER_BYTES:
                os.kill(os.getpid(), signal.SIGKILL)
        return kill
    if _checkpoint_fault("write-error", step, rank):
        def disk_full(written: int) -> None:
            if written >= FAULT_AFTER_BYTES:
                raise OSError(errno.ENOSPC, f"No space left on device (injected by {protocol.CRASH_AT_ENV})")
        return disk_full
    return None

