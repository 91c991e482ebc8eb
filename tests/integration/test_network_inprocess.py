"""In-process recovery across nodes on a real network of the tests' own (tests/netns.py: one network
namespace per node; root only): three launchers (`--nnodes 3`, one rank each, the rendezvous store on node
0, each node with its own memory directory). A rank of a node that does not host the store is SIGKILLed
(its trainer process, found by its heartbeat's pid): its launcher replaces it alone, the two other ranks
keep their processes and recover in place, and the run's losses are bit-identical to an uninterrupted run
of the same world."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests import netns
from tests.fixtures import kill_tree
from tests.helpers import KNOWN_PEAK, REPO, SMOKE, child_env, launcher_beats, read_metrics, run_trainer, wait_for
from trainer.runtime.protocol import read_events

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "ok")

STEPS = 30
RUN = [f"train.steps={STEPS}", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=200",
       "train.eval_every=0", "log.progress=false", "train.log_every=1", "fault.straggler_factor=0", KNOWN_PEAK]


def test_a_rank_killed_on_a_node_without_the_store_is_replaced_alone_bit_identically(cache_dir, tmp_path):
    reference = tmp_path / "reference"
    run_trainer(reference, [*RUN, "checkpoint.memory_every=0"], nproc=3)  # the same world, uninterrupted
    run_dir = tmp_path / "run"
    with netns.Network(3) as net:
        endpoint = f"{net.address(0)}:29400"
        procs, logs = [], [tmp_path / f"node{i}.log" for i in range(3)]
        for i in range(3):
            cmd = [sys.executable, "-m", "launch", "--nnodes=3", "--nproc-per-node=1", f"--rdzv-endpoint={endpoint}",
                   "--rdzv-id=inprocess", f"--local-addr={net.address(i)}", str(SMOKE), f"run.dir={run_dir}", *RUN,
                   "checkpoint.memory_every=1", f"checkpoint.memory_dir={tmp_path / f'shm{i}'}"]
            env = child_env(GLOO_SOCKET_IFNAME=netns.IFACE)  # the ranks' links: this node's own
            procs.append(subprocess.Popen(net.run(i, cmd), cwd=REPO, env=env, stdout=logs[i].open("w"),
                                          stderr=subprocess.STDOUT))
        try:
            def explain() -> str:
                tails = [f"--- node {i} (pid {p.pid}, exit {p.poll()})\n{log.read_text()[-2500:]}"
                         for i, (p, log) in enumerate(zip(procs, logs, strict=True))]
                return "\n".join([*tails, "--- events", *map(str, read_events(run_dir)[-20:])])

            def beats() -> dict[int, tuple[int, int]]:  # node -> (rank, trainer pid), of the newest generation
                found = {i: max(launcher_beats(run_dir, p.pid), key=lambda b: b.generation, default=None)
                         for i, p in enumerate(procs)}
                return {i: (b.rank, b.pid, b.step, b.generation) for i, b in found.items() if b is not None}

            wait_for("3-node training", lambda: len(beats()) == 3 and min(s for _, _, s, _ in beats().values()) >= 8,
                     120, explain=explain)
            before = beats()
            _, victim, _, _ = before[2]
            subprocess.run(["kill", "-9", str(victim)], check=True, timeout=10)
            wait_for("the recovery settled on every node",
                     lambda: sum(e["event"] == "in_process_done" for e in read_events(run_dir)) >= 3, 60,
                     explain=explain)
            after = beats()
            for p in procs:
                p.wait(timeout=120)
        finally:
            for p in procs:
                kill_tree(p.pid)
        assert [p.returncode for p in procs] == [0, 0, 0], explain()
    assert {i: pid for i, (_, pid, _, _) in after.items()} == {0: before[0][1], 1: before[1][1],
                                                              2: after[2][1]} and after[2][1] != victim, (before, after)
    assert {g for _, _, _, g in after.values()} == {1}, after
    events = read_events(run_dir)
    nodes = [f"{socket.gethostname()}:{p.pid}" for p in procs]  # the ledger's names (ip netns exec execs)
    failures = [(e["node"], e["cause"], e["path"]) for e in events if e["event"] == "failure"]
    assert failures == [(nodes[2], "signal", "in-process")], failures
    done = {e["node"]: (e["led"], e["kept_ranks"], e["store"]) for e in events if e["event"] == "in_process_done"}
    rank = {i: r for i, (r, _, _, _) in before.items()}
    assert done == {nodes[0]: (False, [rank[0]], endpoint), nodes[1]: (False, [rank[1]], endpoint),
                    nodes[2]: (True, [], endpoint)}, done
    assert not [e for e in events if e["event"] in ("restart", "rendezvous_lost")], events
    ours, theirs = read_metrics(run_dir), read_metrics(reference)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert [ours[s]["loss"] for s in ours] == [theirs[s]["loss"] for s in sorted(theirs)]

