"""The elastic launcher under real faults: a rank SIGTERMed, the launcher SIGTERMed (preemption) or
SIGKILLed, a crash loop, signals while it waits, and two launchers training one job over loopback c10d
rendezvous (a node lost, a node joining). A SIGKILLed or SIGSTOPped rank: tests/integration/test_in_process.py
(in process) and test_warm_restarts.py (a full warm restart). Every process is real (torch's elastic agent,
gloo ranks); every wait is bounded."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import KNOWN_PEAK, REPO, SMOKE, SOLO, child_env, free_port, read_metrics, smoke_model
from trainer.checkpoint import Checkpointer
from trainer.runtime.protocol import read_events, read_heartbeats
from trainer.testing import freeze_tree, kill_tree, rendezvous_host

FAST = ["log.progress=false", "train.log_every=1", "train.eval_every=0", "fault.heartbeat_s=0.2",
        "fault.restart_backoff_s=0.2", KNOWN_PEAK]


def launch(run_dir: Path, overrides: list[str] = (), nproc: int = 2, extra_args: list[str] = (),
           env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={nproc}", *extra_args, str(SMOKE),
           f"run.dir={run_dir}", *FAST, *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 150) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"launcher did not finish within {timeout}s:\n{out[-4000:]}") from None
    return out


def wait_for_step(run_dir: Path, step: int, timeout: float = 90, rank: int = 0, attempt: int | None = None,
                  phases: tuple[str, ...] = ("train",), poll_s: float = 0.05) -> dict:
    """The heartbeat record of `rank` once it has finished `step` (bounded wait), in `attempt` if given,
    in one of `phases` (an eval every step leaves a rank in `train` only briefly)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for directory in run_dir.glob("heartbeats-*"):
            beat = read_heartbeats(directory).get(rank)
            if beat and beat["step"] >= step and beat["phase"] in phases and attempt in (None, beat["attempt"]):
                return beat
        time.sleep(poll_s)
    raise AssertionError(f"rank {rank} did not reach step {step} within {timeout}s")


def node_beat(run_dir: Path, launcher_pid: int) -> dict | None:
    """The newest heartbeat of the ranks a launcher ran (one at a time here; None before the first)."""
    beats = [b for d in run_dir.glob(f"heartbeats-*{launcher_pid}-*") for b in read_heartbeats(d).values()]
    return max(beats, key=lambda b: b["t_proc"], default=None)


def wait_for_one_group(run_dir: Path, launchers: list[subprocess.Popen], step: int, timeout: float = 120) -> list[dict]:
    """The launchers' ranks' newest heartbeats (one rank each) once they all train in one worker group (the
    same rendezvous round), each past `step`. A launcher slow to start on a busy machine misses the first
    round's last call and joins the next: waiting for a step alone would not see that."""
    deadline, beats = time.time() + timeout, []
    while len(beats) < len(launchers) or len({b["group"] for b in beats}) > 1 or min(b["step"] for b in beats) < step:
        assert time.time() < deadline and all(p.poll() is None for p in launchers), beats
        time.sleep(0.05)
        beats = [b for p in launchers if (b := node_beat(run_dir, p.pid)) is not None]
    return beats


