"""In-process recovery, the launcher's side (fault.in_process; the ranks' side is trainer.recover).

When ranks of a running group fail, the agent (launch.agent) asks before torchelastic stops the group.
This module answers: start only the failed ranks again, in the next generation (the survivors keep
their processes and re-form the groups with them), or let the whole group restart, and why:
- a second failure while a recovery is still under way (a survivor that could not re-form or restore
  exits, and so does a replacement that failed): the whole group restarts;
- a preemption, a storage fault or bad input: the restart policy's usual path;
- one node alone whose every rank failed: nobody is left to recover with.
Under --nnodes MIN:MAX a node whose every rank waits for ranks of other nodes whose launcher said nothing
(NODE_LOST_S) tells its survivors to go on without them, in a smaller world (`smaller_world`), when they
are all here; otherwise the group restarts (a rendezvous forms the smaller world).
It keeps the pending recovery until every rank of this node has finished a step in the new generation,
then gives the ledger its `resume` event with the split."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from launch.failures import Failure
from trainer.contract import (
    COORD_STORE_ENV,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
    GENERATION_ENV,
    announce_failure,
    arrived_ranks,
    coordination_store,
    failure_handled,
    is_alive,
    publish_smaller_world,
)

log = logging.getLogger(__name__)

# Every rank of this node recovering this long, with nobody to wait for but ranks of other nodes, and no
# word from their launcher: their node is lost. A live node's launcher sees its rank's exit within a monitor
# interval (25 ms) and says at once that it handles it (`handled`: it restarts its group, several nodes), then
# comes to the rendezvous to meet again (about 0.9 s here), where this node's launcher finds it and restarts
# with it instead of going on without it; it waits NODE_HANDLED_S for that.
NODE_LOST_S = 0.4
NODE_HANDLED_S = 5.0

# A survivor notices a lost peer within milliseconds (its collective fails, or a peer that noticed shuts its
# connections). One still training in the failed generation this long after is blocked where no error
# reaches it (gloo: a receive whose peer's close is queued behind unread data): it is replaced as well.
UNAWARE_S = 2.0

# A recovery takes about half a second here (a few on a slow machine, or with a cold replacement); one
# not finished by then is stuck somewhere no bound of its own catches: the whole group restarts.
RECOVERY_BOUND_S = 20.0


@dataclass
class Pending:
    """A recovery under way: generation, when its failure was noticed, the ranks replaced, the survivors
    on this node (local rank -> pid)."""

    generation: int
    noticed: float
    replaced: list[int]
    kept: dict[int, int] = field(default_factory=dict)
    cause: str = ""
    dead_pids: frozenset[int] = frozenset()  # the failed ranks' trainer pids (their heartbeats are stale)
    lost: list[int] = field(default_factory=list)  # the ranks of a lost node (the world got smaller)
    unaware: set[int] = field(default_factory=set)  # survivors killed for never noticing the failure (UNAWARE_S)


@dataclass
class InProcessRecovery:
    enabled: bool
    single_node: bool
    smaller: bool = False  # --nnodes MIN:MAX: the survivors of a lost node go on in process, in a smaller world
    generation: int = 0  # the newest generation this node's ranks were asked to join
    pending: Pending | None = None
    hang: Failure | None = None  # a hung rank this launcher killed, to be replaced as its failure
    hang_killed_at: float = 0.0
    silent_since: float | None = None  # the launcher told the ranks of nodes silent since then (launch.nodes)
    _store: tuple[tuple[str, str], Any] | None = field(default=None, repr=False)  # `handled`'s connection

    def reset(self) -> None:
        """A full restart: the new group starts at generation 0."""
        self.generation, self.pending, self.hang, self.silent_since = 0, None, None, None

    def offer(self, exits: dict, beats: dict[int, dict], failure: Failure, running: dict[int, int],
              agent=None) -> tuple[dict[str, str] | None, str]:
        """(environment for the replacements, '') to recover in process; (None, why not) otherwise (why
        is '' when the usual path is simply the right one). With several nodes and the `agent`, the other
        nodes' launchers hear that this one handles the failure (it restarts its group)."""
        generation = self.next_generation(beats)
        if not self.enabled:
            self.restarting(beats, agent)  # several nodes: the group restarts; the other nodes wait for it
            return None, ""
        if self.pending is not None:
            return None, (f"a second failure (rank {failure.rank}) during the in-process recovery of generation "
                          f"{self.pending.generation}")
        if failure.exit_code in (EXIT_USAGE, EXIT_PREEMPTED, EXIT_STORAGE) or failure.cause in ("preemption",
                                                                                                "storage"):
            return None, ""
        failed_local = {e.local_rank for e in exits.values()}
        kept = {lr: pid for lr, pid in running.items() if lr not in failed_local}
        if self.single_node and not kept:
            return None, "every rank failed: nobody is left to recover with"
        self.generation = generation
        dead = frozenset(beats[r]["pid"] for r in exits if r in beats)
        self.pending = Pending(self.generation, time.time(), sorted(exits), kept, failure.cause, dead)
        return {GENERATION_ENV: str(self.generation)}, ""

    def next_generation(self, beats: dict[int, dict]) -> int:
        """The generation a recovery from now starts: one past the newest this node's ranks or this launcher knew."""
        return max([self.generation, *(b.get("generation", 0) for b in beats.values())]) + 1

    def restarting(self, beats: dict[int, dict], agent=None) -> None:
        """Several nodes (`smaller`): this launcher restarts its group for a failure of its own ranks (a crash, a
        hang its watchdog found); the other nodes' launchers hear it (`announce_handled`) and wait for the group
        at the rendezvous, instead of going on without this node after NODE_LOST_S and restarting again."""
        if self.smaller and agent is not None:
            announce_handled(agent, self.next_generation(beats))

    def unaware_ranks(self, beats: dict[int, dict], now: float) -> tuple[dict[int, int], tuple[int, str] | None]:
        """(rank -> pid, None) of the survivors here still training in the failed generation UNAWARE_S after
        the failure was noticed: the caller kills them, and they are replaced in the same generation (each
        is reported once). ({}, (the rank it replaced, why)) when none of a single node's survivors noticed:
        with no survivor to take its settings from, the recovery cannot go on (it is dropped)."""
        p = self.pending
        if p is None or p.lost or now - p.noticed < UNAWARE_S:
            return {}, None
        kept = set(p.kept.values())
        found = {rank: b["pid"] for rank, b in beats.items()
                 if b.get("pid") in kept and rank not in p.unaware and b.get("phase") != "recover"
                 and b.get("generation", 0) < p.generation and b.get("recovering", 0) < p.generation}
        if found and self.single_node and set(found.values()) == kept:
            self.pending = None
            return {}, (p.replaced[0], f"no rank noticed the failure of generation {p.generation - 1} within "
                                       f"{UNAWARE_S:.0f}s")
        p.unaware |= set(found)
        p.dead_pids = p.dead_pids | set(found.values())  # the watchdog does not judge them meanwhile
        return found, None

    def replace_unaware(self, exits: dict, beats: dict[int, dict]) -> dict[str, str] | None:
        """When the ranks that exited are survivors killed for never noticing the failure: the environment
        that starts them again in the same generation, as replacements (the others wait for them)."""
        p = self.pending
        if p is None or not exits or not set(exits) <= p.unaware:
            return None
        p.replaced = sorted({*p.replaced, *exits})
        p.kept = {lr: pid for lr, pid in p.kept.items() if lr not in {e.local_rank for e in exits.values()}}
        p.dead_pids = p.dead_pids | {beats[r]["pid"] for r in exits if r in beats}
        return {GENERATION_ENV: str(p.generation)}

    def lost_node(self, beats: dict[int, dict], agent, now: float, liveness=None) -> tuple[int, float] | None:
        """(generation, when the first rank noticed, or when the lost nodes were last heard if the launcher
        told the ranks) once every rank of this node (the `agent`'s) has been recovering for NODE_LOST_S, or
        NODE_HANDLED_S when the lost ranks' launcher said it handles their failure (`handled`), with no
        failure of this node's under way; else None."""
        local = sorted(agent.global_ranks().values())
        if not self.smaller or self.pending is not None or not local:
            return None
        waiting = [beats.get(rank, {}) for rank in local]
        if not all(b.get("phase") == "recover" and b.get("recovering") for b in waiting):
            return None
        noticed, generation = min(b.get("t_error") or now for b in waiting), max(b["recovering"] for b in waiting)
        waited = now - noticed
        if waited < NODE_LOST_S or (waited < NODE_HANDLED_S and self.handled(agent, generation, liveness)):
            return None
        return generation, min(noticed, self.silent_since or noticed)

    def handled(self, agent, generation: int, liveness=None) -> bool:
        """Whether a launcher said it handles the failure before `generation` of the agent's worker group
        (`announce_failure`), asked on the ranks' store (the rendezvous's) through one connection kept for the
        group, made only while `liveness` (launch.liveness) hears the store answer: a connection to a store
        that is gone prints torch's C++ frames. True when it cannot be asked (NODE_HANDLED_S then decides)."""
        where = (os.environ.get(COORD_STORE_ENV, ""), agent.round())
        if self._store is None or self._store[0] != where:
            if liveness is None or not liveness.answering():
                return True
            self._store = (where, coordination_store(where[0], agent.run_id(), where[1], 2.0)
                           if listens(where[0]) else None)
        if self._store[1] is None:
            return True
        try:
            return failure_handled(self._store[1], generation)
        except Exception:  # noqa: BLE001 - it stopped answering: not asked again in this group
            self._store = (where, None)
            return True

    def go_smaller(self, generation: int, noticed: float, kept: dict[int, int], lost: list[int]) -> Pending:
        """The survivors here go on without the lost ranks in `generation`: the recovery under way."""
        self.generation, self.silent_since = generation, None
        self.pending = Pending(generation, noticed, [], kept, "node", frozenset(), lost)
        return self.pending

    def smaller_world(self, agent, generation: int, min_nodes: int, store_at: str) -> tuple[list[int], str]:
        """The survivors of a lost node are all here: publish the smaller world they go on in (their new
        ranks, on the ranks' coordination store at `store_at`) and renumber the agent's group. Returns
        (the lost ranks, why not: '' when published)."""
        local, world = agent.global_ranks(), agent.world_size()
        store = coordination_store(store_at, agent.run_id(), agent.round(), 30.0)
        arrived = arrived_ranks(store, generation, world)
        lost = sorted(set(range(world)) - set(arrived))
        if set(arrived) != set(local.values()):
            return lost, f"ranks {sorted(set(arrived) - set(local.values()))} of other nodes survive too"
        if min_nodes > 1:
            return lost, f"--nnodes needs {min_nodes} nodes at least; this one is left alone"
        if agent.nodes_waiting():
            return lost, "a node is waiting to join"
        agent.renumber(publish_smaller_world(store, generation, arrived))
        return lost, ""

    def unjudged_pids(self) -> frozenset[int]:
        """Pids the watchdog must not judge while a recovery is under way: its failed ranks, and its survivors,
        which wait for the replacement (UNAWARE_S and RECOVERY_BOUND_S bound them). A survivor of a hung
        rank has not finished a step for as long as the hung one: judged too, it turned the recovery of a
        SIGSTOPped rank into a full restart whenever its verdict came before its own notice."""
        p = self.pending
        return p.dead_pids | frozenset(p.kept.values()) if p is not None else frozenset()

    def overdue(self, now: float) -> tuple[int, str] | None:
        """(the rank it replaced, why) once the pending recovery has taken longer than RECOVERY_BOUND_S (it is
        dropped)."""
        p = self.pending
        if p is None or now - p.noticed <= RECOVERY_BOUND_S:
            return None
        self.pending = None
        return p.replaced[0], f"the in-process recovery of generation {p.generation} did not finish within " \
                              f"{RECOVERY_BOUND_S:.0f}s"

    def current(self, beats: dict[int, dict]) -> dict[int, dict]:
        """The beats of the current generation (older ones are of ranks not yet re-formed)."""
        return {r: b for r, b in beats.items() if b.get("generation", 0) >= self.generation}

    def settle(self, beats: dict[int, dict]) -> Pending | None:
        """The pending recovery once every rank of this node has finished a step in its generation."""
        p = self.pending
        if p is None:
            return None
        ready = [b for b in beats.values() if b.get("generation", 0) >= p.generation and b.get("t_first")]
        if len(ready) < len(beats) or not beats:
            return None
        self.pending = None
        return p


