"""The launcher's side of the ranks' coordination store (launch.recovery.store), on a real TCP store: hearing
that another launcher handles its ranks' failure, and telling the ranks, with no connection tried where
nothing listens (one would print torch's C++ frames and wait seconds); survivors on several nodes agreeing
on one smaller world, before and after a store move."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

from common.clock import wait_until
from common.timing import ARRIVAL_S, MOVE_SETTLE_S, SPARE_ACK_S
from launch.agent_hooks import Move
from launch.liveness import Liveness
from launch.recovery.store import StoreQuestions, announce, moved_here, smaller_world
from launch.rounds import Round
from launch.spares import SpareDoor
from tests.fixtures import free_port
from trainer.contract import (
    COORD_STORE_ENV,
    announce_failure,
    arrived_key,
    coordination_store,
    failure_handled,
    publish_smaller_world,
    tcp_store_server,
)


class Agent:
    """The part of launch.agent.SupervisedAgent that the store helpers ask."""

    def round(self) -> str:
        return "r1"

    def run_id(self) -> str:
        return "job"


@pytest.fixture
def store_at(monkeypatch):
    server = tcp_store_server("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    where = f"127.0.0.1:{server.port}"
    monkeypatch.setenv(COORD_STORE_ENV, where)
    yield where
    del server


def test_a_launcher_hears_that_another_handles_its_ranks_failure_or_went_on_without_it(store_at, monkeypatch, capfd):
    liveness = Liveness(store_at, "node-a").start()  # asked only while the store answers
    try:
        assert wait_until(liveness.answering, 10.0, 0.05), "the store never answered"
        asks = StoreQuestions()
        handled = asks.handled
        store = coordination_store(store_at, "job", "r1", 5.0)
        assert not handled(Agent(), 3, liveness)
        announce_failure(store, 3, by="0")  # the ranks that noticed say so: not their launcher
        assert not handled(Agent(), 3, liveness)
        announce_failure(store, 2, handled=True)
        assert not handled(Agent(), 3, liveness)  # another generation's announcement
        announce_failure(store, 3, handled=True)
        # (a set is sent without an answer: another connection may see it a moment later, on a busy machine)
        assert wait_until(lambda: handled(Agent(), 3, liveness), 5.0, 0.05)
        assert not asks.left_behind(Agent(), 3, liveness)
        publish_smaller_world(store, 3, [0, 1])
        assert wait_until(lambda: asks.left_behind(Agent(), 3, liveness), 5.0, 0.05)
        assert not asks.left_behind(Agent(), 4, liveness)
        assert StoreQuestions().handled(Agent(), 3, None)  # no liveness: not asked (the coordinator's bound decides)
        assert StoreQuestions().left_behind(Agent(), 3, None)  # asked whatever liveness heard (a node waking)
        monkeypatch.setenv(COORD_STORE_ENV, f"127.0.0.1:{free_port()}")  # nobody listens there
        assert StoreQuestions().handled(Agent(), 4, liveness) and not StoreQuestions().left_behind(Agent(), 4, liveness)
        assert "frame #" not in capfd.readouterr().err  # no connection was tried where nothing listens
    finally:
        liveness.stop()


def test_telling_the_ranks_reaches_a_live_store_and_tries_no_connection_to_a_gone_one(store_at, monkeypatch, capfd):
    def told() -> bool:
        return not any(t.name == "tell-the-ranks" for t in threading.enumerate())

    announce(Agent(), 4, handled=True)
    assert wait_until(told, 10.0, 0.02), "the announcement did not end"
    assert failure_handled(coordination_store(store_at, "job", "r1", 5.0), 4)
    monkeypatch.setenv(COORD_STORE_ENV, f"127.0.0.1:{free_port()}")  # its host is gone
    announce(Agent(), 5, handled=True)
    assert wait_until(told, 2.0, 0.02), "an announcement to a gone store waited"
    assert "frame #" not in capfd.readouterr().err


def test_a_store_gone_after_its_connection_was_made_is_not_called_again(monkeypatch, capfd):
    """The connection kept from before its host was lost is not used: a call would print torch's C++ frames
    (the failure that follows a lost store host) and wait; each question answers its default at once."""
    server = tcp_store_server("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv(COORD_STORE_ENV, f"127.0.0.1:{server.port}")
    liveness = Liveness(f"127.0.0.1:{server.port}", "node-a").start()
    try:
        assert wait_until(liveness.answering, 10.0, 0.05), "the store never answered"
        asks = StoreQuestions()
        assert not asks.handled(Agent(), 1, liveness) and not asks.left_behind(Agent(), 1, liveness)  # connected
        liveness.stop()
        del server  # the host is gone
        started = time.monotonic()
        assert asks.handled(Agent(), 1, None) and not asks.left_behind(Agent(), 1, None)
        assert time.monotonic() - started < 2.0
        assert "frame #" not in capfd.readouterr().err
    finally:
        liveness.stop()


class Node:
    """A node's agent as `smaller_world` asks it: its global ranks in a group of `nodes` nodes of two ranks each,
    its rendezvous round's view of which node holds which ranks, and whether it adopted its ranks at a store the
    job moved to (`moved`: when)."""

    def __init__(self, index: int, nodes: int, moved: float | None = None) -> None:
        self.ranks = {0: 2 * index, 1: 2 * index + 1}
        self.meeting = Round("r1", frozenset(range(nodes)), {n: frozenset({2 * n, 2 * n + 1}) for n in range(nodes)})
        self.move = Move(adopted_at=moved)
        self.nodes, self.renumbered = nodes, None

    def global_ranks(self) -> dict[int, int]:
        return self.ranks

    def world_size(self) -> int:
        return 2 * self.nodes

    def round(self) -> str:
        return "r1"

    def run_id(self) -> str:
        return "job"

    def group(self) -> tuple[str, int, int]:
        return "r1", self.ranks[0] // 2, self.nodes

    def nodes_waiting(self) -> int:
        return 0

    def renumber(self, ranks: dict[int, int]) -> None:
        self.renumbered = ranks

    def place_of(self, lost: list[int]) -> dict | None:
        if frozenset(lost) not in self.meeting.ranks.values():
            return None
        return {"round": "r1", "ranks": sorted(lost), "group_rank": min(lost) // 2, "group_world_size": self.nodes,
                "world": 2 * self.nodes, "nproc": 2, "master_addr": "127.0.0.1", "master_port": 1}


def test_survivors_on_two_nodes_go_on_in_one_smaller_world_once_the_ranks_here_came(store_at):
    """Three nodes of two ranks, node 0 lost: node 1's launcher waits for its own ranks (None: asked again),
    then publishes the world of the ranks that came; node 2's takes that world, even when it would have
    counted otherwise; a node whose ranks are not in it is told why."""
    store = coordination_store(store_at, "job", "r1", 5.0)
    b, c = Node(1, 3), Node(2, 3)
    for rank in (2, 4, 5):
        store.set(arrived_key(1, rank), "{}")
    assert smaller_world(b, 1, 2, waited_s=0.1) is None  # rank 3 here is on its way
    assert smaller_world(b, 1, 2, waited_s=ARRIVAL_S) == (
        [0, 1, 3], "rank(s) [3] here did not come to the recovery", "")
    store.set(arrived_key(1, 3), "{}")
    assert smaller_world(b, 1, 2, waited_s=0.2) == ([0, 1], "", "")
    assert b.renumbered == {2: 0, 3: 1, 4: 2, 5: 3}
    store.set(arrived_key(1, 1), "{}")  # a late survivor of node 0: the world stands as published
    assert smaller_world(c, 1, 2, waited_s=0.2) == ([0, 1], "", "") and c.renumbered == b.renumbered
    late = Node(0, 3)
    assert smaller_world(late, 1, 1, waited_s=0.2)[1].startswith("the other nodes went on without this node")


def test_after_a_store_move_the_smaller_world_waits_for_the_nodes_that_moved(store_at):
    """Node 0 hosted the lost store; nodes 1 and 2 moved here. Node 1's launcher does not publish before node
    2's ranks came (its node said it moved), nor, with a node of four still unheard of, before MOVE_SETTLE_S."""
    store = coordination_store(store_at, "job", "r1", 5.0)
    b, c = Node(1, 3, moved=time.time()), Node(2, 3, moved=time.time())
    moved_here(b)
    moved_here(c)
    for rank in (2, 3, 4):
        store.set(arrived_key(1, rank), "{}")
    assert smaller_world(b, 1, 1, waited_s=0.5) is None  # rank 5 of node 2 is on its way
    store.set(arrived_key(1, 5), "{}")
    assert smaller_world(b, 1, 1, waited_s=0.5) == ([0, 1], "", "")  # every node but the lost host is here


