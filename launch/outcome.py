"""How a launcher ends: its exit code and the one line that says why, from what the supervisor saw
(`launch.supervisor`): the agent's result, its error, the restart policy's decision, a preemption."""

from __future__ import annotations

import time

from launch import rendezvous
from launch.commits import newest_commit
from launch.ledger import Attempt
from launch.policy import Decision
from trainer.contract import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE


def ended(succeeded: bool, closed: bool, error: BaseException | None, decision: Decision | None, endpoint: str,
          listed: int, ran: bool, final: int | None) -> tuple[int, str]:
    """The outcome of a launcher that was not preempted. `closed`: the others closed the rendezvous before
    this node took part; `endpoint`: the rendezvous endpoint in use, the last of `listed` or not; `ran`:
    this node ran ranks; `final`: the job's final step when the checkpoint store holds its commit (a
    spare, or any node whose rendezvous host finished first, has nothing left to do)."""
    if succeeded:
        return EXIT_OK, "done"
    lost = error is not None and rendezvous.store_lost(error)
    if (closed or lost) and final is not None:
        return EXIT_OK, (f"the job finished (step {final} committed)"
                         f"{'' if ran else ' while this node waited to join'}: nothing left to do here")
    if closed:
        return EXIT_FAILED, "the other nodes closed the rendezvous before this node took part: the job ended without it"
    if lost:
        last = " (the last of --rdzv-endpoint)" if listed > 1 else ""
        return EXIT_PREEMPTED, (f"the rendezvous endpoint {endpoint}{last} stopped answering (the node hosting it "
                                f"is lost, or this one cut off from it): launch again to resume from the newest state")
    if isinstance(error, rendezvous.AnotherJobsStore):
        return EXIT_USAGE, str(error)
    if error is not None:
        return EXIT_FAILED, f"launcher error: {type(error).__name__}: {error}"
    if decision is not None:
        return decision.exit_code, decision.reason.splitlines()[0]
    return EXIT_FAILED, "failed"


def preempted(checkpoint_dir: str, grace_s: float, preempt_at: float, ranks_at_signal: bool,
              attempt: Attempt | None) -> tuple[str, int | None]:
    """A preempted launcher's line (it exits 75, always: a preempted job stays requeueable), saying where
    the next launch resumes, and the newest committed step (the same on every node, whatever step its
    ranks had reached), asked of the checkpoint store within what is left of the grace period."""
    left = max(preempt_at + grace_s - time.time() - 0.2, 0.5)
    newest = newest_commit(checkpoint_dir, left)
    return preempted_line(newest, preempt_at, ranks_at_signal, attempt, grace_s), newest[0] if newest else None


def preempted_line(newest: tuple[int, float] | None, preempt_at: float, ranks_at_signal: bool,
                   attempt: Attempt | None, grace_s: float) -> str:
    """The run's state is safe in a committed checkpoint when the newest commit holds every step trained
    (the emergency checkpoint) or the running group (`attempt`, the ledger's) trained nothing (the signal
    came during a rendezvous, a backoff, a start-up or a resume); otherwise the steps trained since the
    last commit could not be committed within the grace period (storage that stopped answering) and are
    trained again."""
    trained = attempt.last_step if attempt else 0
    if newest is not None and (newest[0] >= trained or newest[1] >= preempt_at):
        return "preempted"
    if not ranks_at_signal or attempt is None or attempt.steps_run == 0:
        return "preempted (nothing was trained since the last commit)"
    return (f"preempted, but no emergency checkpoint of step {trained} was committed within "
            f"fault.preempt_grace_s={grace_s:g}s: the next launch resumes from the last commit"
            + (f" (step {newest[0]})" if newest else ""))
