"""The elastic launcher preempted, for real: SIGTERM to one rank or to the launcher (an emergency checkpoint
committed, the next launch resuming from it), a second SIGTERM that stops at once, ranks that cannot commit
within the grace period (their stacks printed, then killed), and two nodes preempted together. Every process
is real (torch's elastic agent, gloo ranks); every wait is bounded, on the ledger or the heartbeats."""

from __future__ import annotations

import os
import re
import signal
import time

from common.process import proc_stat
from common.timing import AGAIN_AFTER_S
from tests.helpers import finish, free_port, launch, read_metrics, wait_for, wait_for_event, wait_for_step
from trainer.runtime.protocol import read_events, read_heartbeats


def asleep(pid: int, polls: int = 5):
    """A check for `wait_for`: whether `pid` has been asleep (state S: in a sleep, or waiting in a collective)
    without using any CPU time for the last `polls` polls of it (a process between steps computes)."""
    seen: list[tuple[str, int]] = []

    def check() -> bool:
        stat = proc_stat(pid)
        assert stat is not None, f"process {pid} is gone"
        seen.append(stat)
        return len(seen) >= polls and all(s == ("S", seen[-1][1]) for s in seen[-polls:])

    return check


def test_sigterm_to_one_rank_is_recorded_as_that_ranks_preemption(cache_dir, tmp_path):
    """Slurm or a person signals rank 1 alone: every rank commits the step and exits 75, the ledger
    names rank 1 (its heartbeat says it got the signal), and the restarted group loses no step."""
    proc = launch(tmp_path, ["train.steps=40", "checkpoint.every=100"])
    victim = wait_for_step(tmp_path, 10, rank=1)
    os.kill(victim.pid, signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(tmp_path)
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["cause"], failure["rank"]) == ("preemption", 1), failure
    assert next(e for e in events if e["event"] == "resume")["lost_steps"] == 0


def test_sigterm_to_launcher_commits_an_emergency_checkpoint_and_resumes(cache_dir, tmp_path):
    """SIGTERM to the launcher, then to its process group a tenth of a second later (one preemption
    delivered twice, as `kill PID; kill -- -PGID` or a wrapper relaying to both do): the ranks commit an
    emergency checkpoint, which a second signal taken for "stop at once" would have cost; the next launch
    resumes from it."""
    overrides = ["train.steps=150", "checkpoint.every=1000", "fault.preempt_grace_s=30",
                 "fault.warm_restarts=false"]  # (no rank restarts: no fork server)
    proc = launch(tmp_path, overrides)
    beat = wait_for_step(tmp_path, 20)
    os.kill(proc.pid, signal.SIGTERM)
    wait_for_event(tmp_path, "preempt", timeout=30)  # its handler has run: a second call, not one coalesced signal
    os.killpg(proc.pid, signal.SIGTERM)  # its session and group (start_new_session): the launcher, fork server
    out = finish(proc, timeout=60)
    assert proc.returncode == 75, out[-4000:]
    events = read_events(tmp_path)
    commits = [e["step"] for e in events if e["event"] == "commit"]
    assert commits and commits[-1] >= beat.step, (commits, beat.step)  # nothing finished is lost
    assert events[-1]["event"] == "done" and events[-1]["outcome"] == "preempted"
    assert events[-1]["final_step"] == commits[-1]  # the heartbeats are read to the end (steps not undercounted)
    assert events[-1]["committed_step"] == commits[-1]

    again = launch(tmp_path, overrides)
    out = finish(again)
    assert again.returncode == 0, out[-4000:]
    assert f"resumed from step {commits[-1]}" in out
    assert read_metrics(tmp_path)[150]["step"] == 150


def test_a_second_sigterm_a_second_later_stops_at_once_without_the_emergency_checkpoint(cache_dir, tmp_path):
    """Steps of 4 s: the ranks would commit at the end of the step in progress. A second SIGTERM half a second
    past common.timing.AGAIN_AFTER_S after the first (by the launcher's clock: its `preempt` event) stops at
    once: the ranks are SIGKILLed, nothing is committed, the launcher exits 75 within seconds and says the
    step was not committed."""
    proc = launch(tmp_path, ["train.steps=150", "checkpoint.every=5", "fault.preempt_grace_s=60",
                             "fault.warm_restarts=false"], env={"REKINDLE_SLOW_RANK": "0:4@8"})
    wait_for_step(tmp_path, 7)
    os.kill(proc.pid, signal.SIGTERM)
    (first,) = wait_for_event(tmp_path, "preempt", timeout=30)  # the launcher's handler has run
    time.sleep(max(0.0, first["time"] + AGAIN_AFTER_S + 0.5 - time.time()))  # the fault: a second, separate signal
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
    proc = launch(tmp_path, ["train.steps=150", "checkpoint.every=5", "fault.preempt_grace_s=4",
                             "fault.warm_restarts=false"], env={"REKINDLE_SLOW_RANK": "0:8@8"})
    beats = [wait_for_step(tmp_path, 7, rank=rank) for rank in (0, 1)]
    # Into step 8's sleep: both ranks past step 7 and asleep (rank 0 in its sleep, rank 1 waiting for it; between
    # steps they compute, and two ranks cannot both wait in the same collective).
    checks = [asleep(beat.pid) for beat in beats]
    wait_for("both ranks asleep in step 8", lambda: all([check() for check in checks]), 6, every=0.05)
    signalled = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert time.time() - signalled < 8 and proc.returncode == 75, out[-3000:]
    assert re.search(r"rank 0 \(pid \d+, train\) did not commit its emergency checkpoint in time: its stacks", out), out
    assert "most recent call first" in out and "in train_step" in out, out[-3000:]  # faulthandler's, mid-step
    assert "no emergency checkpoint of step 7 was committed" in read_events(tmp_path)[-1]["outcome"]


def test_preempted_node_without_rank_0_reports_its_emergency_checkpoint(cache_dir, tmp_path):
    """Two nodes with their own run.dir (as pods with local run directories) and one checkpoint.dir:
    both are SIGTERMed; the node without rank 0 never sees rank 0's commit event, and still reports
    a clean preemption: it asks the shared checkpoint store."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=pods"]
    shared = [f"checkpoint.dir={tmp_path / 'ckpt'}", "train.steps=400", "checkpoint.every=1000",
              "fault.warm_restarts=false"]
    nodes = [launch(tmp_path / f"pod{i}", shared, nproc=1, extra_args=args) for i in range(2)]
    wait_for("rank at step 5", lambda: any(b.step >= 5 for d in tmp_path.glob("pod*/heartbeats-*")
                                          for b in read_heartbeats(d).values()), 90)
    for p in nodes:
        os.kill(p.pid, signal.SIGTERM)
    outs = [finish(p, timeout=90) for p in nodes]
    assert [p.returncode for p in nodes] == [75, 75], outs[0][-2000:] + outs[1][-2000:]
    outcomes = [read_events(tmp_path / f"pod{i}")[-1]["outcome"] for i in range(2)]
    assert outcomes == ["preempted", "preempted"], outcomes
    # Both nodes name the one step committed, whatever step each node's own ranks had reached.
    committed = [read_events(tmp_path / f"pod{i}")[-1]["committed_step"] for i in range(2)]
    assert committed[0] == committed[1] >= 5, committed
