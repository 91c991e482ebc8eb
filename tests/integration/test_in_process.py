"""In-process recovery (fault.in_process, trainer.recovery, launch.recovery) under real faults, 4 gloo
ranks under `python -m launch`: a SIGKILLed rank, then a SIGSTOPped one (killed by the watchdog), then
a SIGKILLed one while another is frozen (it never notices the failure: the launcher replaces it too), are
replaced while the other ranks keep their processes, and the run stays bit-identical to an
uninterrupted one; a second failure during a recovery falls back to a full restart, recorded with its
reason; a SIGTERM during a recovery (2 ranks) exits 75 at once and loses nothing. The real trainer
processes (their heartbeat pids) get the signals; every wait is bounded."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import finish, launch, wait_for_step
from tests.integration.test_memory_tier import assert_same_run
from tests.integration.test_warm_restarts import processes_of
from trainer.runtime.protocol import read_events, read_heartbeats

RANKS = 4
STEPS = 40
BASE = [f"train.steps={STEPS}", "checkpoint.every=100", "checkpoint.memory_every=1"]


def start(run_dir: Path, tmp_path: Path, extra: list[str] = ()):
    return launch(run_dir, [*BASE, f"checkpoint.memory_dir={tmp_path / 'shm'}", *extra], nproc=RANKS)


def pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the trainer process, from the heartbeats."""
    directory = next(run_dir.glob("heartbeats-*"))
    return {rank: beat.pid for rank, beat in read_heartbeats(directory).items()}


def wait_for_event(run_dir: Path, name: str, timeout: float = 60, count: int = 1) -> dict:
    """The `count`-th `name` event of the ledger (bounded wait)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in read_events(run_dir) if e["event"] == name]
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.01)
    raise AssertionError(f"no {count} {name} event(s) within {timeout:.0f}s")


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == name]


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    """An uninterrupted 4-rank run."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = finish(start(run_dir, run_dir))
    assert "done: 0 restart(s)" in out, out[-3000:]
    return run_dir


def test_a_sigkilled_rank_then_a_sigstopped_one_are_replaced_alone_and_the_others_keep_their_processes(
        reference, tmp_path):
    """Rank 1 SIGKILLed at step 8, then rank 2 SIGSTOPped (a hang: the watchdog SIGKILLs it alone) 12 or
    more steps after that recovery, then rank 3 SIGKILLed while rank 1 is frozen (it never notices: it is
    replaced too, with any rank its failure never reached): each time only those ranks get a new process,
    the others keep theirs; nothing is lost, the run is bit-identical to an uninterrupted one, and the cost
    summary counts the time lost to the failures."""
    hang_timeout = 3.0
    run_dir = tmp_path / "run"
    proc = start(run_dir, tmp_path, [f"fault.hang_timeout_s={hang_timeout}", "log.cost_per_device_hour=3.0"])
    victim = wait_for_step(run_dir, 8, rank=1)
    before = pids(run_dir)
    os.kill(victim.pid, signal.SIGKILL)
    hung = wait_for_step(run_dir, 20, rank=2)  # reached only after the recovery
    middle = pids(run_dir)
    stopped_at = time.time()
    os.kill(hung.pid, signal.SIGSTOP)
    wait_for_event(run_dir, "in_process_done", timeout=60, count=2)
    after = pids(run_dir)
    # Rank 1 frozen and rank 3 SIGKILLed together: rank 1 never notices, nor may the rank whose receive
    # waits on it (gloo fails only the operations of the connection that broke); UNAWARE_S after the
    # failure the launcher kills such ranks too and starts them again with rank 3.
    wait_for_step(run_dir, 30, rank=1)
    os.kill(after[1], signal.SIGSTOP)
    os.kill(after[3], signal.SIGKILL)
    wait_for_event(run_dir, "in_process_done", timeout=60, count=3)
    last = pids(run_dir)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]

    # Each time the failed rank gets a new process, and so does any survivor its failure never reached
    # (ledger: in_process_unaware; killed after UNAWARE_S, which the watch threads make rare), the others
    # keep theirs. The frozen rank 1 is one of those at the third failure, always.
    said = "\n".join(line for line in out.splitlines() if "[launch]" in line or "noticed the failure" in line)
    unaware = [(e["generation"], e["rank"]) for e in events(run_dir, "in_process_unaware")]
    replaced = []
    for generation, (victim, old, new) in enumerate(((1, before, middle), (2, middle, after), (3, after, last)), 1):
        gone = sorted({victim, *(r for g, r in unaware if g == generation)})
        assert all((new[r] != old[r]) == (r in gone) for r in range(RANKS)), (old, new, gone, said)
        replaced.append(gone)
    assert 1 in replaced[2] and sum(len(gone) - 1 for gone in replaced[:2]) <= 1, (replaced, said)  # rare
    kill, hang, _ = events(run_dir, "failure")
    assert (kill["rank"], kill["signal"], kill["path"]) == (1, "SIGKILL", "in-process"), kill
    assert (hang["rank"], hang["cause"], hang["path"]) == (2, "hang", "in-process"), hang
    assert "stopped" in hang["message"], hang
    assert hang["time"] - stopped_at <= hang_timeout + 3.0, hang
    resumes = events(run_dir, "resume")
    # (A kill that lands while a snapshot is written redoes one more step, as any resume does.)
    assert [(r["path"], r["replaced"], r["tier"]) for r in resumes] == \
        [("in-process", gone, "memory-local") for gone in replaced], resumes
    assert all(r["lost_steps"] <= 1 for r in resumes), resumes
    for resume in resumes:
        parts = [resume[k] for k in ("leave_s", "wait_s", "reform_s", "restore_s", "first_step_s")]
        assert all(p >= 0 for p in parts) and sum(parts) <= resume["recovery_s"] + 0.01, resume
    kept = [sorted(e["kept_pids"]) for e in events(run_dir, "in_process_done")]
    assert kept == [sorted(old[r] for r in range(RANKS) if r not in gone)
                    for old, gone in zip((before, middle, after), replaced, strict=True)], kept
    assert "restarting the failed rank(s) alone" in out and "restarting the worker group" not in out
    done = read_events(run_dir)[-1]
    assert done["event"] == "done" and done["restarts"] == 3, done
    assert done["cost"]["devices"] == RANKS and 0 < done["cost"]["lost_share"] < 1, done["cost"]
    assert "lost to failures/restarts" in out
    assert_same_run(run_dir, reference)


