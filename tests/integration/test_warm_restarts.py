"""Warm restarts (fault.warm_restarts, launch.zygote): ranks forked from the launcher's fork server
train bit-identically to fresh processes, and a SIGKILLed rank is back within a fraction of a cold
start; through the stub, a SIGSTOPped rank is still found hung (and its stopped process does not
outlive the group), and SIGTERM still preempts, also when Slurm-style every process gets it (the
fork server included); killing the launcher leaves no process behind; a fork server that dies is
started again; with the switch off, ranks are plain `python -m trainer` processes. Real processes,
real signals; every wait bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.process import is_alive
from tests.helpers import finish, launch, wait_for_step
from tests.integration.test_memory_tier import assert_same_run
from trainer.runtime.protocol import read_events

STEPS = 30
# durable: only the final step; restarts of the whole group (in-process recovery: test_in_process.py)
BASE = [f"train.steps={STEPS}", "checkpoint.every=50", "fault.in_process=false"]


def cold_import_s() -> float:
    """Seconds a fresh interpreter takes to import torch and the trainer here and now: the part of a cold
    start a forked rank skips. Measured beside the run, so a slow machine slows both sides alike."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, trainer.run"], check=True, timeout=120)
    return time.monotonic() - started


def memory(tmp_path: Path) -> list[str]:
    return ["checkpoint.memory_every=1", f"checkpoint.memory_dir={tmp_path / 'shm'}"]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_of(run_dir: Path) -> dict[int, str]:
    """Live processes that name `run_dir` in their command line or environment (the fork server and its
    children by their command line, the stubs and plain ranks by their environment), pid -> command line."""
    found, needle = {}, str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or needle in (entry / "environ").read_bytes():
                found[int(entry.name)] = cmdline(int(entry.name))
        except OSError:
            continue
    return found


