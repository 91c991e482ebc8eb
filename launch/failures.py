"""Failure attribution: when a worker group fails, which rank's failure caused it, and how to tell it.

Pure functions over plain data: what torchelastic reported for each failed rank (`RankExit`, built by
`launch.agent`), the ranks' heartbeat records, and the watchdog's `Hang`. When one rank dies, the
others fail too (their collectives lose a peer, or the agent tears them down): those are victims,
and the root cause is the failure that explains the others."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import says_collective_failed, says_peer_lost
from trainer.contract import EXIT_FAULTY, EXIT_PREEMPTED, EXIT_STORAGE, HeartbeatRecord

if TYPE_CHECKING:
    from launch.watchdog import Hang


@dataclass(frozen=True)
class Failure:
    """What the restart policy decides on: one failure of the worker group, blamed on one rank."""

    rank: int
    cause: str  # exit | signal | hang | preemption | node | storage (it may come back: no crash-loop stop)
    step: int  # the step that was running (last finished step + 1)
    exit_code: int | None = None
    signal: str | None = None
    message: str = ""  # one line: the exception, the signal, or the hang diagnosis
    key: str = ""  # what makes two failures the same (`failure_key`; a hang's names no pid or seconds)

    def signature(self) -> tuple:
        """Two failures are the same when this is: the rank that reports it does not count, nor do the
        numbers in a message without a key (addresses, pids, ports change from one attempt to the next)."""
        return self.cause, self.exit_code, self.signal, self.step, self.key or without_numbers(self.message)

    def describe(self) -> str:
        how = {"exit": f"exited with code {self.exit_code}", "signal": f"was killed by {self.signal}",
               "hang": "hung", "preemption": "was preempted (SIGTERM)",
               "storage": "could not use its storage", "node": "was lost with its node",
               "faulty": "computes wrong results"}[self.cause]
        text = f"rank {self.rank} {how} at step {self.step}"
        return f"{text}: {self.message}" if self.message else text


@dataclass(frozen=True)
class RankExit:
    """One failed rank as torchelastic reported it."""

    rank: int  # global rank
    local_rank: int
    exit_code: int | None  # negative: killed by that signal
    when: float  # unix time it failed (the error file's mtime if any: torchelastic's own stamps are whole seconds)
    error: dict[str, Any] | None = None  # torchelastic's error-file data; None: the rank left no error file

    @property
    def killed(self) -> bool:
        return self.exit_code is not None and self.exit_code < 0


def signal_name(exit_code: int) -> str:
    """The name of the signal behind a negative exit code (`-9` -> `SIGKILL`)."""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def _error_message(error: dict[str, Any] | None) -> str:
    message = (error or {}).get("message", "")
    return message if isinstance(message, str) else str(message.get("message", ""))


def first_line(error: dict[str, Any] | None) -> str:
    """First line of the exception in torchelastic's error-file data ('' without one)."""
    message = _error_message(error).strip()
    return message.splitlines()[0] if message else ""


def traceback_tail(error: dict[str, Any] | None, lines: int = 6) -> str:
    """The last `lines` lines of the Python traceback in torchelastic's error-file data ('' without one)."""
    return "\n".join(_callstack(error).strip().splitlines()[-lines:])


# A frame of a Python traceback: `  File "/.../trainer/checkpoint/memory.py", line 120, in local_tensors`.
FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)', re.MULTILINE)
PROJECT_PACKAGES = ("trainer", "data", "launch", "common")
PROJECT_ROOT = Path(__file__).resolve().parents[1]  # where those packages are, here as in the ranks
INNERMOST_FRAMES = 2  # of this project's code, to tell where an exception was raised


def without_numbers(text: str) -> str:
    """`text` with every number (decimal or hex: ids, addresses, pids, ports, sizes) written as N."""
    return re.sub(r"(0x[0-9a-fA-F]+|\d+)", "N", text)


def failure_key(error: dict[str, Any] | None) -> str:
    """What makes an exception the same from one attempt to the next, whichever rank raises it: its type
    and where it was raised, as the innermost frames of this project's code in the traceback
    (package-relative path, line, function). Without a traceback: the first line, numbers left out."""
    message = first_line(error)
    kind = message.split(":", 1)[0] if ":" in message else message
    frames = []
    for frame in FRAME.finditer(_callstack(error)):
        path = Path(frame["path"])
        if path.is_relative_to(PROJECT_ROOT) and path.relative_to(PROJECT_ROOT).parts[0] in PROJECT_PACKAGES:
            frames.append(f"{path.relative_to(PROJECT_ROOT)}:{frame['line']}:{frame['function']}")
    if not frames:
        return without_numbers(message)
    return f"{without_numbers(kind)} at {' < '.join(reversed(frames[-INNERMOST_FRAMES:]))}"