def test_a_second_failure_during_the_recovery_falls_back_to_a_full_restart(reference, tmp_path):
    """Rank 2 is SIGKILLed as soon as the launcher has noticed rank 1's death, while the survivors wait
    for rank 1's replacement: the launcher gives up the in-process path, says why in the ledger, and
    restarts the whole group, still losing nothing. (Rank 2 is SIGSTOPped first, so that the recovery
    waits for it: the second failure has UNAWARE_S, 2 s, to land within it, not the recovery's fraction of a
    second.)"""
    run_dir = tmp_path / "run"
    proc = start(run_dir, tmp_path)
    victim = wait_for_step(run_dir, 10, rank=1)
    second = pids(run_dir)[2]
    os.kill(second, signal.SIGSTOP)
    os.kill(victim.pid, signal.SIGKILL)
    wait_for_event(run_dir, "failure")
    os.kill(second, signal.SIGKILL)
    fallback = wait_for_event(run_dir, "in_process_fallback")
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert fallback["rank"] == 2 and "second failure" in fallback["why"], fallback
    paths = [(f["rank"], f["path"]) for f in events(run_dir, "failure")]
    assert paths == [(1, "in-process"), (2, "restart")], paths
    (resume,) = events(run_dir, "resume")
    assert resume["path"] == "restart" and resume["lost_steps"] <= 1, resume
    assert "restarting the whole worker group" in out
    assert_same_run(run_dir, reference)


def test_sigterm_during_a_recovery_exits_75_at_once_and_the_next_launch_resumes_from_memory(cache_dir, tmp_path):
    """SIGTERM to the launcher right after a rank's death is noticed: whether it lands while the survivor
    waits for the replacement (no group to commit an emergency checkpoint with: it exits 75 at once) or
    just after, the launcher exits 75 within seconds, and the next launch resumes from the memory snapshot (or
    from the emergency checkpoint committed when the signal came after the recovery)."""
    run_dir = tmp_path / "run"
    overrides = ["train.steps=20", "checkpoint.every=100", "checkpoint.memory_every=1",
                 f"checkpoint.memory_dir={tmp_path / 'shm'}", "fault.preempt_grace_s=30"]
    proc = launch(run_dir, overrides)
    victim = wait_for_step(run_dir, 10, rank=1)
    os.kill(victim.pid, signal.SIGKILL)
    wait_for_event(run_dir, "failure")
    signalled = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 75 and time.time() - signalled < 10, out[-4000:]
    assert not processes_of(run_dir), "processes outlived the launcher"
    again = launch(run_dir, overrides)
    out = finish(again)
    assert again.returncode == 0, out[-4000:]
    resumed = int(out.split("resumed from step ")[1].split()[0])
    line = out.split("resumed from step ")[1].splitlines()[0]
    # From the memory snapshot; or, when the signal came just after the recovery, from the emergency
    # checkpoint the ranks then committed (the snapshot of that step is no newer: the durable one is used).
    assert resumed >= 9 and ("memory snapshot" in line or "saved by 2 rank(s)" in line), out[-3000:]