def print_stacks(beats: dict[int, dict], why: str) -> None:
    """Have these ranks print their stacks (SIGUSR1: trainer.runtime.fault.stacks_on_sigusr1) before they
    are killed: where the ones a recovery waited for in vain, or a preemption's grace period, were stuck. Ranks
    that have exited (a rank that committed, say) are left out."""
    beats = {rank: beat for rank, beat in beats.items() if is_alive(beat["pid"])}
    for rank, beat in sorted(beats.items()):
        log.info(f"rank {rank} (pid {beat['pid']}, {beat.get('phase')}) {why}: its stacks")
        with contextlib.suppress(OSError):
            os.kill(beat["pid"], signal.SIGUSR1)
    time.sleep(0.5 if beats else 0.0)


def listens(where: str, timeout_s: float = 0.2) -> bool:
    """Whether something accepts a TCP connection at `where` (host:port) within `timeout_s`."""
    host, _, port = where.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def tell_the_ranks(store_at: str, run_id: str, group: str, generation: int, handled: bool = False) -> None:
    """A rank died and `generation` starts: tell the ranks of the worker group (`group`: its rendezvous
    round, SupervisedAgent.round) on their coordination store, so that one whose collective did not fail
    leaves by itself (trainer.distributed.regroup's watch thread) instead of waiting for UNAWARE_S; and,
    `handled`, the other nodes' launchers that this one handles its ranks' failure (its node lives). Best
    effort (the ranks that noticed say so too), on a thread: the replacement's start does not wait for it."""
    def tell() -> None:
        if not listens(store_at):  # its host is lost: a connection would print torch's C++ frames (and wait 5 s)
            return
        with contextlib.suppress(Exception):
            announce_failure(coordination_store(store_at, run_id, group, 5.0), generation, handled=handled)

    threading.Thread(target=tell, name="tell-the-ranks", daemon=True).start()


def announce_handled(agent, generation: int) -> None:
    """Ranks here failed, and this launcher replaces them in `generation` or restarts its group: `tell_the_ranks`,
    and the other nodes' launchers that this node lives (`InProcessRecovery.lost_node`)."""
    tell_the_ranks(os.environ.get(COORD_STORE_ENV, ""), agent.run_id(), agent.round(), generation, handled=True)
