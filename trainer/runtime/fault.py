"""Worker-side fault handling: SIGTERM preemption (the ranks agree on it at a step boundary, commit an
emergency checkpoint and exit with EXIT_PREEMPTED), dying with the launcher, and the fault injection
that tests and chaos runs use (a crash, a hang, a kill or a write error at a given step and rank,
named by environment variables of trainer.runtime.protocol). Everything here is a no-op without the launcher
or those variables."""

from __future__ import annotations

import errno
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from common.process import die_with_parent
from common.timing import BLOCK_ABOVE_S, CHECK_EVERY_S
from trainer.runtime import protocol

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
    """A storage operation stalled past `storage.stall_s` (common.storage.StallWatch): EXIT_STORAGE."""
    from common.storage import StorageStalled

    stop_now(message, protocol.EXIT_STORAGE, StorageStalled)


def lease_lost(message: str) -> None:
    """Another job took over this run's directory (trainer.runtime.lease): stop before both write to it."""
    from trainer.runtime.lease import DirectoryInUse

    stop_now(message, protocol.EXIT_USAGE, DirectoryInUse)


def die_with_launcher() -> None:
    """Under the launcher, make the kernel SIGKILL this rank if the launcher dies (a lost node must
    not leave orphaned ranks holding ports and memory: torchrun starts them in their own session)."""
    launcher = os.environ.get(protocol.LAUNCHER_PID_ENV)
    if launcher:
        die_with_parent(lambda: os.getppid() == int(launcher))


def stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's Python stack to stderr (`kill -USR1 <rank pid>`); the launcher sends
    it to the ranks an in-process recovery waited for in vain, before it falls back."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


# How often the ranks agree on a preemption (PreemptionFlag): steps shorter than BLOCK_ABOVE_S agree about
# every CHECK_EVERY_S (common.timing), pipelined; longer ones block at the end of every step.
MAX_STEPS_BETWEEN = 32


def steps_between_checks(step_s: float) -> int:
    """This rank's proposal for the steps between two preemption agreements, from its step time: 0 =
    block at every step (a slow step: the all-reduce is a negligible part of it, and the ranks stop at
    the end of the step the signal came in); k >= 1 = every k steps, pipelined (about every CHECK_EVERY_S)."""
    if step_s >= BLOCK_ABOVE_S:
        return 0
    return max(1, min(MAX_STEPS_BETWEEN, int(CHECK_EVERY_S / step_s))) if step_s > 0 else MAX_STEPS_BETWEEN


class PreemptionFlag:
    """SIGTERM sets a flag; `agreed()`, called by every rank at every step boundary, makes all ranks stop
    at the same step once any of them got it.

    A blocking all-reduce after every step would cost more, on small fast steps, than the rest of the
    fault tolerance together. So the ranks agree at check steps only, and on fast steps without waiting: at a
    check step every rank reads the MAX all-reduce it started, asynchronously, at
    the previous check step (finished long since), and starts the next one. That all-reduce also carries
    each rank's proposal for the steps to the next check (`steps_between_checks`; the smallest wins), so
    every rank knows the same check steps and reads the same flags at the same step: they all stop
    there. A signal is acted on within about 2 x CHECK_EVERY_S on fast steps; on steps of BLOCK_ABOVE_S
    or more the all-reduce blocks at every step, and the ranks stop at the end of the step the signal
    came in. With one rank there is nothing to agree on: it stops at the next boundary."""

    def __init__(self) -> None:
        # A plain attribute: the handler takes no lock. SIGTERM comes several times at once (Slurm signals every
        # process, the stub relays it, the launcher forwards it), and a handler entered again on the same
        # thread while it set a threading.Event waited forever for the Event's own lock: the rank hung.
        self._got = False
        self._previous = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None  # the all-reduce of the previous check
        self._every = 0  # agreed steps between checks; 0 = block at every step (until the ranks agree)
        self._next = 0  # the next check step (the same on every rank)
        self._checked: tuple[float, int] | None = None  # (time, step) of the previous check
        self._step_s = 0.0  # this rank's recent step time (0: not known yet)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self._got = True

    @property
    def received(self) -> bool:
        """Whether this rank itself got SIGTERM (the others learn it through `agreed`)."""
        return self._got

    def restart_agreement(self) -> None:
        """Start agreeing afresh, as a new rank does (in-process recovery: the all-reduce in flight was on
        the failed generation's group, and a replacement rank knows no agreed check steps). A SIGTERM
        already received stays set."""
        self._pending, self._every, self._next, self._checked, self._step_s = None, 0, 0, None, 0.0

    def checks_at(self, step: int) -> bool:
        """Whether `agreed()` starts an all-reduce at this step boundary (the same on every rank)."""
        return step >= self._next

    @property
    def blocking(self) -> bool:
        """Whether the ranks agree at every step, waiting for it (slow steps, or not yet known)."""
        return self._every == 0

    def agreed(self, step: int, world: int, device: torch.device, last: bool = False) -> bool:
        """Collective when world > 1 (every rank, every step boundary, in step order): true on every rank
        at the same step once any rank got SIGTERM. `last`: the run's final step, which stops anyway; the
        agreement in flight is completed and no new one started (no collective is left pending)."""
        if world == 1:
            return self._got and not last
        if last:
            if self._pending is not None:
                self._read()
            return False
        if step < self._next:
            return False
        now = time.perf_counter()
        if self._checked is not None:
            self._step_s = (now - self._checked[0]) / max(step - self._checked[1], 1)
        self._checked = (now, step)
        if self._pending is not None and self._read():
            return True
        proposal = steps_between_checks(self._step_s) if self._step_s else 1
        flag = torch.tensor([int(self._got), -proposal], device=device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        if self._every == 0 and self._read():  # blocking: agree on this very step
            return True
        self._next = step + max(self._every, 1)
        return False

    def _read(self) -> bool:
        """Wait for the pending all-reduce: whether any rank had the flag; sets the agreed interval."""
        work, flag = self._pending
        self._pending = None
        work.wait()
        anyone, neg_every = flag.tolist()
        self._every = -neg_every
        return anyone > 0

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


# ---------------------------------------------------------------------- fault injection (tests, chaos)
def slowdown(step: int, rank: int) -> float:
    """REKINDLE_SLOW_RANK="rank:seconds[@first[-last]]": the seconds `rank` sleeps in the forward/backward
    of each step from `first` (default 1) to `last` (default: the end), in every attempt (a straggler);
    0.0 for every other rank and step."""
    target = protocol.slow_rank(os.environ.get(protocol.SLOW_RANK_ENV, ""))
    if target is None:
        return 0.0
    slow_rank, seconds, first, last = target
    return seconds if rank == slow_rank and first <= step and (last is None or step <= last) else 0.0


def inject_faults(step: int, rank: int) -> None:
    """REKINDLE_FAIL_AT: a deterministic exception whose message, as real ones often do (a KeyError of an
    object's id), names an address and the pid, new in every attempt; REKINDLE_HANG_AT: a spinning hang
    (first attempt)."""
    if protocol.injected(os.environ.get(protocol.FAIL_AT_ENV, ""), step, rank):
        raise RuntimeError(f"injected failure at step {step} ({protocol.FAIL_AT_ENV}; object at "
                           f"{hex(id(object()))}, pid {os.getpid()})")
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