def wait_until(what: str, done, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not done():
        assert time.time() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run with warm restarts off: fresh processes (`python -m trainer`)."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = finish(launch(run_dir, [*BASE, "fault.warm_restarts=false"]))
    assert "done: 0 restart(s)" in out and "warm restarts:" not in out, out[-3000:]
    assert next(e for e in read_events(run_dir) if e["event"] == "start")["warm_restarts"] is False
    return run_dir


def test_sigkilled_ranks_are_forked_warm_and_match_a_cold_uninterrupted_run(reference, tmp_path):
    """Two SIGKILLs (rank 1, then rank 0) with the memory tier on: every rank of every group is a child of
    the one fork server; each restarted rank's start-up (fork -> checkpoint load) is well under a cold
    start; losses and final parameters are bit-identical to the cold uninterrupted run."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, [*BASE, *memory(tmp_path)])
    servers = set()
    for step, rank in ((10, 1), (20, 0)):
        victim = wait_for_step(run_dir, step, rank=rank)
        servers.add(parent(victim.pid))
        os.kill(victim.pid, signal.SIGKILL)
    (server,) = servers  # the same template for the first group and the restarted one
    assert "launch.zygote" in cmdline(server) and server != proc.pid
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "warm restarts: ranks are forked from a process with torch and the trainer imported" in out

    events = read_events(run_dir)
    failures = [e for e in events if e["event"] == "failure"]
    assert [(f["rank"], f["signal"]) for f in failures] == [(1, "SIGKILL"), (0, "SIGKILL")], failures
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 2 and all(r["tier"] == "memory-local" and r["lost_steps"] <= 2 for r in resumes), resumes
    # A forked rank's whole start-up (join the group, build the model, load) beats a cold rank's imports alone.
    cold = cold_import_s()
    assert all(r["startup_s"] < cold for r in resumes), (cold, resumes)
    assert_same_run(run_dir, reference)
    assert not processes_of(run_dir), "processes outlived the run"


def test_a_sigstopped_forked_rank_is_found_hung_and_does_not_outlive_its_group(cache_dir, tmp_path):
    hang_timeout = 4.0
    proc = launch(tmp_path, ["train.steps=60", "checkpoint.every=10", f"fault.hang_timeout_s={hang_timeout}"])
    victim = wait_for_step(tmp_path, 10, rank=1)
    assert "launch.zygote" in cmdline(parent(victim.pid))
    stopped_at = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    wait_until("the hang noticed", lambda: any(e["event"] == "failure" for e in read_events(tmp_path)), 60)
    # Its stub was SIGKILLed with the group: the fork server SIGKILLs the stopped trainer and reaps it.
    wait_until("the stopped rank gone", lambda: not is_alive(victim.pid), 10)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    failure = next(e for e in read_events(tmp_path) if e["event"] == "failure")
    assert failure["cause"] == "hang" and failure["rank"] == 1 and "stopped" in failure["message"], failure
    assert failure["time"] - stopped_at <= hang_timeout + 2.0


def test_sigterm_to_every_process_preempts_through_the_stubs(cache_dir, tmp_path):
    """As Slurm does at a time limit: SIGTERM to the launcher, the stubs, the fork server and the ranks at
    once. The fork server ignores it (the ranks need it alive), the stubs pass it on, the ranks commit an
    emergency checkpoint of the step they reached and exit 75, and so does the launcher."""
    proc = launch(tmp_path, ["train.steps=400", "checkpoint.every=1000", "fault.preempt_grace_s=30"])
    beat = wait_for_step(tmp_path, 10)
    everyone = {pid: cmd for pid, cmd in processes_of(tmp_path).items() if pid != proc.pid}
    kinds = {pid: ("stub" if "stub.py" in cmd else "fork server" if "launch.zygote" in cmd and parent(pid) == proc.pid
                   else "rank") for pid, cmd in everyone.items()}
    assert sorted(kinds.values()) == ["fork server", "rank", "rank", "stub", "stub"], everyone
    for pid in [proc.pid, *everyone]:
        os.kill(pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert proc.returncode == 75, out[-4000:]
    events = read_events(tmp_path)
    commits = [e["step"] for e in events if e["event"] == "commit"]
    assert commits and commits[-1] >= beat.step, (commits, beat.step)
    assert events[-1]["outcome"] == "preempted" and events[-1]["committed_step"] == commits[-1]


def test_killing_the_launcher_leaves_no_process_behind(cache_dir, tmp_path):
    proc = launch(tmp_path, ["train.steps=100000", "checkpoint.every=1000", *memory(tmp_path)])
    wait_for_step(tmp_path, 3)
    before = processes_of(tmp_path)
    assert len(before) >= 5, before  # the fork server, two stubs, two ranks
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: the rest must follow it
    proc.wait(timeout=30)
    try:
        wait_until("no orphan", lambda: not processes_of(tmp_path), 15)
    finally:
        for pid in processes_of(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_a_fork_server_that_dies_is_started_again(cache_dir, tmp_path):
    """SIGKILL the fork server: its ranks die with it, the group fails and restarts, a new fork server is
    started for it, and the run completes with ranks forked from the new one."""
    proc = launch(tmp_path, ["train.steps=60", "checkpoint.every=10"])
    old = parent(wait_for_step(tmp_path, 10, rank=1).pid)
    os.kill(old, signal.SIGKILL)
    beat = wait_for_step(tmp_path, 25, timeout=120)
    new = parent(beat.pid)
    assert new != old and "launch.zygote" in cmdline(new) and parent(new) == proc.pid
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "the fork server for warm restarts had ended: started again" in out, out[-3000:]
    assert next(e for e in read_events(tmp_path) if e["event"] == "failure")["signal"] == "SIGKILL"


def test_with_warm_restarts_off_ranks_are_plain_trainer_processes(cache_dir, tmp_path):
    proc = launch(tmp_path, ["train.steps=60", "checkpoint.every=10", "fault.warm_restarts=false",
                             "fault.in_process=false"])
    victim = wait_for_step(tmp_path, 10, rank=1)
    assert parent(victim.pid) == proc.pid and "-m trainer" in cmdline(victim.pid)
    os.kill(victim.pid, signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "warm restarts" not in out and not any("launch.zygote" in c for c in processes_of(tmp_path).values())
    resume = next(e for e in read_events(tmp_path) if e["event"] == "resume")
    assert resume["startup_s"] > 0, resume