def _callstack(error: dict[str, Any] | None) -> str:
    message = (error or {}).get("message", {})
    return message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""


def lost_peer(message: str) -> bool:
    """Whether an exception (its text) is a victim's error, not a root cause: a lost peer (the trainer's own
    test, common.errors), or a collective library's failure such as a timeout (a peer that stopped
    answering: it failed first, or hangs)."""
    return says_peer_lost(message) or says_collective_failed(message)


def blame_order(failed: RankExit) -> tuple:
    """Sort key for root causes, most to blame first: a signal; then an exception of its own, or an exit
    that left no error file (a deliberate exit code); then a lost-peer error or an empty message;
    earliest first within each kind, then the lowest rank."""
    message = first_line(failed.error)
    if failed.killed:
        kind = 0
    elif failed.error is None or (message and not lost_peer(message)):
        kind = 1
    else:
        kind = 2
    return kind, failed.when, failed.rank


def root_cause(exits: dict[int, RankExit], victims: set[int]) -> RankExit:
    """The failure that explains the others. Ranks still running when the group was torn down
    (`victims`, by local rank) are causes only if nothing else failed."""
    causes = [e for e in exits.values() if e.local_rank not in victims] or list(exits.values())
    return min(causes, key=blame_order)


def from_exits(exits: dict[int, RankExit], victims: set[int], beats: dict[int, HeartbeatRecord],
               last_step: int) -> tuple[Failure, str]:
    """The group's failure, blamed on its root cause, and a traceback excerpt ('' if none applies).
    `beats`: the attempt's heartbeat records by rank (the step a rank was on); `last_step`: the step
    to assume for a rank without one."""
    cause = root_cause(exits, victims)
    step = (beats[cause.rank].step if cause.rank in beats else last_step) + 1
    if cause.killed:
        return Failure(cause.rank, "signal", step, cause.exit_code, signal_name(cause.exit_code)), ""
    if cause.exit_code == EXIT_PREEMPTED:
        # Every rank exits 75 after a SIGTERM to any one of them: name the one that got it, which
        # says so in its heartbeat (`signalled`), when it is on this node; it need not have exited yet
        # (the first rank to exit ends the group).
        signalled = sorted(r for r, beat in beats.items() if beat.signalled)
        rank = signalled[0] if signalled else cause.rank
        step = (beats[rank].step if rank in beats else last_step) + 1
        return Failure(rank, "preemption", step, cause.exit_code), ""
    if cause.exit_code == EXIT_STORAGE:  # the rank said which URL, in one line: no traceback
        return Failure(cause.rank, "storage", step, cause.exit_code, message=first_line(cause.error)), ""
    if cause.exit_code == EXIT_FAULTY:  # the rank's check named it (trainer.health), in one line
        return Failure(cause.rank, "faulty", step, cause.exit_code, message=first_line(cause.error)), ""
    return (Failure(cause.rank, "exit", step, cause.exit_code, message=first_line(cause.error),
                    key=failure_key(cause.error)), traceback_tail(cause.error))


def from_hang(hang: Hang, checkpoint_dir: str = "") -> Failure:
    """A hung rank as a failure (naming `checkpoint_dir` when it hung in a save: the rank's own bound on
    the storage, storage.stall_s, had not fired). Its key names no pid or seconds: the same hang again
    is the same failure."""
    message = hang.describe()
    if hang.phase in ("save", "preempt") and checkpoint_dir:
        message += f" [checkpoint storage: {checkpoint_dir}]"
    return Failure(hang.rank, "hang", hang.step + 1, message=message, key=f"rank {hang.rank} {hang.state} {hang.phase}")


def drop_torn_error_file(path: str) -> None:
    """Remove a rank's error file that is not whole JSON: the rank was killed while writing it (a victim
    of another rank's failure, caught writing its own). torchelastic's ProcessFailure raises on it, which
    would end the agent; without the file the rank counts as killed, which it was."""
    try:
        with open(path) as f:
            json.load(f)
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            os.remove(path)


def rank_exit(rank: int, pf) -> RankExit:
    """torchelastic's ProcessFailure as plain data. Without an error file torchelastic fills in a
    placeholder message; that is no error of the rank's, so it becomes None."""
    try:
        when, error = os.stat(pf.error_file).st_mtime, pf.error_file_data
    except (OSError, TypeError):
        when, error = float(pf.timestamp), None
    return RankExit(rank, pf.local_rank, pf.exitcode, when, error)
