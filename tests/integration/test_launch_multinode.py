"""Two launchers training one job over a loopback c10d rendezvous, for real: a node silent without a word
(gone on without, rejoining when it wakes), a rank failed on a live node, a node lost with survivors on two
nodes (three launchers), a spare taking a lost node's place in process, the job moving down the
--rdzv-endpoint list when the rendezvous host is lost, a signal while waiting for the other nodes, a node
joining; and the stores listening on loopback only. A SIGKILLed or SIGSTOPped rank of one node:
tests/integration/test_in_process.py (in process) and test_warm_restarts.py (a full warm restart). Every
process is real (torch's elastic agent, gloo ranks); every wait is bounded, on the ledger or the
heartbeats."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.fixtures import freeze_tree, kill_tree, rendezvous_host
from tests.helpers import (
    KNOWN_PEAK,
    finish,
    free_port,
    launch,
    launcher_beats,
    node_beat,
    read_metrics,
    run_trainer,
    wait_for,
    wait_for_event,
    wait_for_one_group,
    wait_for_step,
)
from trainer.runtime.protocol import read_events, read_heartbeats


def test_a_node_silent_without_a_word_is_gone_on_without_and_rejoins_when_it_wakes(cache_dir, tmp_path):
    """--nnodes 1:2, each node with its own memory directory: SIGSTOP the second node's launcher, fork server
    and rank (a node frozen or without power: its connections stay open and nothing fails in the
    collectives its peer waits in; a crash's SIGKILL, which closes them, is the Slurm test's and
    bench_node_loss's). The first node's launcher finds it silent (launch.liveness) after fault.node_silence_s
    (5 s; a shorter bound: tests/unit/test_liveness.py): alone, but at the only
    endpoint, it goes on; it tells its rank, which leaves its collective and goes on alone in process (world
    1), with the same global batch, from the 2-rank memory snapshot resharded from its own part and its
    peer copy of the other (a step or two back; no durable checkpoint but the last). Then SIGCONT (a VM
    that was frozen): the woken node does not take its own pause for the store's silence (it would exit
    75), its rank ends itself if its collective never fails (regroup.STUCK_S), and it rejoins: both finish
    in a world of 2 again."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=1:2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=elastic"]
    slow = {"REKINDLE_SLOW_RANK": "0:0.4@40-75"}  # after going on alone: 14 s for the woken node to rejoin

    def node(name: str) -> subprocess.Popen:
        return launch(tmp_path, ["train.steps=100", "checkpoint.every=200", "checkpoint.memory_every=1",
                                 f"checkpoint.memory_dir={tmp_path / ('shm-' + name)}", "fault.straggler_factor=0"],
                      nproc=1, extra_args=args, env=slow)

    procs = [node("a"), node("b")]  # at once: both within the rendezvous's last call (3 s), both take part
    wait_for_event(tmp_path, "rendezvous", count=2, launchers=procs)  # both at the rendezvous store
    wait_for_one_group(tmp_path, procs, 15)
    h = rendezvous_host(tmp_path, procs)  # lose the other one: the job goes on at the same endpoint
    host, guest = procs[h], procs[1 - h]
    try:
        frozen = freeze_tree(guest.pid)  # the launcher, its fork server and its rank
        lost = time.time()
        # The survivor's heartbeat goes under its new number, as the launcher now knows it (it may have been 1).
        wait_for_event(tmp_path, "resume", timeout=60, launchers=[host])
        (directory,) = tmp_path.glob(f"heartbeats-*{host.pid}-*")
        beats = read_heartbeats(directory)
        assert list(beats) == [0] and beats[0].generation == 1, beats
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        woke = time.time()
        out, guest_out = finish(host), finish(guest, timeout=60)
    finally:
        kill_tree(guest.pid)
    assert (host.returncode, guest.returncode) == (0, 0), (out[-3000:], guest_out[-3000:])
    events = read_events(tmp_path)
    guest_node = f"{socket.gethostname()}:{guest.pid}"
    silent = [e for e in events if e["event"] == "partition"]
    assert [(e["silent"], e["live"], e["group_size"]) for e in silent] == [([guest_node], 1, 2)], silent
    assert 4 < silent[0]["time"] - lost < 15, (lost, silent)  # fault.node_silence_s (from its last count)
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["tier"] == "memory-reshard" and resume["lost_steps"] <= 2 and resume["step"] >= 14, resume
    assert (resume["path"], resume["replaced"]) == ("in-process", []) and resume["time"] - lost < 20, resume
    assert 4 < resume["recovery_s"] < 20, resume  # from the lost node's last sign of life: the silence counts
    assert "memory snapshot of 2 rank(s)" in out and "resharded to 1" in out, out[-3000:]
    assert re.search(r"going on in process as rank 0 of 1 \(was rank [01] of 2\)", out), out[-3000:]
    assert "telling the ranks here to leave generation 0" in out, out[-3000:]
    assert "going on in process (restart 1 of" in out, out[-3000:]
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["cause"], failure["path"]) == ("node", "in-process") and failure["rank"] in (0, 1), failure
    # The woken node rejoined: the survivor restarted its group with it (a node waiting), a world of 2 again.
    rejoined = [e for e in events if e["event"] == "restart" and e["node"] != guest_node and e["time"] > woke]
    assert [e["reason"] for e in rejoined] == ["membership change"], rejoined
    # Rank 0 says its world: twice 2 (the first group, and after the rejoin) on whichever node holds it, 1 here alone.
    assert (out + guest_out).count("world 2 (gloo") == 2 and "world 1 (gloo" in out, (out[-3000:], guest_out[-3000:])
    assert "the rendezvous endpoint" not in guest_out and "frame #" not in guest_out, guest_out[-3000:]  # not cut off
    assert rejoined[0]["time"] - woke < 15 + 5, (woke, rejoined)  # regroup.STUCK_S at worst, and a restart
    # The survivor committed what it trained alone before restarting with it (an emergency checkpoint): nothing
    # lost, where restarting at once would have gone back to the snapshot both worlds share.
    again = [e for e in events if e["event"] == "resume" and e["time"] > rejoined[0]["time"]]
    assert len(again) == 2 and all(e["lost_steps"] == 0 and e["tier"] == "durable" for e in again), again
    assert all(e["step"] > resume["step"] for e in again), (resume, again)  # what it trained alone, kept
    assert read_metrics(tmp_path)[100]["step"] == 100