def load_final(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest committed checkpoint's model parameters, loaded on one process (resharded)."""
    model, opt = smoke_model()
    ckpt = Checkpointer(str(run_dir / "checkpoints"), SOLO)
    state = ckpt.load(ckpt.discover_latest(), model, opt)
    return {"step": state.step, **{k: v.clone() for k, v in model.state_dict().items()}}


def test_sigterm_to_one_rank_is_recorded_as_that_ranks_preemption(cache_dir, tmp_path):
    """Slurm or a person signals rank 1 alone: every rank commits the step and exits 75, the ledger
    names rank 1 (its heartbeat says it got the signal), and the restarted group loses no step."""
    proc = launch(tmp_path, ["train.steps=40", "checkpoint.every=100"])
    victim = wait_for_step(tmp_path, 10, rank=1)
    os.kill(victim["pid"], signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(tmp_path)
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["cause"], failure["rank"]) == ("preemption", 1), failure
    assert next(e for e in events if e["event"] == "resume")["lost_steps"] == 0


def test_a_relaunch_after_the_launcher_was_killed_counts_the_lost_steps(cache_dir, tmp_path):
    """The launcher itself is SIGKILLed (its ranks die with it): the next launch on that run.dir finds
    the dead launcher's last heartbeats, and its resume event says how many steps were redone."""
    durable = ["train.steps=60", "checkpoint.every=10", "checkpoint.memory_every=0"]  # the steps since a commit: redone
    first = launch(tmp_path, durable)
    reached = wait_for_step(tmp_path, 15)["step"]
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    time.sleep(1.0)  # the ranks die with their launcher (PR_SET_PDEATHSIG)
    reached = max([reached] + [b["step"] for d in tmp_path.glob("heartbeats-*") for b in read_heartbeats(d).values()])
    second = launch(tmp_path, durable)
    out = finish(second)
    assert second.returncode == 0, out[-4000:]
    resume = next(e for e in read_events(tmp_path) if e["event"] == "resume")
    committed = reached // 10 * 10  # unless the kill came in the middle of that step's save
    assert resume["reason"] == "launcher lost" and resume["step"] in (committed, committed - 10), resume
    assert resume["lost_steps"] == reached - resume["step"] > 0, resume
    assert not [d for d in tmp_path.glob("heartbeats-*")]  # the dead launcher's directory is gone too
    # The dead job's leases on run.dir and the checkpoint directory were taken over, and the ledger says so.
    taken = [e for e in read_events(tmp_path) if e["event"] == "lease_taken"]
    assert sorted(Path(e["directory"]).name for e in taken) == ["checkpoints", tmp_path.name], taken
    assert all(e["why"] == "its holder is dead" for e in taken), taken
    assert not list(tmp_path.rglob("LEASE.json"))  # released at the end of the run


def test_sigterm_to_launcher_commits_an_emergency_checkpoint_and_resumes(cache_dir, tmp_path):
    """SIGTERM to the launcher, then to its process group a tenth of a second later (one preemption
    delivered twice, as `kill PID; kill -- -PGID` or a wrapper relaying to both do): the ranks commit an
    emergency checkpoint, which a second signal taken for "stop at once" would have cost; the next launch
    resumes from it."""
    overrides = ["train.steps=150", "checkpoint.every=1000", "fault.preempt_grace_s=30"]
    proc = launch(tmp_path, overrides)
    beat = wait_for_step(tmp_path, 20)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.1)  # the launcher's handler has run by then: a second call, not one coalesced signal
    os.killpg(proc.pid, signal.SIGTERM)  # its session and group (start_new_session): the launcher, fork server
    out = finish(proc, timeout=60)
    assert proc.returncode == 75, out[-4000:]
    events = read_events(tmp_path)
    commits = [e["step"] for e in events if e["event"] == "commit"]
    assert commits and commits[-1] >= beat["step"], (commits, beat["step"])  # nothing finished is lost
    assert events[-1]["event"] == "done" and events[-1]["outcome"] == "preempted"
    assert events[-1]["final_step"] == commits[-1]  # the heartbeats are read to the end (steps not undercounted)
    assert events[-1]["committed_step"] == commits[-1]

    again = launch(tmp_path, overrides)
    out = finish(again)
    assert again.returncode == 0, out[-4000:]
    assert f"resumed from step {commits[-1]}" in out
    assert read_metrics(tmp_path)[150]["step"] == 150


def test_a_second_sigterm_a_second_later_stops_at_once_without_the_emergency_checkpoint(cache_dir, tmp_path):
    """Steps of 4 s: the ranks would commit at the end of the step in progress. A second SIGTERM 1.5 s after
    the first (launch.supervisor.AGAIN_AFTER_S) stops at once: the ranks are SIGKILLed, nothing is
    committed, the launcher exits 75 within seconds and says the step was not committed."""
    proc = launch(tmp_path, ["train.steps=150", "checkpoint.every=5", "fault.preempt_grace_s=60"],
                  env={"REKINDLE_SLOW_RANK": "0:4@8"})
    wait_for_step(tmp_path, 7)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(1.5)
    signalled = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert time.time() - signalled < 8 and proc.returncode == 75, out[-3000:]
    events = read_events(tmp_path)
    assert [e["step"] for e in events if e["event"] == "commit"] == [5], events  # the periodic one only
    assert "no emergency checkpoint of step 7 was committed" in events[-1]["outcome"], events[-1]


