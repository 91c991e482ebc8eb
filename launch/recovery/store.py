"""The launcher's side of the ranks' coordination store (the rendezvous's TCP store, `COORD_STORE_ENV`):
telling the ranks that a generation failed, telling the other nodes' launchers that this one handles its
ranks' failure, asking whether another launcher said so, and publishing a smaller world. The keys and
their layout are the trainer's (trainer.recovery, through trainer.contract). Every connection is made only
to a store that listens: one to a store that is gone prints torch's C++ frames and waits seconds."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from common.net import listening_at
from common.timing import ARRIVAL_S, MOVE_SETTLE_S, STORE_ASK_S, STORE_PROBE_S
from launch import spares
from launch.liveness import goes_on
from trainer.contract import (
    COORD_STORE_ENV,
    announce_failure,
    arrived_ranks,
    coordination_store,
    failure_handled,
    publish_smaller_world,
    publish_spare,
    published_world,
    smaller_world_published,
)

log = logging.getLogger(__name__)


def listens(where: str) -> bool:
    """Whether something accepts a TCP connection at `where` (host:port)."""
    return listening_at(where, STORE_PROBE_S)


def announce(agent, generation: int, handled: bool = True) -> None:
    """`generation` starts: tell the ranks of the agent's worker group on their store, so that one whose
    collective did not fail leaves by itself (trainer.recovery's watch thread) instead of waiting to be
    killed; and, `handled`, the other nodes' launchers that this one handles its ranks' failure (its node
    lives). Best effort (the ranks that noticed say so too), on a thread: a replacement's start does not
    wait for it."""
    store_at, run_id, group = os.environ.get(COORD_STORE_ENV, ""), agent.run_id(), agent.round()

    def tell() -> None:
        if not listens(store_at):  # its host is lost
            return
        with contextlib.suppress(Exception):
            announce_failure(coordination_store(store_at, run_id, group, 5.0), generation, handled=handled)

    threading.Thread(target=tell, name="tell-the-ranks", daemon=True).start()


class StoreQuestions:
    """What the other nodes' launchers said on the ranks' store about the agent's worker group: whether one
    handles the failure before a generation (`handled`), whether they went on without this node
    (`left_behind`). Asked through one connection kept per group, and only when a TCP probe finds the store
    listening (a call to a store that is gone prints torch's C++ frames and waits), the connection made, for
    `handled`, only while `liveness` (launch.liveness) hears it answer; when it cannot be asked, each
    question has its default."""

    def __init__(self) -> None:
        self._store: tuple[tuple[str, str], Any] | None = None  # ((store, group), connection or None)

    def handled(self, agent, generation: int, liveness=None, unknown: bool = True) -> bool:
        """Whether a launcher said it handles the failure before `generation` (its node lives); `unknown` when
        it cannot be asked (True for the lost-node verdict: the coordinator's NODE_HANDLED_S then decides;
        False for following another launcher's recovery, which needs its word)."""
        return self._ask(agent, liveness, lambda store: failure_handled(store, generation), unknown)

    def left_behind(self, agent, generation: int, liveness=None) -> bool:
        """Whether the other nodes went on without this one in a smaller world of `generation` (this node was
        silent: frozen or cut off, and woke), so that its ranks cannot recover in process into it; False
        when it cannot be asked. Asked whatever `liveness` heard last: a node that wakes from a pause has an old
        last answer, and this is what it must know first."""
        return self._ask(agent, None, lambda store: smaller_world_published(store, generation), False, gated=False)

    def _ask(self, agent, liveness, question, otherwise: bool, gated: bool = True) -> bool:
        where = (os.environ.get(COORD_STORE_ENV, ""), agent.round())
        if not listens(where[0]):  # gone (its node lost): no call at all, even on a connection kept from before
            return otherwise
        try:
            if self._store is None or self._store[0] != where or (not gated and self._store[1] is None):
                if gated and (liveness is None or not liveness.answering()):
                    return otherwise
                self._store = (where, coordination_store(where[0], agent.run_id(), where[1], STORE_ASK_S))
            if self._store[1] is None:
                return otherwise
            return question(self._store[1])
        except Exception:  # noqa: BLE001 - it stopped answering: not asked again in this group (but `left_behind`)
            self._store = (where, None)
            return otherwise


MOVED_KEY = "moved/{rank}"  # under the group's prefix on a store moved to: a node whose ranks followed it


def moved_here(agent) -> None:
    """This node's launcher adopted its ranks at the store the job moved to (its previous host was lost): say
    so there, with the ranks that follow, so that a launcher sending the survivors on in a smaller world
    waits for them (`smaller_world`)."""
    local = sorted(agent.global_ranks().values())
    try:
        store = coordination_store(os.environ[COORD_STORE_ENV], agent.run_id(), agent.round(), STORE_ASK_S)
        store.set(MOVED_KEY.format(rank=local[0]), json.dumps(local))
    except Exception as e:  # noqa: BLE001 - the new store lost too: the ranks' recovery says what comes next
        log.info(f"cannot tell the store moved to that this node came ({type(e).__name__}: {e})")


def _moved_nodes(store, world: int) -> list[set[int]]:
    """The ranks of each node that said it moved here (`moved_here`)."""
    keys = [MOVED_KEY.format(rank=r) for r in range(world)]
    return [set(json.loads(store.get(key))) for key in keys if store.check([key])]


def _settled(agent, moved: list[set[int]], nodes: int, arrived: set[int]) -> bool:
    """Whether every node that moved here (`moved`, of the group's `nodes`) has its ranks at the recovery, and no
    other is on its way: all but one of the group's nodes (the lost store's host) moved, or this one moved
    MOVE_SETTLE_S ago. Always, without a move."""
    if agent.move.adopted_at is None:
        return True
    if not set().union(*moved) <= arrived:
        return False
    return len(moved) >= nodes - 1 or time.time() - agent.move.adopted_at >= MOVE_SETTLE_S


def _outvoted(agent, moved: list[set[int]], nodes: int, last_endpoint: bool) -> str:
    """After a store move, why the nodes that moved here must not go on alone ('' when they may): they are not
    a majority of the group (exactly half at the last endpoint), so the others may be training elsewhere (a
    partition that cut these nodes off from the store, not its host's loss). Without a move, ''."""
    if agent.move.adopted_at is None or goes_on(len(moved), nodes, last_endpoint):
        return ""
    return f"only {len(moved)} of the group's {nodes} node(s) moved to this store: not a majority (a partition?)"


def smaller_world(agent, generation: int, min_nodes: int, waited_s: float,
                  last_endpoint: bool = True) -> tuple[list[int], str, str] | None:
    """Every rank here waits for ranks of a lost node: have a spare start them in its place (`_with_spare`), or
    send the survivors on in a smaller world of `generation`, on every node at once. The first launcher to
    publish its world (a spare's claim, or the ranks that came to the recovery, in order) sets it for all
    (trainer.recovery.regroup.publish_spare, publish_smaller_world); the others find it published and take it.
    Renumbers the agent's group for a smaller world. Returns (the lost ranks, why not: '' when this node goes on
    in that world, the spare's node: '' without one), or None to be asked again, `waited_s` after the recovery
    began (less than ARRIVAL_S): the ranks here have not all come to it yet, or, after a store move, those of the
    nodes that moved too (`_settled`). After a move the nodes that moved go on only as a majority (`_outvoted`)."""
    local, world = set(agent.global_ranks().values()), agent.world_size()
    store = coordination_store(os.environ[COORD_STORE_ENV], agent.run_id(), agent.round(), 30.0)
    arrived = set(arrived_ranks(store, generation, world))
    decided = published_world(store, generation)
    if decided is None:
        nodes = agent.meeting.nodes_of(arrived)
        lost = sorted(set(range(world)) - arrived)
        moved = _moved_nodes(store, world) if agent.move.adopted_at is not None else []
        group_nodes = len(agent.meeting.ranks) or agent.group()[2]
        moved_short = agent.move.adopted_at is not None and min_nodes > (nodes or 1)  # the others may come yet
        if not local <= arrived or not _settled(agent, moved, group_nodes, arrived) or moved_short:
            if waited_s < ARRIVAL_S:
                return None
            if not local <= arrived:
                return lost, f"rank(s) {sorted(local - arrived)} here did not come to the recovery", ""
        decided = _with_spare(agent, store, generation, lost) if agent.move.adopted_at is None else None
        if decided is None and (why := _cannot_go_on(agent, moved, group_nodes, min_nodes, nodes, last_endpoint)):
            return lost, why, ""
    ranks = publish_smaller_world(store, generation, sorted(arrived)) if "spare" not in (decided or {}) else {}
    if not ranks:  # a spare takes the lost node's place (claimed here or by another launcher)
        spare = (decided if decided and "spare" in decided else published_world(store, generation))["spare"]
        return spare["ranks"], "", spare["spare"]
    lost = sorted(set(range(world)) - set(ranks))
    if not local <= set(ranks):
        return lost, "the other nodes went on without this node's ranks (they came to the recovery too late)", ""
    agent.renumber(ranks)
    return lost, "", ""


def _cannot_go_on(agent, moved: list[set[int]], group_nodes: int, min_nodes: int, nodes: int | None,
                  last_endpoint: bool) -> str:
    """Why the survivors (on `nodes` nodes) cannot go on in a smaller world ('' when they can)."""
    if min_nodes > (nodes or 1):
        return f"--nnodes needs {min_nodes} nodes at least; {nodes or 'fewer'} are left"
    if outvoted := _outvoted(agent, moved, group_nodes, last_endpoint):
        return outvoted
    return "a node is waiting to join" if agent.nodes_waiting() else ""


def _with_spare(agent, store, generation: int, lost: list[int]) -> dict | None:
    """A registered spare claimed for the lost ranks (exactly one node's) and published as `generation`'s world;
    returns what stands then (another launcher's world, maybe), or None: no spare answered, or the lost ranks
    are not one node's."""
    place = agent.place_of(lost)
    if place is None:
        return None
    claim = spares.claim(os.environ[COORD_STORE_ENV], agent.run_id(), {**place, "generation": generation})
    if claim is None:
        return None
    stood = publish_spare(store, generation, claim)
    if stood.get("spare", {}).get("index") != claim["index"]:
        spares.release(os.environ[COORD_STORE_ENV], agent.run_id(), claim)
    return stood
