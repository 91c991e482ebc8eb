"""In-process recovery across nodes on a real network of the tests' own (tests/netns.py: one network
namespace per node; root only): three launchers (`--nnodes 2:3`, one rank each, the rendezvous store on node
0 and then node 1, each node with its own memory directory).

1. A rank of a node that does not host the store is SIGKILLed (its trainer process, found by its
   heartbeat's pid): its launcher replaces it alone, the two other ranks keep their processes and recover
   in place, and the run's losses are bit-identical to an uninterrupted run of the same world.
2. Then the store host's namespace is removed with everything in it: the two other launchers move down the
   endpoint list and adopt their running ranks, which follow the store and go on in process as a world of
   2 (from the 3-rank memory snapshot resharded, node 0's part sent from the node that holds its peer copy),
   keep their pids and finish.

A second test: two launchers (`--nnodes 1:2`) and a spare waiting beyond it, each in a namespace of its own;
one node's link goes down (no connection is closed). The other node's launcher finds it silent, claims the
spare, which starts the lost rank in process in its place: the survivor keeps its pid, the world keeps its
size, and every loss is bit-identical to an uninterrupted run."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests import netns
from tests.fixtures import kill_tree
from tests.helpers import KNOWN_PEAK, REPO, SMOKE, child_env, launcher_beats, read_metrics, run_trainer, wait_for
from trainer.runtime.protocol import read_events, read_heartbeats

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "ok")

STEPS = 45
RUN = [f"train.steps={STEPS}", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=200",
       "train.eval_every=0", "log.progress=false", "train.log_every=1", "fault.straggler_factor=0", KNOWN_PEAK]


def test_a_rank_killed_then_the_store_host_removed_and_the_survivors_keep_their_processes(cache_dir, tmp_path):
    reference = tmp_path / "reference"
    run_trainer(reference, [*RUN, "checkpoint.memory_every=0"], nproc=3)  # the same world, uninterrupted
    run_dir = tmp_path / "run"
    with netns.Network(3) as net:
        endpoint, second = f"{net.address(0)}:29400", f"{net.address(1)}:29401"
        procs, logs = [], [tmp_path / f"node{i}.log" for i in range(3)]
        for i in range(3):
            cmd = [sys.executable, "-m", "launch", "--nnodes=2:3", "--nproc-per-node=1",
                   f"--rdzv-endpoint={endpoint},{second}",
                   "--rdzv-id=inprocess", f"--local-addr={net.address(i)}", str(SMOKE), f"run.dir={run_dir}", *RUN,
                   "checkpoint.memory_every=1", f"checkpoint.memory_dir={tmp_path / f'shm{i}'}"]
            # The ranks' links: this node's own. Rank 0 steps slowly, so that the run outlasts both faults.
            env = child_env(GLOO_SOCKET_IFNAME=netns.IFACE, REKINDLE_SLOW_RANK="0:0.15@1-45")
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
            net.remove(0)  # 2. the store's host
            wait_for("the recovery settled on both other nodes",
                     lambda: sum(e["event"] == "in_process_done" for e in read_events(run_dir)) >= 5, 90,
                     explain=explain)
            moved = beats()
            for p in procs[1:]:
                p.wait(timeout=120)
        finally:
            for p in procs:
                kill_tree(p.pid)
        assert [p.returncode for p in procs[1:]] == [0, 0], explain()
    assert {i: b[1] for i, b in moved.items() if i} == {1: after[1][1], 2: after[2][1]}, (after, moved)
    assert sorted(b[0] for i, b in moved.items() if i) == [0, 1] and {b[3] for i, b in moved.items() if i} == {2}
    assert {i: pid for i, (_, pid, _, _) in after.items()} == {0: before[0][1], 1: before[1][1],
                                                              2: after[2][1]} and after[2][1] != victim, (before, after)
    assert {g for _, _, _, g in after.values()} == {1}, after
    events = read_events(run_dir)
    nodes = [f"{socket.gethostname()}:{p.pid}" for p in procs]  # the ledger's names (ip netns exec execs)
    failures = [(e["node"], e["cause"], e["path"]) for e in events if e["event"] == "failure"]
    assert failures[0] == (nodes[2], "signal", "in-process"), failures
    assert sorted(failures[1:]) == [(nodes[1], "node", "in-process"), (nodes[2], "node", "in-process")], failures
    first = [e for e in events if e["event"] == "in_process_done"][:3]
    done = {e["node"]: (e["led"], e["kept_ranks"], e["store"]) for e in first}
    rank = {i: r for i, (r, _, _, _) in before.items()}
    assert done == {nodes[0]: (False, [rank[0]], endpoint), nodes[1]: (False, [rank[1]], endpoint),
                    nodes[2]: (True, [], endpoint)}, done
    assert not [e for e in events if e["event"] in ("restart", "in_process_fallback")], events
    moves = [(e["node"], e["next"]) for e in events if e["event"] == "rendezvous_lost"]
    assert sorted(moves) == [(nodes[1], second), (nodes[2], second)], moves
    second_done = [(e["node"], e["store"]) for e in events if e["event"] == "in_process_done"][3:]
    assert sorted(second_done) == [(nodes[1], second), (nodes[2], second)], second_done
    resumed = [e for e in events if e["event"] == "resume"][-2:]
    assert all(e["path"] == "in-process" and e["tier"] == "memory-reshard" for e in resumed), resumed
    ours, theirs = read_metrics(run_dir), read_metrics(reference)
    assert sorted(ours) == list(range(1, STEPS + 1))
    kept = resumed[0]["step"]  # the steps of the 3-rank world: as the uninterrupted run's
    assert [ours[s]["loss"] for s in range(1, kept + 1)] == [theirs[s]["loss"] for s in range(1, kept + 1)]



def test_a_node_whose_link_goes_down_is_replaced_by_a_spare_in_process_bit_identically(cache_dir, tmp_path):
    steps = 40
    run = [f"train.steps={steps}", *RUN[1:]]
    reference = tmp_path / "reference"
    run_trainer(reference, [*run, "checkpoint.memory_every=0"], nproc=2)  # the same world, uninterrupted
    run_dir = tmp_path / "run"
    with netns.Network(3) as net:
        endpoint = f"{net.address(0)}:29400"
        procs, logs = [], [tmp_path / f"node{i}.log" for i in range(3)]

        def start(i: int) -> None:
            cmd = [sys.executable, "-m", "launch", "--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-endpoint={endpoint}",
                   "--rdzv-id=spare", f"--local-addr={net.address(i)}", str(SMOKE), f"run.dir={run_dir}", *run,
                   "checkpoint.memory_every=1", f"checkpoint.memory_dir={tmp_path / f'shm{i}'}",
                   "fault.node_silence_s=2"]
            env = child_env(GLOO_SOCKET_IFNAME=netns.IFACE, REKINDLE_SLOW_RANK=f"0:0.25@1-{steps}")
            procs.append(subprocess.Popen(net.run(i, cmd), cwd=REPO, env=env, stdout=logs[i].open("w"),
                                          stderr=subprocess.STDOUT))

        def explain() -> str:
            tails = [f"--- node {i} (pid {p.pid}, exit {p.poll()})\n{log.read_text()[-2500:]}"
                     for i, (p, log) in enumerate(zip(procs, logs, strict=True))]
            return "\n".join([*tails, "--- events", *map(str, read_events(run_dir)[-20:])])

        def beats(i: int):
            return max(launcher_beats(run_dir, procs[i].pid), key=lambda b: b.generation, default=None)

        start(0)
        start(1)
        try:
            wait_for("2-node training", lambda: all(beats(i) and beats(i).step >= 3 for i in (0, 1)), 120,
                     explain=explain)
            start(2)
            wait_for("the spare waiting", lambda: any(e["event"] == "spare_waiting" for e in read_events(run_dir)),
                     60, explain=explain)
            kept, lost_rank = beats(0).pid, beats(1).rank
            net.cut(1)  # node 1's link down: nothing closes, nothing answers
            wait_for("the spare in", lambda: any(e["event"] == "in_process_done" for e in read_events(run_dir)), 60,
                     explain=explain)
            after = beats(0)
            spare = [b for d in run_dir.glob(f"heartbeats-*-{procs[2].pid}-*") for b in read_heartbeats(d).values()]
            for p in (procs[0], procs[2]):
                p.wait(timeout=120)
            procs[1].wait(timeout=60)  # cut off: it stops its rank and exits 75
        finally:
            for p in procs:
                kill_tree(p.pid)
        assert [p.returncode for p in procs] == [0, 75, 0], explain()
    assert after.pid == kept and after.generation == 1, (kept, after)
    assert [(b.rank, b.generation) for b in spare] == [(lost_rank, 1)], spare
    events = read_events(run_dir)
    nodes = [f"{socket.gethostname()}:{p.pid}" for p in procs]
    (joined,) = [e for e in events if e["event"] == "spare_joined"]
    assert (joined["node"], joined["in_process"], joined["ranks"]) == (nodes[2], True, [lost_rank]), joined
    done = [(e["node"], e["spare"], e["kept_pids"]) for e in events if e["event"] == "in_process_done"]
    assert done == [(nodes[0], nodes[2], [kept])], done
    assert not [e for e in events if e["event"] in ("restart", "in_process_fallback")], events
    ours, theirs = read_metrics(run_dir), read_metrics(reference)
    assert sorted(ours) == list(range(1, steps + 1))
    assert [ours[s]["loss"] for s in ours] == [theirs[s]["loss"] for s in ours]
