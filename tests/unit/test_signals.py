"""Signal handlers that cannot deadlock: SIGTERM arrives several times at once in practice (Slurm signals
every process of a job step, the launcher's stub relays it, the launcher forwards it), and a Python handler
can be entered again, on the same thread, while it runs. trainer.runtime.fault.PreemptionFlag's handler used
to set a threading.Event, whose lock a nested call then waited for forever: the rank hung instead of
committing its emergency checkpoint (seen in the Slurm test, then reproduced here)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, child_env

CHILD = """
import sys
from trainer.runtime.fault import PreemptionFlag
flag = PreemptionFlag()
print("ready", flush=True)
sys.stdin.readline()  # the parent has stopped signalling
print("alive", flag.received, flush=True)
"""


@pytest.mark.slow  # a child process that imports torch, and a second of signals
def test_a_burst_of_sigterms_sets_the_preemption_flag_without_deadlocking():
    """A process with a PreemptionFlag gets SIGTERM as fast as another can send it, for a second: it must
    still answer afterwards (within a bound) with the flag set. Before the fix it hung in most runs."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=child_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)  # importing torch: bounded too
        assert ready and child.stdout.readline().strip() == "ready", "the child did not start within 60 s"
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for _ in range(100):
                os.kill(child.pid, signal.SIGTERM)
        child.stdin.write("done\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        raise AssertionError("the process deadlocked in its SIGTERM handler") from None
    finally:
        if child.poll() is None:
            child.kill()
    assert out.strip() == "alive True", out
