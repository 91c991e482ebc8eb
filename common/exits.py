"""The exit codes of a rank and of the launcher: the one list both sides (and `python -m data.prepare`)
exit with and read. Torch-free."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # an error; for the launcher: restart budget spent, or a failure restarting cannot fix
EXIT_USAGE = 2  # bad command line, config or input: restarting cannot fix it
EXIT_CRASH_LOOP = 3  # launcher: the same failure at the same step again and again
EXIT_STORAGE = 4  # storage (checkpoints, data) could not be used, or stalled, within its bounds (storage.*);
#                   it may come back: the launcher restarts with backoff, and exits 4 when its budget is spent
EXIT_FAULTY = 5  # a rank computes wrong results (trainer.health): its node is set aside (run.dir/excluded-nodes)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after an emergency checkpoint; launch again to resume

__all__ = ["EXIT_CRASH_LOOP", "EXIT_FAILED", "EXIT_FAULTY", "EXIT_OK", "EXIT_PREEMPTED", "EXIT_STORAGE", "EXIT_USAGE"]
