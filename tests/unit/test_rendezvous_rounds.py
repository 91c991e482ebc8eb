"""launch.rounds: the reading of torch's rendezvous state, on real c10d rendezvous handlers (one per node, in
this process) around a real TCPStore on loopback: the round every node of a worker group agrees on (the
ranks name their coordination store after it), and a node waiting to meet again told apart from a new
one (one of the round's own nodes restarted the group: a failure, nothing to drain for; a new node: a
membership change)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from torch.distributed.elastic.rendezvous import RendezvousParameters

from launch import rendezvous
from launch.rounds import nodes_that_left, round_of
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
    from launch.rounds import Round

    met = Round("r2", frozenset("abc"), {"a": frozenset({0, 1}), "b": frozenset({2, 3}), "c": frozenset({4, 5})})
    assert met.nodes_of([1, 4]) == 2 and Round().nodes_of([0]) is None
    smaller = met.renumbered({2: 0, 3: 1, 4: 2, 5: 3}, this_node="b")  # node a lost
    assert smaller.nodes == frozenset("bc") and smaller.ranks == {"b": frozenset({0, 1}), "c": frozenset({2, 3})}
    assert Round("r2", frozenset("ab")).renumbered({0: 0}, this_node="a").nodes == frozenset("a")  # unknown: this one
    assert met.moved("r2@1").name == "r2@1" and met.moved("r2@1").ranks == met.ranks