def test_after_a_store_move_a_node_alone_waits_for_the_others_before_going_on(store_at):
    """A group of four, node 1 alone at the store moved to so far: the others may be on their way, so its
    launcher waits MOVE_SETTLE_S after its move; then, one of four, it does not go on (the others may be
    training at the old store: a partition). Two of four may at the last endpoint of the list."""
    store = coordination_store(store_at, "job", "r1", 5.0)
    b = Node(1, 4, moved=time.time())
    moved_here(b)
    for rank in (2, 3):
        store.set(arrived_key(1, rank), "{}")
    assert smaller_world(b, 1, 1, waited_s=0.5) is None
    b.move = Move(adopted_at=time.time() - MOVE_SETTLE_S)
    assert smaller_world(b, 1, 1, waited_s=0.5, last_endpoint=False)[1] == (
        "only 1 of the group's 4 node(s) moved to this store: not a majority (a partition?)")
    c = Node(2, 4, moved=time.time() - MOVE_SETTLE_S)
    moved_here(c)
    for rank in (2, 3, 4, 5):
        store.set(arrived_key(2, rank), "{}")
    assert smaller_world(c, 2, 1, waited_s=0.5, last_endpoint=True) == ([0, 1, 6, 7], "", "")  # half, at the last


def said_gone(store_at: str, index: int) -> None:
    """Wait until the spare `index` said it left (`SpareDoor.leave` says so on a thread of its own: one still
    connecting when the test's store goes away would stall the next test in a C++ connect for seconds)."""
    spares = coordination_store(store_at, "job", "spares", 5.0)
    assert wait_until(lambda: spares.check([f"{index}/gone"]), 5.0, 0.02), f"spare {index} never said it left"


