"""The launchers' liveness (launch.liveness) on a real TCP store: a node whose launcher stops counting is
silent after the configured bound (fault.node_silence_s, through launch.nodes.Membership), not the default."""

from __future__ import annotations

import time
from datetime import timedelta

from common.clock import wait_until
from launch.ledger import Ledger
from launch.liveness import Liveness
from launch.nodes import Membership
from trainer.contract import tcp_store_server


def test_a_node_that_stops_counting_is_silent_after_the_configured_bound(tmp_path):
    server = tcp_store_server("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    where = f"127.0.0.1:{server.port}"
    members = Membership([where], Ledger(tmp_path), multi_node=True, silence_s=2.0)
    members.watch(where)
    other = Liveness(where, "node-b").start()
    try:
        here = members.liveness
        assert here is not None and here.lost_s == 2.0
        here.join("r1/g0", 0, 2)
        other.join("r1/g0", 1, 2)
        assert wait_until(lambda: "node-b" in here._heard and here.answering(), 10.0, 0.05), "never heard node-b"
        assert here.silent() == []
        other.stop()  # node-b's launcher stops counting: lost without a word
        stopped = time.monotonic()
        assert wait_until(lambda: here.silent() == ["node-b"], 10.0, 0.05), "node-b never went silent"
        assert 1.0 < time.monotonic() - stopped < 4.0  # the 2 s bound (its last count up to one interval before)
    finally:
        other.stop()
        members.stop()
        del server
