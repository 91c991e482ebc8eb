"""launch.rounds: the reading of torch's rendezvous state, on real c10d rendezvous handlers (one per node, in
this process) around a real TCPStore on loopback: the round every node of a worker group agrees on (the
ranks name their coordination store after it), and a node waiting to meet again told apart from a new
one (one of the round's own nodes restarted the group: a failure, nothing to drain for; a new node: a
membership change)."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from launch import rendezvous
from launch.agent import SupervisedAgent
from launch.rounds import Round, nodes_that_left, round_of
from tests.helpers import wait_for
from trainer.runtime.protocol import COORD_STORE_ENV


def test_a_node_of_the_round_meeting_again_is_a_failure_there_and_a_new_node_a_membership_change(monkeypatch):
    monkeypatch.setenv(COORD_STORE_ENV, "")  # rendezvous.handler sets it for the ranks
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the launcher has it (rendezvous.worker_spec)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = rendezvous.settings(2, 3, {"last_call_timeout": "1", "join_timeout": "30"})
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "rounds", 2, 3, **conf)
    a, b, c = (rendezvous.handler(params)[0] for _ in range(3))  # a hosts the store
    group = SimpleNamespace(master_addr="127.0.0.1", master_port=0)
    with ThreadPoolExecutor(3) as pool:
        try:
            met = [pool.submit(h.next_rendezvous) for h in (a, b)]
            [f.result(timeout=30) for f in met]
            (name_a, nodes), (name_b, _) = round_of(a, group), round_of(b, group)
            assert name_a == name_b == "r0" and len(nodes) == 2

            joining = pool.submit(c.next_rendezvous)  # a new node: it waits for the next round
            wait_for("new node in the wait list", lambda: a.num_nodes_waiting() == 1, 20, every=0.05)
            assert nodes_that_left(a, nodes) == []  # a membership change: the ranks are drained

            again = pool.submit(b.next_rendezvous)  # b's launcher restarted the group: its ranks are gone
            wait_for("b in the wait list", lambda: a.num_nodes_waiting() == 2, 20, every=0.05)
            (b_node,) = nodes - {a._this_node}
            assert nodes_that_left(a, nodes) == [f"{b_node.addr}:{b_node.pid}"]

            rejoined = pool.submit(a.next_rendezvous)  # a follows: the next round has all three
            [f.result(timeout=30) for f in (joining, again, rejoined)]
            assert {round_of(h, group)[0] for h in (a, b, c)} == {"r1"}
            assert nodes_that_left(a, round_of(a, group)[1]) == []
        finally:
            for h in (c, b, a):
                h.shutdown()


def test_a_round_renumbered_for_a_smaller_world_keeps_only_the_nodes_that_hold_ranks():
    met = Round("r2", frozenset("abc"), {"a": frozenset({0, 1}), "b": frozenset({2, 3}), "c": frozenset({4, 5})})
    assert met.nodes_of([1, 4]) == 2 and Round().nodes_of([0]) is None
    smaller = met.renumbered({2: 0, 3: 1, 4: 2, 5: 3}, this_node="b")  # node a lost
    assert smaller.nodes == frozenset("bc") and smaller.ranks == {"b": frozenset({0, 1}), "c": frozenset({2, 3})}
    assert Round("r2", frozenset("ab")).renumbered({0: 0}, this_node="a").nodes == frozenset("a")  # unknown: this one
    assert met.moved("r2@1").name == "r2@1" and met.moved("r2@1").ranks == met.ranks


class Door:
    """launch.spares.SpareDoor as the join loop asks it: open, and claimed once `claim` is set."""

    def __init__(self, hold_s: float = 60.0) -> None:
        self.claim, self.is_open, self.hold_s, self.held = None, True, hold_s, False

    def open(self) -> None:
        pass

    def claimed(self) -> bool:
        return self.claim is not None

    def standing(self) -> dict | None:
        return self.claim

    def wait(self, timeout_s: float) -> bool:
        return self.claimed()

    def hold(self) -> bool:
        self.held = True
        return True

    def unhold(self) -> None:
        self.held = False


def test_a_claimed_spare_takes_the_lost_nodes_seat_a_spare_holds_and_a_leftover_waiter_becomes_a_spare():
    """The join loop's state handler, wrapped (launch.rounds.claimable), on torch's own state and actions:
    claimed, the spare takes the lost node's group rank among the participants and the loop ends
    (SpareClaimed); a node of the round gone, it stays a spare for a while instead of joining the wait list; a
    node left waiting for a round that filled without it is moved to the spares, not left to restart the
    groups for ever."""
    from launch.rounds import SpareClaimed, _Claimable
    from trainer.contract import rendezvous_actions

    actions = rendezvous_actions()
    state = SimpleNamespace(round=3, complete=True, participants={"a": 0, "b": 1}, wait_list=set(),
                            redundancy_list={"s"}, last_heartbeats={"a": 1, "b": 1, "s": 1})
    ctx = SimpleNamespace(node="s", state=state, settings=SimpleNamespace(max_nodes=2))
    door = Door()
    torch_says = []
    handle = _Claimable(None, door, actions)._wrap(lambda c, d: torch_says[-1])

    torch_says.append(actions.SYNC)  # the round is full: wait for a claim (none)
    assert handle(ctx, 0) == actions.KEEP_ALIVE and not door.held
    del state.participants["b"]  # b's keep-alive expired: torch would move the spare to the wait list
    torch_says.append(actions.REMOVE_FROM_REDUNDANCY_LIST)
    assert handle(ctx, 0) == actions.KEEP_ALIVE and door.held and "s" in state.redundancy_list
    door.claim = {"round": "r3", "group_rank": 1}
    assert handle(ctx, 0) == actions.KEEP_ALIVE  # seated: the executor writes it
    assert state.participants == {"a": 0, "s": 1} and not state.redundancy_list
    with pytest.raises(SpareClaimed):
        handle(ctx, 0)

    state.wait_list.add("w")  # a node that missed the round: a spare, not a node to restart for
    door.claim = None
    assert handle(SimpleNamespace(node="a", state=state, settings=ctx.settings), 0) == actions.KEEP_ALIVE
    assert state.wait_list == set() and state.redundancy_list == {"w"}
    torch_says.append(actions.FINISH)
    assert handle(SimpleNamespace(node="a", state=state, settings=ctx.settings), 0) == actions.FINISH

    # Without a door (no in-process spares: a job without in-process recovery), the leftover waiter too.
    bare = _Claimable(None, None, actions)._wrap(lambda c, d: torch_says[-1])
    state.redundancy_list, state.wait_list = set(), {"w"}
    assert bare(SimpleNamespace(node="a", state=state, settings=ctx.settings), 0) == actions.KEEP_ALIVE
    assert state.wait_list == set() and state.redundancy_list == {"w"}
    torch_says.append(actions.SYNC)
    assert bare(SimpleNamespace(node="w", state=state, settings=ctx.settings), 0) == actions.SYNC  # torch's pause


def test_a_spare_joins_knowing_which_ranks_each_node_holds():
    """A spare that took a lost node's place must tell a later lost node's ranks from those of several nodes
    (`place_of`: a spare is claimed only for exactly one node's ranks): the claim carries the claimant's view
    of the round. Without it, a spare-joined launcher that published first after a second node loss shrank
    the world although a spare was waiting (found by the 3-node chaos run)."""
    met = Round("r2", frozenset("abc"), {"a": frozenset({0, 1}), "b": frozenset({2, 3}), "c": frozenset({4, 5})})
    joined = Round.joined("r2", json.loads(json.dumps(met.holdings())))  # through the store, as JSON
    assert joined.name == "r2" and sorted(map(sorted, joined.ranks.values())) == [[0, 1], [2, 3], [4, 5]]
    assert frozenset({4, 5}) in joined.ranks.values() and frozenset({3, 4}) not in joined.ranks.values()
    assert joined.nodes_of([1, 4]) == 2
    assert Round.joined("r2", []).nodes_of([0]) is None  # a claim without it: not known, as before

    # The agent's side: the claim a survivor makes for node b's ranks carries it, and the spare that joins
    # with it can place node c's ranks in turn (and no set of ranks that is not one node's).
    def agent(meeting: Round) -> SimpleNamespace:
        group = SimpleNamespace(group_rank=0, group_world_size=3, master_addr="127.0.0.1", master_port=1)
        return SimpleNamespace(meeting=meeting, _worker_group=group, world_size=lambda: 6)

    claim = json.loads(json.dumps(SupervisedAgent.place_of(agent(met), [2, 3])))
    spare = agent(Round.joined(claim["round"], claim["holdings"]))
    assert SupervisedAgent.place_of(spare, [4, 5])["ranks"] == [4, 5]
    assert SupervisedAgent.place_of(spare, [3, 4]) is None