def test_ranks_that_cannot_commit_within_the_grace_period_print_their_stacks_then_are_killed(cache_dir, tmp_path):
    """Steps of 8 s and fault.preempt_grace_s=4: the ranks cannot reach the end of their step in time. At the
    grace period less its reserve (25%) the launcher has them print their stacks (SIGUSR1), which show where
    they were (in the step: one sleeping, the other waiting for it), SIGKILLs them and exits 75, saying the
    step was not committed."""
    proc = launch(tmp_path, ["train.steps=150", "checkpoint.every=5", "fault.preempt_grace_s=4"],
                  env={"REKINDLE_SLOW_RANK": "0:8@8"})
    wait_for_step(tmp_path, 7)
    time.sleep(0.5)  # into step 8's sleep
    signalled = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert time.time() - signalled < 8 and proc.returncode == 75, out[-3000:]
    assert re.search(r"rank 0 \(pid \d+, train\) did not commit its emergency checkpoint in time: its stacks", out), out
    assert "most recent call first" in out and "in train_step" in out, out[-3000:]  # faulthandler's, mid-step
    assert "no emergency checkpoint of step 7 was committed" in read_events(tmp_path)[-1]["outcome"]


def test_crash_loop_stops_early_with_its_own_exit_code_and_names_the_cause(cache_dir, tmp_path):
    """Every rank raises at step 12 in every attempt, with a message that names an address and a pid (new
    each attempt), and whichever rank the launcher blames: the same failure, so a crash loop (exit 3)
    after fault.crash_loop_repeats attempts, not a restart budget spent with backoff."""
    # Restarts of the whole group: in process, the first rank to exit is replaced alone until the others
    # exit too (a second failure), so the count of restart events would depend on their timing.
    proc = launch(tmp_path, ["train.steps=40", "checkpoint.every=5", "fault.crash_loop_repeats=3",
                             "fault.max_restarts=10", "fault.in_process=false"], env={"REKINDLE_FAIL_AT": "12"})
    out = finish(proc)
    assert proc.returncode == 3, out[-4000:]
    assert "crash loop" in out and "injected failure at step 12" in out
    events = read_events(tmp_path)
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 3 and all(f["step"] == 12 for f in failures), failures
    assert len({f["message"] for f in failures}) == 3, failures  # the messages differ; the failure does not
    assert "RuntimeError: injected failure at step 12" in failures[0]["message"]
    assert "inject_faults" in failures[0]["traceback"]
    assert sum(e["event"] == "restart" for e in events) == 2


def test_a_second_job_on_the_same_run_dir_is_refused(cache_dir, tmp_path):
    """Two standalone launchers on one run.dir would resume from each other's checkpoints: the second
    is refused at once (exit 2, naming the first) and writes nothing; once the first is SIGKILLed, its
    stale lock does not block the next launch."""
    first = launch(tmp_path, ["train.steps=100000", "checkpoint.every=0"], nproc=1)
    wait_for_step(tmp_path, 2)
    events = len(read_events(tmp_path))
    second = launch(tmp_path, ["train.steps=100000"], nproc=1)
    out = finish(second, timeout=60)
    assert second.returncode == 2, out[-3000:]
    assert f"{tmp_path} is in use by another job: the launcher with pid {first.pid}" in out
    assert len(read_events(tmp_path)) == events  # the refused launcher wrote no event
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    third = launch(tmp_path, ["train.steps=2", "checkpoint.resume=never", f"checkpoint.dir={tmp_path}/fresh"], nproc=1)
    out = finish(third)
    assert third.returncode == 0, out[-3000:]


