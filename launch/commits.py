"""What the checkpoint store says was committed, asked by a preempted launcher within its grace period
(the store is the one thing every node shares)."""

from __future__ import annotations

import logging

from common.clock import call_bounded

log = logging.getLogger(__name__)


def newest_commit(root: str, timeout_s: float) -> tuple[int, float] | None:
    """(step, commit time) of the newest committed step in the checkpoint store, asked of the store
    itself, which every node shares: exit codes do not tell (ranks still tearing down when the first
    one exits may be killed), and rank 0's `commit` events are in its own run.dir, which on another
    node's pod this launcher does not see. None when there is none, or the store does not answer within
    `timeout_s` (a preempted launcher must exit within its grace period)."""
    def ask() -> tuple[int, float] | None:
        try:
            from trainer.contract import committed_steps, read_commit, step_dir  # (torch: within the bound)

            steps = committed_steps(root)
            return (steps[-1], read_commit(step_dir(root, steps[-1]))["time"]) if steps else None
        except Exception as e:  # noqa: BLE001 - unreadable store: say so, and count it as not committed
            log.warning(f"could not check {root} for the emergency checkpoint: {type(e).__name__}: {e}")
            return None

    asked = call_bounded(ask, timeout_s, name="ask-checkpoint-store")
    if not asked.done:
        log.warning(f"the checkpoint store {root} did not answer within {timeout_s:.0f}s: the emergency "
                    "checkpoint cannot be confirmed")
        return None
    return asked.value
