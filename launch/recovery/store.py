"""The launcher's side of the ranks' coordination store (the rendezvous's TCP store, `COORD_STORE_ENV`):
telling the ranks that a generation failed, telling the other nodes' launchers that this one handles its
ranks' failure, asking whether another launcher said so, and publishing a smaller world. The keys and
their layout are the trainer's (trainer.recovery, through trainer.contract). Every connection is made only
to a store that listens: one to a store that is gone prints torch's C++ frames and waits seconds."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from common.net import listening
from common.timing import STORE_ASK_S, STORE_PROBE_S
from trainer.contract import (
    COORD_STORE_ENV,
    announce_failure,
    arrived_ranks,
    coordination_store,
    failure_handled,
    publish_smaller_world,
    smaller_world_published,
)


def listens(where: str) -> bool:
    """Whether something accepts a TCP connection at `where` (host:port)."""
    host, _, port = where.rpartition(":")
    try:
        return listening(host.strip("[]"), int(port), STORE_PROBE_S)
    except ValueError:
        return False


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

    def handled(self, agent, generation: int, liveness=None) -> bool:
        """Whether a launcher said it handles the failure before `generation` (its node lives); True when it
        cannot be asked (the coordinator's NODE_HANDLED_S then decides)."""
        return self._ask(agent, liveness, lambda store: failure_handled(store, generation), True)

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


def smaller_world(agent, generation: int, min_nodes: int) -> tuple[list[int], str]:
    """The survivors of a lost node are all here: publish the smaller world they go on in (their new ranks)
    and renumber the agent's group. Returns (the lost ranks, why not: '' when published)."""
    local, world = agent.global_ranks(), agent.world_size()
    store = coordination_store(os.environ[COORD_STORE_ENV], agent.run_id(), agent.round(), 30.0)
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