def test_a_spare_claimed_for_a_lost_node_starts_its_ranks_and_the_other_survivors_follow(store_at):
    """Three nodes of two ranks and a registered spare, node 0 lost: node 1's launcher claims the spare, which
    sees its claim stand (the world published for generation 1 names it) and gets node 0's place: its ranks,
    group rank and the world size. Node 2's launcher takes that answer and renumbers nothing. A second lost node
    finds the spare gone (it joined): a smaller world."""
    store = coordination_store(store_at, "job", "r1", 5.0)
    door = SpareDoor(store_at, "job", "spare-1", 2)
    door.open()
    try:
        b, c = Node(1, 3), Node(2, 3)
        for rank in (2, 3, 4, 5):
            store.set(arrived_key(1, rank), "{}")
        assert smaller_world(b, 1, 1, waited_s=0.2) == ([0, 1], "", "spare-1")
        assert smaller_world(c, 1, 1, waited_s=0.2) == ([0, 1], "", "spare-1")
        assert b.renumbered is None and c.renumbered is None  # the world keeps its size
        assert door.wait(5.0), "the spare never saw its claim stand"
        claim = door.take()
        said_gone(store_at, door.index)
        assert (claim["generation"], claim["ranks"], claim["group_rank"], claim["world"]) == (1, [0, 1], 0, 6)
        assert not door.claimed() and door.take() is None  # once
        for rank in (2, 3):
            store.set(arrived_key(2, rank), "{}")
        assert smaller_world(b, 2, 1, waited_s=0.2) == ([0, 1, 4, 5], "", "")  # node 2 lost too: no spare left
    finally:
        door.close()


def test_a_spare_whose_launcher_does_not_answer_is_passed_over_for_a_smaller_world(store_at):
    """A spare registered but gone without a word (its launcher killed): the claim waits SPARE_ACK_S for its
    answer, marks it gone, and the survivors go on in a smaller world."""
    spares = coordination_store(store_at, "job", "spares", 5.0)
    spares.add("count", 1)
    spares.set("0", json.dumps({"node": "dead", "nproc": 2}))
    store = coordination_store(store_at, "job", "r1", 5.0)
    b = Node(1, 2)
    for rank in (2, 3):
        store.set(arrived_key(1, rank), "{}")
    started = time.monotonic()
    assert smaller_world(b, 1, 1, waited_s=0.2) == ([0, 1], "", "")
    assert SPARE_ACK_S <= time.monotonic() - started < SPARE_ACK_S + 2.0
    assert spares.check(["0/gone"]) and spares.get("0/claim") == b""


def test_a_spare_that_joined_through_a_rendezvous_is_not_claimed_until_it_waits_again(store_at):
    """A registered spare that met the others in a new round (`leave`) is passed over at once: the survivors
    go on in a smaller world instead of waiting for ranks that never come. Waiting as a spare again, it
    registers afresh (a new index) and is claimed."""
    store = coordination_store(store_at, "job", "r1", 5.0)
    door = SpareDoor(store_at, "job", "spare-1", 2)
    door.open()
    try:
        first = door.index
        door.leave()
        said_gone(store_at, first)
        assert not door.is_open
        b = Node(1, 2)
        for rank in (2, 3):
            store.set(arrived_key(1, rank), "{}")
        started = time.monotonic()
        assert smaller_world(b, 1, 1, waited_s=0.2) == ([0, 1], "", "")
        assert time.monotonic() - started < SPARE_ACK_S  # not asked: no wait for an answer
        door.open()
        assert door.is_open and door.index == first + 1
        for rank in (2, 3):
            store.set(arrived_key(2, rank), "{}")
        assert smaller_world(b, 2, 1, waited_s=0.2) == ([0, 1], "", "spare-1")
        assert door.wait(5.0) and door.take()["generation"] == 2
        said_gone(store_at, door.index)
    finally:
        door.close()