@pytest.mark.parametrize("sig", [signal.SIGSTOP], ids=["hung"])  # killed: test_network_inprocess.py
def test_a_rank_failed_on_a_live_node_is_replaced_alone_and_every_other_rank_keeps_its_process(
        cache_dir, tmp_path, sig):
    """--nnodes 2, two ranks per node: SIGSTOP a rank (a hang, which its node's watchdog finds after
    fault.hang_timeout_s, 2 s, and kills alone; a SIGKILLed rank across nodes: test_network_inprocess.py and
    the second-failure test below). The other node's watchdog finds its ranks waiting as long: it puts its
    verdict off (HANG_DEFER_S), and kills none of them. Its launcher leads an in-process
    recovery: it replaces that rank alone in the next generation and says on the ranks' store that it
    handles the failure, so the other node's launcher follows the recovery instead of taking the node for
    lost. Every other rank, on both nodes, keeps its
    pid; nobody meets at the rendezvous again; the ledger has one failure (in process) and each node's end
    of the recovery (led here, followed there, with the ranks each kept)."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=live-node"]
    overrides = ["train.steps=60", "checkpoint.every=200", "checkpoint.memory_every=1", "fault.straggler_factor=0"]

    def node(name: str) -> subprocess.Popen:
        return launch(tmp_path, [*overrides, f"checkpoint.memory_dir={tmp_path / ('shm-' + name)}",
                                 "fault.hang_timeout_s=2"], nproc=2, extra_args=args)

    procs = [node("a"), node("b")]
    try:
        wait_for_event(tmp_path, "rendezvous", count=2, launchers=procs)  # both at the rendezvous store
        wait_for_one_group(tmp_path, procs, 15)
        # A killed rank: the guest's (not the rendezvous host's); a hung one: node b's, whose watchdog finds it.
        failed = procs[1 - rendezvous_host(tmp_path, procs)] if sig == signal.SIGKILL else procs[1]
        before = {b.rank: b.pid for p in procs for b in launcher_beats(tmp_path, p.pid)}
        victim = max(b.rank for b in launcher_beats(tmp_path, failed.pid))
        os.kill(before[victim], sig)
        wait_for_event(tmp_path, "in_process_done", count=2, launchers=procs, timeout=60)
        after = {b.rank: b.pid for p in procs for b in launcher_beats(tmp_path, p.pid) if b.generation == 1}
        outs = [finish(p) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert sorted(before) == sorted(after) == [0, 1, 2, 3], (before, after)
    assert after[victim] != before[victim] and {r: after[r] for r in after if r != victim} == {
        r: before[r] for r in before if r != victim}, (victim, before, after)
    events = read_events(tmp_path)
    failed_node = f"{socket.gethostname()}:{failed.pid}"
    failures = [(e["node"] == failed_node, e["cause"], e["path"]) for e in events if e["event"] == "failure"]
    assert failures == [(True, "signal" if sig == signal.SIGKILL else "hang", "in-process")], events
    done = {e["node"] == failed_node: e for e in events if e["event"] == "in_process_done"}
    assert done[True]["led"] and not done[False]["led"] and done[True]["replaced"] == [victim], done
    assert sorted(done[True]["kept_ranks"] + done[False]["kept_ranks"]) == sorted({0, 1, 2, 3} - {victim}), done
    assert [e for e in events if e["event"] == "rendezvous"][2:] == [], events  # nobody met again
    assert not [e for e in events if e["event"] == "restart"], events
    assert "world 3 (gloo" not in "".join(outs) and "world 1 (gloo" not in "".join(outs), outs[0][-3000:]
    assert read_metrics(tmp_path)[60]["step"] == 60


def test_a_second_failure_during_a_cross_node_recovery_falls_back_to_a_full_restart_recorded(cache_dir, tmp_path):
    """--nnodes 2, two ranks per node: the guest's higher rank SIGKILLed, then, as soon as its launcher has
    recorded the failure (the survivors wait for the replacement, the host's ranks among them), its other
    rank too (SIGSTOPped before the first kill, so that the recovery waits for it: the second failure has
    UNAWARE_S, 2 s, to land within it, not the recovery's fraction of a second). That launcher gives up the
    in-process path and says why in the ledger; both nodes restart the group together and finish, resuming
    from memory."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=second-failure"]
    procs = [launch(tmp_path, ["train.steps=40", "checkpoint.every=200", "checkpoint.memory_every=1",
                               "fault.straggler_factor=0", f"checkpoint.memory_dir={tmp_path / ('shm-' + name)}"],
                    nproc=2, extra_args=args) for name in "ab"]
    try:
        wait_for_event(tmp_path, "rendezvous", count=2, launchers=procs)
        wait_for_one_group(tmp_path, procs, 10)
        guest = procs[1 - rendezvous_host(tmp_path, procs)]
        ranks = {b.rank: b.pid for b in launcher_beats(tmp_path, guest.pid)}
        first, second = max(ranks), min(ranks)
        os.kill(ranks[second], signal.SIGSTOP)
        os.kill(ranks[first], signal.SIGKILL)
        wait_for_event(tmp_path, "failure", launchers=procs)
        os.kill(ranks[second], signal.SIGKILL)
        (fallback,) = wait_for_event(tmp_path, "in_process_fallback", launchers=procs)
        outs = [finish(p) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert fallback["rank"] == second and "second failure" in fallback["why"], fallback
    events = read_events(tmp_path)
    guest_node = f"{socket.gethostname()}:{guest.pid}"
    failures = [(e["node"] == guest_node, e["rank"], e["path"]) for e in events if e["event"] == "failure"]
    assert failures[:2] == [(True, first, "in-process"), (True, second, "restart")], failures
    resumes = [e for e in events if e["event"] == "resume" and e["path"] == "restart"]
    assert len(resumes) == 2 and all(e["tier"].startswith("memory") for e in resumes), resumes
    assert read_metrics(tmp_path)[40]["step"] == 40


def test_a_node_lost_leaves_survivors_on_two_nodes_that_go_on_in_process_in_a_smaller_world(cache_dir, tmp_path):
    """`--nnodes 2:3`: three launchers of one rank each over a loopback rendezvous (one machine, so one memory
    directory holds every part). SIGKILL a launcher that does not host the store, with its rank (a lost node:
    its connections close). The ranks of the two other nodes keep their processes: they agree on one smaller
    world (the first launcher's to publish it stands), go on in process as ranks 0 and 1 of 2 from the 3-rank
    memory snapshot resharded, and finish. Nobody meets at the rendezvous again."""
    args = ["--nnodes=2:3", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=two-survive"]
    overrides = ["train.steps=40", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=200",
                 "checkpoint.memory_every=1", "fault.straggler_factor=0", "fault.warm_restarts=false"]
    procs = [launch(tmp_path, overrides, nproc=1, extra_args=args) for _ in range(3)]  # (no rank restarts)
    try:
        wait_for_event(tmp_path, "rendezvous", count=3, launchers=procs)
        wait_for_one_group(tmp_path, procs, 8)
        victim = procs[(rendezvous_host(tmp_path, procs) + 1) % 3]
        survivors = [p for p in procs if p is not victim]
        before = {p.pid: node_beat(tmp_path, p.pid).pid for p in survivors}
        kill_tree(victim.pid)
        wait_for_event(tmp_path, "in_process_done", count=2, timeout=60, launchers=survivors)
        after = {p.pid: node_beat(tmp_path, p.pid) for p in survivors}
        outs = [finish(p, timeout=120) for p in survivors]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in survivors] == [0, 0], [out[-3000:] for out in outs]
    assert {launcher: b.pid for launcher, b in after.items()} == before, (before, after)
    assert sorted(b.rank for b in after.values()) == [0, 1] and {b.generation for b in after.values()} == {1}, after
    events = read_events(tmp_path)
    assert not [e for e in events if e["event"] in ("restart", "in_process_fallback")], events
    failures = [(e["cause"], e["path"]) for e in events if e["event"] == "failure"]
    assert failures == [("node", "in-process")] * 2, failures
    resumes = [e for e in events if e["event"] == "resume" and e.get("path") == "in-process"]
    assert len(resumes) == 2 and all(e["tier"] == "memory-reshard" and e["lost_steps"] <= 2 for e in resumes), resumes
    assert sum("going on in process as rank" in out and "of 2 (was rank" in out for out in outs) == 2, outs
    assert read_metrics(tmp_path)[40]["step"] == 40


def test_a_spare_takes_a_lost_nodes_place_in_process_and_the_run_stays_bit_identical(cache_dir, tmp_path):
    """`--nnodes 1:2`, one rank per node, each node its own memory directory: two launchers train; a third waits
    as a spare (the job is full). SIGKILL the launcher that does not host the store, with its rank (a lost node).
    The survivor's launcher claims the spare, which leaves torch's redundancy list and starts the lost rank in
    the recovery's generation, the world size unchanged: the survivor keeps its process, the spare's rank
    restores the lost node's state from the survivor's peer copy (`memory-peer`), nobody restarts, and every
    loss is bit-identical to an uninterrupted run of the same world. A launcher started then waits as the next
    spare (the spare took the lost node's seat in torch's round).

    Then a SIGTERM to a rank restarts every node through a rendezvous: three launchers for two seats, one left
    a spare. Whichever it is, the next lost node is replaced by it in process: a launcher seated by that
    rendezvous is a spare no more (it was one before, registered; a claim of it would wait for ranks that
    never come, and restart the group). A fifth launcher waits as a spare to the end and exits 0 saying so in
    one line, with no store error and no C++ stack frames."""
    steps = 150
    run = [f"train.steps={steps}", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=400",
           "fault.straggler_factor=0"]
    reference = tmp_path / "reference"
    run_trainer(reference, [*run, "train.log_every=1", "train.eval_every=0", KNOWN_PEAK], nproc=2)
    run_dir = tmp_path / "run"
    args = ["--nnodes=1:2", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=spare-in-process"]

    def node(name: str) -> subprocess.Popen:
        return launch(run_dir, [*run, "checkpoint.memory_every=1", f"checkpoint.memory_dir={tmp_path / name}"],
                      nproc=1, extra_args=args, env={"REKINDLE_SLOW_RANK": f"0:0.25@1-{steps}"})  # outlasts it all

    def training(launchers: list) -> list:
        """The launchers whose rank trains now (its process alive)."""
        beats = {p: node_beat(run_dir, p.pid) for p in launchers}
        return [p for p, b in beats.items() if b is not None and os.path.exists(f"/proc/{b.pid}")]

    procs = [node("shm-a"), node("shm-b")]
    try:
        wait_for_event(run_dir, "rendezvous", count=2, launchers=procs)
        wait_for_one_group(run_dir, procs, 2)
        procs.append(node("shm-s"))
        wait_for_event(run_dir, "spare_waiting", timeout=60, launchers=procs)
        h = rendezvous_host(run_dir, procs[:2])
        host, victim, spare = procs[h], procs[1 - h], procs[2]
        kept = node_beat(run_dir, host.pid).pid
        lost_rank = node_beat(run_dir, victim.pid).rank
        kill_tree(victim.pid)
        live = [host, spare]
        (joined,) = wait_for_event(run_dir, "spare_joined", timeout=60, launchers=live)
        wait_for_event(run_dir, "in_process_done", timeout=60, launchers=live)
        after = node_beat(run_dir, host.pid)
        # The spare took the lost node's seat in the round: torch counts it whole, so a node started now waits as
        # the next spare instead of joining (which would drain and restart the group).
        live.append(node("shm-t"))
        procs.append(live[-1])
        wait_for_event(run_dir, "spare_waiting", timeout=60, launchers=live,
                       where=lambda e: e["node"].endswith(f":{live[-1].pid}"))
        assert training(live) == [host, spare], "a launcher started as a spare joined the group"
        # Every node restarts through a rendezvous (a rank preempted): two of the three are seated.
        group = node_beat(run_dir, host.pid).group
        os.kill(node_beat(run_dir, spare.pid).pid, signal.SIGTERM)

        def restarted() -> bool:
            beats = [node_beat(run_dir, p.pid) for p in training(live)]
            return len(beats) == 2 and len({b.group for b in beats} - {group}) == 1 and min(b.step for b in beats) > 0

        wait_for("the group restarted with two of the three launchers", restarted, timeout=90)
        seated = training(live)
        time.sleep(2.0)  # the one left out registers as a spare from torch's join loop (within a second)
        lost = next(p for p in seated if p is not host)
        kill_tree(lost.pid)
        second_loss = time.time()
        live.remove(lost)
        # (A launcher that waited as a spare and was seated by the restart says `spare_joined` too, not in process.)
        wait_for_event(run_dir, "spare_joined", count=2, timeout=60, launchers=live, where=lambda e: e["in_process"])
        wait_for_event(run_dir, "in_process_done", count=2, timeout=60, launchers=live)
        live.append(node("shm-u"))
        procs.append(live[-1])
        wait_for_event(run_dir, "spare_waiting", timeout=60, launchers=live,
                       where=lambda e: e["node"].endswith(f":{live[-1].pid}"))
        outs = [finish(p, timeout=120) for p in live]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in live] == [0, 0, 0], [out[-3000:] for out in outs]
    assert after.pid == kept and after.generation == 1, after  # the survivor kept its process
    assert joined["in_process"] and joined["generation"] == 1 and joined["ranks"] == [lost_rank], joined
    events = read_events(run_dir)
    assert not [e for e in events if e["event"] == "in_process_fallback"], events
    restarts = [e for e in events if e["event"] == "restart"]
    assert restarts and all(e["time"] < second_loss for e in restarts), events  # the SIGTERM's only
    assert len([e for e in events if e["event"] == "rendezvous"]) == 5, events  # one meeting per launcher
    done = [e for e in events if e["event"] == "in_process_done"]
    assert done[0]["spare"] == f"{socket.gethostname()}:{spare.pid}" and done[0]["kept_pids"] == [kept], done
    assert len(done) == 2 and done[1]["spare"], done  # the second loss: a spare too
    second = [e for e in events if e["event"] == "spare_joined" and e["in_process"]][1]
    assert second["node"] != f"{socket.gethostname()}:{lost.pid}" and second["generation"] >= 1, second
    resumes = {e["tier"] for e in events if e["event"] == "resume" and e["time"] > joined["time"] - 5}
    assert "memory-peer" in resumes, events[-12:]
    assert "world 1 (gloo" not in "".join(outs), outs[0][-3000:]
    # The last spare, when the job ends: exit 0 in one line, no store error, no C++ stack frames.
    assert f"the job finished (step {steps} committed) while this node waited to join: nothing left to do here" in \
        outs[2], outs[2][-3000:]
    assert "frame #" not in outs[2] and "Traceback" not in outs[2] and "launcher error" not in outs[2], outs[2][-3000:]
    assert "worker(s) started" not in outs[2] and "this node waits as a spare" in outs[2], outs[2][-3000:]
    ours, theirs = read_metrics(run_dir), read_metrics(reference)
    assert sorted(ours) == list(range(1, steps + 1))
    assert [ours[s]["loss"] for s in ours] == [theirs[s]["loss"] for s in ours]


def test_the_job_moves_down_the_endpoint_list_when_the_rendezvous_host_is_lost(cache_dir, tmp_path):
    """`--rdzv-endpoint A,B`, in-process recovery off: two launchers meet at A, hosted by the first. SIGKILL it
    with everything below it: the other moves to B (hosting it now), restarts its group there alone
    (`--nnodes 1:2`) from the newest state and finishes (exit 0), with no C++ stack frames; the ledger names
    the host, the loss and the move. (In process, no rank restarts: tests/integration/test_network_inprocess.py.)"""
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ["--nnodes=1:2", f"--rdzv-endpoint={first},{second}", "--rdzv-id=host-moves"]
    overrides = ["train.steps=60", "checkpoint.every=20", "checkpoint.memory_every=1", "train.eval_every=0",
                 "fault.in_process=false"]
    # At once: both within the rendezvous's last call (3 s), both take part.
    procs = [launch(tmp_path, overrides, nproc=1, extra_args=args) for _ in range(2)]
    wait_for_event(tmp_path, "rendezvous", count=2, launchers=procs)  # both at the rendezvous store A
    wait_for_one_group(tmp_path, procs, 8)
    h = rendezvous_host(tmp_path, procs)
    host, guest = procs[h], procs[1 - h]
    kill_tree(host.pid)
    lost = time.time()
    out = finish(guest, timeout=120)
    assert guest.returncode == 0, out[-4000:]
    assert f"the rendezvous endpoint {first} stopped answering" in out and f"moving to {second}" in out, out[-4000:]
    assert "frame #" not in out and "launcher error" not in out, out[-4000:]
    events = read_events(tmp_path)
    meetings = [(e["endpoint"], e["hosted"]) for e in events if e["event"] == "rendezvous"]
    assert sorted(meetings[:2]) == [(first, False), (first, True)] and meetings[2:] == [(second, True)], meetings
    moved = [e for e in events if e["event"] == "rendezvous_lost"]
    assert [(e["endpoint"], e["next"]) for e in moved] == [(first, second)], moved
    after_move = events[events.index(moved[0]):]
    resume = next((e for e in after_move if e["event"] == "resume"), None)
    assert resume is not None and resume["lost_steps"] <= 1 and resume["path"] == "restart", (lost, after_move)
    assert events[-1]["event"] == "done" and events[-1]["exit_code"] == 0, events[-1]
    assert read_metrics(tmp_path)[60]["step"] == 60


def test_signal_while_waiting_for_other_nodes_stops_the_launcher(cache_dir, tmp_path):
    """--nnodes 2 with only one launcher: it waits in the rendezvous (join timeout 900s); SIGINT ends it."""
    proc = launch(tmp_path, ["train.steps=4", "fault.warm_restarts=false"], nproc=1,
                  extra_args=["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=alone"])
    # Its start (imports: seconds on a busy machine), then at the rendezvous store, waiting for the other node.
    wait_for_event(tmp_path, "start", timeout=60, launchers=[proc])
    wait_for_event(tmp_path, "rendezvous", timeout=60, launchers=[proc])
    assert proc.poll() is None
    signalled = time.time()
    os.kill(proc.pid, signal.SIGINT)
    out = finish(proc, timeout=30)
    assert time.time() - signalled < 8, out[-3000:]
    assert proc.returncode == 75 and "no worker group is running: stopping now" in out, out[-3000:]


def test_a_node_joining_loses_no_step_and_a_node_restarting_the_group_is_a_failure(cache_dir, tmp_path):
    """--nnodes 1:2: a second launcher joins a running job. The first group gets SIGTERM and commits
    an emergency checkpoint (no periodic one is due), and the 2-node group resumes from exactly there.
    Then the guest's rank is SIGKILLed while the host's is SIGSTOPped (it cannot fail by itself): the
    guest's launcher restarts the group (in-process recovery off, as after any fallback to a full restart)
    and waits to meet again. The host's takes that for a failure and restarts at once, not for a node
    joining (SIGTERM, then a 30 s grace that the stopped rank never ends)."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=1:2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=scale-up"]
    overrides = ["train.steps=400", "checkpoint.every=1000", "fault.preempt_grace_s=30", "fault.in_process=false"]
    host = launch(tmp_path, overrides, nproc=1, extra_args=args)
    alone = wait_for_step(tmp_path, 10)
    guest = launch(tmp_path, overrides, nproc=1, extra_args=args)
    joined = wait_for_event(tmp_path, "resume", timeout=120, launchers=[host, guest])  # the 2-node group's
    beats = wait_for_one_group(tmp_path, [host, guest], joined[0]["step"] + 5)
    # The ranks name their coordination store after the group's rendezvous round: the same on both nodes, and
    # new after the membership change (which torchelastic's restart count is not: a failure noticed before
    # it would be seen again by the new group's ranks).
    assert beats[0].group == beats[1].group != alone.group, (alone, beats)
    os.kill(beats[0].pid, signal.SIGSTOP)
    os.kill(beats[1].pid, signal.SIGKILL)
    killed = time.time()
    outs = [finish(host, timeout=240), finish(guest, timeout=240)]
    assert host.returncode == 0 and guest.returncode == 0, outs[0][-3000:] + outs[1][-3000:]
    events = read_events(tmp_path)
    drained = next(e for e in events if e["event"] == "restart")
    assert drained["reason"] == "membership change"
    commits = [e["step"] for e in events if e["event"] == "commit"]
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["reason"] == "membership change" and resume["lost_steps"] == 0, resume
    assert resume["step"] == commits[0] > 10, (resume, commits)
    assert "world 2 (gloo" in outs[0] + outs[1]

    later = [e for e in events if e["time"] > killed]
    host_node = f"{socket.gethostname()}:{host.pid}"
    failures = [e for e in later if e["event"] == "failure" and e["node"] == host_node]
    assert [e["cause"] for e in failures] == ["node"] and "left the worker group" in failures[0]["message"], later
    assert failures[0]["time"] - killed < 10, later  # not the drain's 30 s
    assert [e["reason"] for e in later if e["event"] == "restart"] == ["failure", "failure"], later
    assert [e["node"] for e in later if e["event"] == "resume"], later


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses (ip:port) of the TCP sockets these processes listen on, from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)
                ip = ".".join(str(b) for b in raw[::-1]) if size == 4 else ipaddress.IPv6Address(
                    b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))).compressed
                found.add(f"{ip}:{int(port, 16)}")
    return found


def test_stores_listen_on_loopback_only(cache_dir, tmp_path):
    """A single-node run: the launcher's rendezvous store and rank 0's process-group store are reachable
    from this machine only (torch's TCPStore alone would listen on every interface)."""
    proc = launch(tmp_path, ["train.steps=200", "checkpoint.every=1000", "fault.warm_restarts=false"])
    wait_for_step(tmp_path, 3)
    beats = next(read_heartbeats(d) for d in tmp_path.glob("heartbeats-*"))
    addresses = listening_addresses([proc.pid, *(b.pid for b in beats.values())])
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert len(addresses) >= 2, (addresses, out[-2000:])  # the rendezvous store and the group's store
    assert all(a.startswith(("127.", "::1:")) for a in addresses), addresses
