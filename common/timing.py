"""Every fixed time of the trainer and the launcher (seconds), each with its meaning, in one place, and
the orderings between them that recovery relies on, checked when this module is imported (`ORDERINGS`).
Bounds a user sets (dist.timeout_s, storage.stall_s, ...) are in the config instead. Torch-free."""

from __future__ import annotations

# ---------------------------------------------------------------------- a rank's own life (trainer/)
REFRESH_S = 1.0  # a heartbeat that changes nothing but its time is written at most this often
CHECK_EVERY_S = 0.25  # ranks with short steps agree on a preemption about this often, pipelined
BLOCK_ABOVE_S = 0.5  # steps at least this long agree on a preemption at the end of every step, blocking
SETTLE_S = 0.3  # a competing lease write lands within this (a read after it tells who won)

# ---------------------------------------------------------------------- in-process recovery, the ranks' side
WATCH_S = 0.1  # how often a rank asks the store whether another rank noticed a failure (one key: cheap)
WATCH_STORE_S = 2.0  # how long the watch thread's call to the store may take (it then checks again)
NOTICE_GRACE_S = 0.2  # after another rank noticed: how long a rank waits for its own collective to fail, then leaves
STUCK_S = 10.0  # a rank that left and has not begun its recovery this long after is blocked: it ends itself
POLL_S = 0.01  # how often a waiting survivor asks the store (on a few cores, asking takes CPU from the replacement)
RELEASE_AFTER_S = 5.0  # the failed generation's groups are let go this long after a recovery (none in use by then)

# ---------------------------------------------------------------------- in-process recovery, the launcher's side
UNAWARE_S = 2.0  # a survivor still training in the failed generation this long after is replaced as well
NODE_LOST_S = 0.4  # every rank here recovering this long, no word from the other ranks' launcher: their node is lost
NODE_HANDLED_S = 5.0  # how long a launcher waits for a failed rank's launcher that said it handles the failure
ARRIVAL_S = 5.0  # how long a launcher waits for its ranks to come to a recovery (after a store move: they follow it)
RECOVERY_BOUND_S = 20.0  # a recovery not finished by then is stuck where no bound of its own catches: group restart

# ---------------------------------------------------------------------- nodes (launch/)
INTERVAL_S = 0.5  # how often each launcher counts up its liveness key (and reads the others')
LOST_S = 5.0  # liveness silence after which a launcher, or the store, is lost (fault.node_silence_s's default)
CONFIRM_S = 1.0  # the store's silence must be seen for this long (not merely found on waking from a pause)
PROBE_S = 0.3  # how long a starting launcher waits for each later rendezvous endpoint to answer
MOVE_WAIT_S = 10.0  # how long a launcher moving down the endpoint list waits for the next store to listen
MOVE_SETTLE_S = 1.0  # after a store move, how long a launcher waits for the others to move too before a smaller world
SPARE_POLL_S = 0.02  # how often a waiting spare asks the store whether a launcher claimed it for a lost node
SPARE_ACK_S = 1.0  # a claimed spare's launcher acknowledges within this, or the claim goes to the next spare
SPARE_HOLD_S = 3.0  # beyond the silence bound: how long a spare waits for a claim once a node of the round is gone
SPARE_CONFIRM_S = 3.0  # a claim whose generation's world is not published this long after is let go
TOLD_S = 5.0  # ranks told to go on in a smaller world and not done by then: the group restarts
MEMORY_IDLE_S = 600.0  # a node's memory snapshots written this lately are never swept (a running job's)
OWNER_WAIT_S = 2.0  # a launcher connecting to a rendezvous store waits this long for its host to name its job

# ---------------------------------------------------------------------- the agent and the supervisor (launch/)
EXIT_BARRIER_S = 60.0  # torchelastic's: the nodes of a finished group wait for each other this long before exiting
SURVIVOR_GRACE_S = 5.0  # the most a failed group's survivors get to exit before SIGKILL (torchrun: 30)
AGAIN_AFTER_S = 1.0  # a second signal to the launcher this long after the first stops at once
IDLE_PATIENCE_S = 2.0  # signalled, and no rank running: how long the launcher waits for a group that may start
OUTCOME_RESERVE_S = 1.0  # the end of the grace period a preempted launcher keeps for its own outcome
STORE_ASK_S = 2.0  # how long a launcher's question to the ranks' coordination store may take
STORE_PROBE_S = 0.2  # how long a launcher's probe waits for the ranks' coordination store to accept a connection
HANG_DEFER_S = 2.0  # several nodes: a verdict on a rank that only waits is put off this long per node rank (+1)
HANG_EXIT_WAIT_S = 10.0  # a hung rank SIGKILLed alone: how long its exit may take to reach the agent
MEMORY_SWEEP_S = 10.0  # the launcher's start waits this long for its sweep of old memory snapshots (a slow file system)

# What relies on what: (the ordering, whether it holds, why it matters), checked at import.
ORDERINGS: tuple[tuple[str, bool, str], ...] = (
    ("WATCH_S + NOTICE_GRACE_S < UNAWARE_S", WATCH_S + NOTICE_GRACE_S < UNAWARE_S,
     "a survivor blocked where no error reaches it is made to leave by its peers before its launcher replaces it"),
    ("UNAWARE_S < STUCK_S", UNAWARE_S < STUCK_S,
     "on one node the launcher replaces an unaware rank well before that rank would end itself"),
    ("STUCK_S < RECOVERY_BOUND_S", STUCK_S < RECOVERY_BOUND_S,
     "a stuck rank ends itself (and is started again) before the whole group is restarted"),
    ("NODE_LOST_S < NODE_HANDLED_S", NODE_LOST_S < NODE_HANDLED_S,
     "a launcher's word that it handles its ranks' failure lengthens the wait before their node counts as lost"),
    ("NODE_LOST_S < TOLD_S", NODE_LOST_S < TOLD_S,
     "ranks told to go on in a smaller world get the time to do so before the group restarts"),
    ("4 * INTERVAL_S <= LOST_S", 4 * INTERVAL_S <= LOST_S,
     "a node is lost only after several of its liveness counts were missed, not after one late one"),
    ("INTERVAL_S < CONFIRM_S < LOST_S", INTERVAL_S < CONFIRM_S < LOST_S,
     "a launcher asking every interval never takes its own asking for a pause; confirming is part of the silence"),
    ("CHECK_EVERY_S <= BLOCK_ABOVE_S", CHECK_EVERY_S <= BLOCK_ABOVE_S,
     "a step long enough to block on the preemption agreement is at least the pipelined agreement's interval"),
)


def broken_orderings() -> list[str]:
    """The orderings of `ORDERINGS` that do not hold, each with why it matters ([] when all do)."""
    return [f"{name}: {why}" for name, holds, why in ORDERINGS if not holds]


if _broken := broken_orderings():
    raise AssertionError("common.timing: " + "; ".join(_broken))
