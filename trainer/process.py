"""How the trainer's and the launcher's processes end: `exit_now`, after the atexit handlers and
without the rest of interpreter teardown (torch-free, so `--help` stays fast)."""

from __future__ import annotations

import atexit
import os
import sys


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
