"""The elastic launcher restarting, for real: a relaunch after the launcher was SIGKILLed (the steps lost,
the dead job's leases taken over), a crash loop stopped early, a second job on the same run.dir refused,
a job pointed at another job's rendezvous store refused,
and a signal during the backoff before a restart. Every process is real (torch's elastic agent, gloo
ranks); every wait is bounded."""

from __future__ import annotations

import os
import select
import signal
import time
from pathlib import Path

from common.process import is_alive
from tests.helpers import finish, free_port, launch, wait_for, wait_for_step
from trainer.runtime.protocol import read_events, read_heartbeats


def test_a_relaunch_after_the_launcher_was_killed_counts_the_lost_steps(cache_dir, tmp_path):
    """The launcher itself is SIGKILLed (its ranks die with it): the next launch on that run.dir finds
    the dead launcher's last heartbeats, and its resume event says how many steps were redone."""
    durable = ["train.steps=60", "checkpoint.every=10", "checkpoint.memory_every=0"]  # the steps since a commit: redone
    first = launch(tmp_path, durable)
    reached = wait_for_step(tmp_path, 15).step
    ranks = [b.pid for d in tmp_path.glob("heartbeats-*") for b in read_heartbeats(d).values()]
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    wait_for("end of the ranks with their launcher (PR_SET_PDEATHSIG)", lambda: not any(map(is_alive, ranks)), 30,
             every=0.05)
    reached = max([reached] + [b.step for d in tmp_path.glob("heartbeats-*") for b in read_heartbeats(d).values()])
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


def test_a_job_pointed_at_the_store_of_another_job_is_refused_and_the_other_goes_on(cache_dir, tmp_path):
    """Two jobs (their own run.dir and --rdzv-id) given the same endpoint: the second's launcher would run on
    the store the first one's launcher hosts, and end when that job does. It is refused at start (exit 2,
    one line naming the other job), before it starts a rank; the first job goes on."""
    endpoint = f"127.0.0.1:{free_port()}"
    first = launch(tmp_path / "a", ["train.steps=100000", "checkpoint.every=0", "fault.warm_restarts=false"], nproc=1,
                   extra_args=[f"--rdzv-endpoint={endpoint}", "--rdzv-id=job-a"])
    try:
        wait_for_step(tmp_path / "a", 2)
        second = launch(tmp_path / "b", ["train.steps=30", "fault.warm_restarts=false"], nproc=1,
                        extra_args=[f"--rdzv-endpoint={endpoint}", "--rdzv-id=job-b"])
        out = finish(second, timeout=60)
        assert second.returncode == 2, out[-3000:]
        assert (f"the rendezvous store at {endpoint} is hosted by a launcher of another job (rendezvous id 'job-a'; "
                f"this one is 'job-b')") in out and "Traceback" not in out, out[-3000:]
        assert not list((tmp_path / "b").glob("heartbeats-*/rank-*.json")), "a rank of the refused job started"
        reached = wait_for_step(tmp_path / "a", 2).step
        wait_for_step(tmp_path / "a", reached + 5)  # the first job goes on
        assert first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


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
