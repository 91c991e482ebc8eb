"""Several nodes on a real network of the tests' own (tests/netns.py: one network namespace per node,
veth links on a bridge, addresses 10.213.x.0/24; root only), so that a node can be slowed down, cut off
or removed while the others go on. Three launchers (`--nnodes 1:3`, one rank each) with the rendezvous
at node 0 and then node 1 (`--rdzv-endpoint A,B`), at the default fault settings:

1. node 1's link slowed to 20 Mbit/s (tbf, both ways) for a while: training goes on, with no hang and
   no straggler verdict;
2. node 2's link taken down (a partition): the two others find it silent within seconds
   (`launch.liveness`) and go on without it in process (no rank restarts; from the durable checkpoint, as
   this run keeps no memory snapshots), and the cut-off node stops by itself, exit 75;
3. node 0's namespace removed with everything in it (the node hosting the rendezvous): node 1 moves to
   the second endpoint, its launcher adopting its rank, which goes on alone in process and finishes.
The ledger records the meetings, the partition (who was silent, who was cut off) and the move."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.helpers import KNOWN_PEAK, REPO, SMOKE, child_env, read_metrics, wait_for
from trainer.runtime.protocol import read_events

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "ok")


def last_step(run_dir: Path) -> int:
    return max(read_metrics(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0


def test_a_slow_link_a_partition_and_the_rendezvous_host_removed(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    with netns.Network(3) as net:
        first, second = f"{net.address(0)}:29400", f"{net.address(1)}:29401"
        endpoints = f"{first},{second}"
        procs, logs = [], [tmp_path / f"node{i}.log" for i in range(3)]
        for i in range(3):
            cmd = [sys.executable, "-m", "launch", "--nnodes=1:3", "--nproc-per-node=1", f"--rdzv-endpoint={endpoints}",
                   "--rdzv-id=network", f"--local-addr={net.address(i)}", str(SMOKE), f"run.dir={run_dir}",
                   "train.steps=100", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=10",
                   "checkpoint.memory_every=0", "train.eval_every=0", "log.progress=false", "train.log_every=1",
                   KNOWN_PEAK]
            env = child_env(GLOO_SOCKET_IFNAME=netns.IFACE)  # the ranks' links: this node's own
            procs.append(subprocess.Popen(net.run(i, cmd), cwd=REPO, env=env, stdout=logs[i].open("w"),
                                          stderr=subprocess.STDOUT))
            if i == 0:
                time.sleep(1.0)  # node 0 hosts the rendezvous store
        events = lambda: read_events(run_dir)  # noqa: E731

        def explain() -> str:  # each node's log and the ledger's last records
            tails = [f"--- node {i} (pid {p.pid}, exit {p.poll()})\n{log.read_text()[-2500:]}"
                     for i, (p, log) in enumerate(zip(procs, logs, strict=True))]
            return "\n".join([*tails, "--- events", *map(str, events()[-25:])])

        wait_for("3-node training", lambda: last_step(run_dir) >= 10, 120, explain=explain)
        nodes = [f"{socket.gethostname()}:{p.pid}" for p in procs]  # the ledger's names (ip netns exec execs)

        # 1. A slow link: slower, and no verdict.
        net.slow(1, "20mbit")
        slowed, since = last_step(run_dir), time.time()
        # (metrics records come in batches)
        wait_for("a step on the slow link", lambda: last_step(run_dir) > slowed, 60, explain=explain)
        time.sleep(max(0.0, 6.0 - (time.time() - since)))
        net.unslow(1)
        assert not [e for e in events() if e["event"] in ("failure", "straggler", "partition")], events()[-5:]

        # 2. A partition: node 2 cut off.
        net.cut(2)
        cut = time.time()
        wait_for("a resume without node 2", lambda: sum(e["event"] == "resume" and e["time"] > cut
                                                       for e in events()) >= 2, 60, explain=explain)
        failures = [e for e in events() if e["event"] == "failure" and e["time"] > cut]
        # Each survivor names node 2 and goes on in process without it: no rank restarts.
        assert [(e["cause"], e["path"]) for e in failures] == [("node", "in-process")] * 2, failures
        assert all(nodes[2] in e["message"] for e in failures), failures
        assert not [e for e in events() if e["event"] in ("restart", "in_process_fallback") and e["time"] > cut]
        assert min(e["time"] for e in failures) - cut < 15, failures  # liveness.LOST_S and a poll, not a timeout
        resumes = [e for e in events() if e["event"] == "resume" and e["time"] > cut]
        assert [e["path"] for e in resumes] == ["in-process"] * 2, resumes
        partitions = [e for e in events() if e["event"] == "partition"]
        assert any(e.get("cut_off") == nodes[2] for e in partitions), partitions  # node 2's own account
        assert any(e.get("silent") == [nodes[2]] and e["live"] == 2 for e in partitions), partitions

        # 3. The node hosting the rendezvous removed: node 1 moves to the second endpoint and finishes alone.
        before = last_step(run_dir)
        net.remove(0)
        removed = time.time()
        out = ""
        try:
            procs[1].wait(timeout=150)
            procs[2].wait(timeout=30)
        finally:
            out = logs[1].read_text()
        assert procs[1].returncode == 0, out[-4000:]
        assert procs[2].returncode == 75, logs[2].read_text()[-3000:]  # cut off: it stopped by itself
        done = [e for e in events() if e["event"] == "done" and e["node"] == nodes[2]]
        assert [e["exit_code"] for e in done] == [75] and f"the rendezvous endpoint {second} (the last of " \
            "--rdzv-endpoint) stopped answering" in done[0]["outcome"], done
        moved = [e for e in events() if e["event"] == "rendezvous_lost" and e["time"] > removed]
        assert [(e["node"], e["next"]) for e in moved] == [(nodes[1], second)], moved
        hosts = [(e["node"], e["endpoint"], e["hosted"]) for e in events() if e["event"] == "rendezvous"]
        assert hosts[0] == (nodes[0], first, True) and hosts[-1] == (nodes[1], second, True), hosts
        assert last_step(run_dir) == 100 > before
        for log in logs:
            assert "frame #" not in log.read_text(), log.read_text()[-3000:]
    assert not os.path.exists(f"/run/netns/{net.names[0]}")