def test_a_node_silent_without_a_word_is_gone_on_without_and_rejoins_when_it_wakes(cache_dir, tmp_path):
    """--nnodes 1:2, each node with its own memory directory: SIGSTOP the second node's launcher, fork server
    and rank (a node frozen or without power: its connections stay open and nothing fails in the
    collectives its peer waits in; a crash's SIGKILL, which closes them, is the Slurm test's and
    bench_node_loss's). The first node's launcher finds it silent (launch.liveness): alone, but at the only
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

    procs = [node("a")]
    time.sleep(1.0)  # within the rendezvous's last call (3 s): both take part
    procs.append(node("b"))
    wait_for_one_group(tmp_path, procs, 15)
    h = rendezvous_host(tmp_path, procs)  # lose the other one: the job goes on at the same endpoint
    host, guest = procs[h], procs[1 - h]
    try:
        frozen = freeze_tree(guest.pid)  # the launcher, its fork server and its rank
        lost = time.time()
        # The survivor's heartbeat goes under its new number, as the launcher now knows it (it may have been 1).
        deadline = time.time() + 60
        while not any(e["event"] == "resume" for e in read_events(tmp_path)):
            assert time.time() < deadline and host.poll() is None, read_events(tmp_path)[-3:]
            time.sleep(0.05)
        (directory,) = tmp_path.glob(f"heartbeats-*{host.pid}-*")
        beats = read_heartbeats(directory)
        assert list(beats) == [0] and beats[0]["generation"] == 1, beats
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
    assert 4 < silent[0]["time"] - lost < 15, (lost, silent)  # liveness.LOST_S (from its last count), not a timeout
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["tier"] == "memory-reshard" and resume["lost_steps"] <= 2 and resume["step"] >= 14, resume
    assert (resume["path"], resume["replaced"]) == ("in-process", []) and resume["time"] - lost < 20, resume
    assert 4 < resume["recovery_s"] < 20, resume  # from the lost node's last sign of life: the silence counts
    assert "memory snapshot of 2 rank(s)" in out and "resharded to 1" in out, out[-3000:]
    assert re.search(r"going on in process as rank 0 of 1 \(was rank [01] of 2\)", out), out[-3000:]
    assert "telling the ranks here to leave generation 0" in out and "going on without them" in out, out[-3000:]
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["cause"], failure["path"]) == ("node", "in-process") and failure["rank"] in (0, 1), failure
    # The woken node rejoined: the survivor restarted its group with it (a node waiting), a world of 2 again.
    rejoined = [e for e in events if e["event"] == "restart" and e["node"] != guest_node and e["time"] > woke]
    assert [e["reason"] for e in rejoined] == ["membership change"], rejoined
    assert out.count("world 2 (gloo") == 2 and "world 1 (gloo" in out, out[-3000:]
    assert "the rendezvous endpoint" not in guest_out and "frame #" not in guest_out, guest_out[-3000:]  # not cut off
    assert rejoined[0]["time"] - woke < 15 + 5, (woke, rejoined)  # regroup.STUCK_S at worst, and a restart
    # The survivor committed what it trained alone before restarting with it (an emergency checkpoint): nothing
    # lost, where restarting at once would have gone back to the snapshot both worlds share.
    again = [e for e in events if e["event"] == "resume" and e["time"] > rejoined[0]["time"]]
    assert len(again) == 2 and all(e["lost_steps"] == 0 and e["tier"] == "durable" for e in again), again
    assert all(e["step"] > resume["step"] for e in again), (resume, again)  # what it trained alone, kept
    assert read_metrics(tmp_path)[100]["step"] == 100


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_rank_failed_on_a_live_node_restarts_both_together_and_its_node_is_not_taken_for_lost(
        cache_dir, tmp_path, sig):
    """--nnodes 1:2, one rank per node: SIGKILL one node's rank, or SIGSTOP it (a hang, which that node's
    watchdog finds after its fault.hang_timeout_s of 2 s, the other's being 60 s); its launcher lives. That
    launcher restarts its group (a failed rank of a multi-node job) and first says so on the ranks' store
    (`announce_failure(handled=True)`), so the other node's launcher, whose rank waits for the lost one, does
    not take the node for lost after launch.inprocess.NODE_LOST_S (without the word it went on alone in a
    world of 1 after 0.4 s, then had to restart again to take the node back; a hang did so until its restart
    said it too): it finds the node gone to meet again (0.9 s after a kill here) and restarts with it. Both
    resume at the same step from memory, a world of 2. (Without the word the hung case failed 3 of 6 runs:
    the other failed when node b took longer than 0.4 s to meet again.)"""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=1:2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=live-node"]
    overrides = ["train.steps=60", "checkpoint.every=200", "checkpoint.memory_every=1", "fault.straggler_factor=0"]

    def node(name: str, hang_timeout_s: int) -> subprocess.Popen:
        return launch(tmp_path, [*overrides, f"checkpoint.memory_dir={tmp_path / ('shm-' + name)}",
                                 f"fault.hang_timeout_s={hang_timeout_s}"], nproc=1, extra_args=args)

    procs = [node("a", 60)]
    time.sleep(1.0)  # within the rendezvous's last call (3 s): both take part
    procs.append(node("b", 2))
    try:
        wait_for_one_group(tmp_path, procs, 15)
        # A killed rank: the guest's (not the rendezvous host's); a hung one: node b's, whose watchdog finds it.
        failed = procs[1 - rendezvous_host(tmp_path, procs)] if sig == signal.SIGKILL else procs[1]
        os.kill(node_beat(tmp_path, failed.pid)["pid"], sig)
        outs = [finish(p) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    events = read_events(tmp_path)
    failed_node = f"{socket.gethostname()}:{failed.pid}"
    failures = {e["node"] == failed_node: (e["cause"], e["path"]) for e in events if e["event"] == "failure"}
    cause = "signal" if sig == signal.SIGKILL else "hang"
    assert failures == {True: (cause, "restart"), False: ("node", "restart")}, events
    assert "going on without them" not in "".join(outs) and "world 1 (gloo" not in "".join(outs), outs[0][-3000:]
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 2 and len({e["step"] for e in resumes}) == 1, resumes
    assert all(e["tier"].startswith("memory") and e["lost_steps"] <= 1 for e in resumes), resumes
    assert not [e for e in events if e["event"] == "restart" and e["reason"] != "failure"], events
    assert read_metrics(tmp_path)[60]["step"] == 60


def test_the_job_moves_down_the_endpoint_list_when_the_rendezvous_host_is_lost(cache_dir, tmp_path):
    """`--rdzv-endpoint A,B`: two launchers meet at A, hosted by the first. SIGKILL it with everything below
    it: the other moves to B (hosting it now), goes on alone (`--nnodes 1:2`) from the newest state and
    finishes (exit 0), with no C++ stack frames; the ledger names the host, the loss and the move."""
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ["--nnodes=1:2", f"--rdzv-endpoint={first},{second}", "--rdzv-id=host-moves"]
    overrides = ["train.steps=60", "checkpoint.every=20", "checkpoint.memory_every=1", "train.eval_every=0"]
    procs = [launch(tmp_path, overrides, nproc=1, extra_args=args)]
    time.sleep(1.0)  # within the rendezvous's last call (3 s): both take part
    procs.append(launch(tmp_path, overrides, nproc=1, extra_args=args))
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
    assert resume is not None and resume["lost_steps"] <= 1, (round(lost, 2), after_move)
    assert events[-1]["event"] == "done" and events[-1]["exit_code"] == 0, events[-1]
    assert read_metrics(tmp_path)[60]["step"] == 60


def test_two_launchers_train_one_job_and_a_spare_beyond_max_nodes_exits_0_in_one_line(cache_dir, tmp_path):
    """`--nnodes 2` over a loopback rendezvous: two launchers train one job (world 2). A third, started once
    they train, waits (torch's redundancy list, its fork server up) and, when the job ends, exits 0 saying
    so in one line, with no store error and no C++ stack frames."""
    args = ["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=two-nodes"]
    overrides = ["train.steps=30", "checkpoint.every=15", "train.eval_every=0", "fault.straggler_factor=0"]
    slow = {"REKINDLE_SLOW_RANK": "0:0.5@1-16"}  # a window of 8 s for the spare to start in
    nodes = [launch(tmp_path, overrides, nproc=1, extra_args=args, env=slow) for _ in range(2)]
    wait_for_step(tmp_path, 2)
    spare = launch(tmp_path, overrides, nproc=1, extra_args=args)
    deadline = time.time() + 60  # the spare's start (imports), then into the rendezvous
    while not any(e["event"] == "spare_waiting" for e in read_events(tmp_path)) and time.time() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is None for p in [*nodes, spare]), "the job ended before the spare waited"
    outs = [finish(p, timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "world 2 (gloo" in "".join(outs), outs
    assert json.loads((tmp_path / "checkpoints" / "step-00000030" / "COMMIT.json").read_text())["world"] == 2
    out = finish(spare, timeout=60)
    assert spare.returncode == 0, out[-3000:]
    assert "the job finished (step 30 committed) while this node waited to join: nothing left to do here" in out, \
        out[-3000:]
    assert "frame #" not in out and "Traceback" not in out and "launcher error" not in out, out[-3000:]
    assert "worker(s) started" not in out and "this node waits as a spare" in out, out[-3000:]


def test_signal_during_the_backoff_stops_the_launcher_at_once(cache_dir, tmp_path):
    """A crash at step 3 of every attempt: the second restart waits 20s. A SIGTERM in that wait ends
    the launcher within seconds (exit 75), and no new worker group is started."""
    proc = launch(tmp_path, ["train.steps=40", "checkpoint.every=2", "fault.restart_backoff_s=20",
                             "fault.crash_loop_repeats=5"], nproc=1, env={"REKINDLE_FAIL_AT": "3"})
    deadline, out = time.time() + 120, ""
    while "waiting 20.0s before restarting" not in out and time.time() < deadline:
        # select, then read what is there: a blocking readline would wait without bound for a launcher
        # that prints nothing (raw reads: the text wrapper's buffer would hide lines from select)
        if select.select([proc.stdout.fileno()], [], [], max(deadline - time.time(), 0))[0]:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            assert chunk or proc.poll() is None, out[-3000:]
            out += chunk.decode(errors="replace")
    assert "waiting 20.0s" in out, out[-3000:]
    started = out.count("worker(s) started")
    signalled = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out += finish(proc, timeout=30)
    assert time.time() - signalled < 8, out[-3000:]
    assert proc.returncode == 75, out[-3000:]
    assert out.count("worker(s) started") == started  # nothing started after the signal


def test_signal_while_waiting_for_other_nodes_stops_the_launcher(cache_dir, tmp_path):
    """--nnodes 2 with only one launcher: it waits in the rendezvous (join timeout 900s); SIGINT ends it."""
    proc = launch(tmp_path, ["train.steps=4"], nproc=1,
                  extra_args=["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=alone"])
    deadline = time.time() + 60  # its start (imports: seconds on a busy machine), then into the rendezvous
    while not any(e["event"] == "start" for e in read_events(tmp_path)) and time.time() < deadline:
        assert proc.poll() is None
        time.sleep(0.1)
    time.sleep(2.0)
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
    guest's launcher restarts the group and waits to meet again. The host's takes that for a failure and
    restarts at once, not for a node joining (SIGTERM, then a 30 s grace that the stopped rank never ends)."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=1:2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=scale-up"]
    overrides = ["train.steps=400", "checkpoint.every=1000", "fault.preempt_grace_s=30"]
    host = launch(tmp_path, overrides, nproc=1, extra_args=args)
    alone = wait_for_step(tmp_path, 10)
    guest = launch(tmp_path, overrides, nproc=1, extra_args=args)
    deadline = time.time() + 120
    while not (joined := [e for e in read_events(tmp_path) if e["event"] == "resume"]):  # the 2-node group's
        assert time.time() < deadline and host.poll() is None and guest.poll() is None
        time.sleep(0.05)
    beats = wait_for_one_group(tmp_path, [host, guest], joined[0]["step"] + 5)
    # The ranks name their coordination store after the group's rendezvous round: the same on both nodes, and
    # new after the membership change (which torchelastic's restart count is not: a failure noticed before
    # it would be seen again by the new group's ranks).
    assert beats[0]["group"] == beats[1]["group"] != alone["group"], (alone, beats)
    os.kill(beats[0]["pid"], signal.SIGSTOP)
    os.kill(beats[1]["pid"], signal.SIGKILL)
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
    proc = launch(tmp_path, ["train.steps=200", "checkpoint.every=1000"])
    wait_for_step(tmp_path, 3)
    beats = next(read_heartbeats(d) for d in tmp_path.glob("heartbeats-*"))
    addresses = listening_addresses([proc.pid, *(b["pid"] for b in beats.values())])
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert len(addresses) >= 2, (addresses, out[-2000:])  # the rendezvous store and the group's store
    assert all(a.startswith(("127.", "::1:")) for a in addresses), addresses


def test_preempted_node_without_rank_0_reports_its_emergency_checkpoint(cache_dir, tmp_path):
    """Two nodes with their own run.dir (as pods with local run directories) and one checkpoint.dir:
    both are SIGTERMed; the node without rank 0 never sees rank 0's commit event, and still reports
    a clean preemption: it asks the shared checkpoint store."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=pods"]
    shared = [f"checkpoint.dir={tmp_path / 'ckpt'}", "train.steps=400", "checkpoint.every=1000"]
    nodes = [launch(tmp_path / f"pod{i}", shared, nproc=1, extra_args=args) for i in range(2)]
    deadline = time.time() + 90
    while not any(b["step"] >= 5 for d in tmp_path.glob("pod*/heartbeats-*") for b in read_heartbeats(d).values()):
        assert time.time() < deadline, "no rank reached step 5 within 90s"
        time.sleep(0.1)
    for p in nodes:
        os.kill(p.pid, signal.SIGTERM)
    outs = [finish(p, timeout=90) for p in nodes]
    assert [p.returncode for p in nodes] == [75, 75], outs[0][-2000:] + outs[1][-2000:]
    outcomes = [read_events(tmp_path / f"pod{i}")[-1]["outcome"] for i in range(2)]
    assert outcomes == ["preempted", "preempted"], outcomes
    # Both nodes name the one step committed, whatever step each node's own ranks had reached.
    committed = [read_events(tmp_path / f"pod{i}")[-1]["committed_step"] for i in range(2)]
    assert committed[0] == committed[1] >= 5, committed
