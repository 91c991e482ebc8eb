"""Storage that stops answering, for real: the launcher trains with its checkpoints on a loopback S3
endpoint (moto's server) reached through a TCP proxy in a process of its own, which the test pauses
with SIGSTOP (connections are still accepted; nothing is ever answered) and resumes with SIGCONT.
Every wait is bounded."""

from __future__ import annotations

import os
import signal
import time

from tests.fixtures import TcpProxy
from tests.helpers import finish, launch, launcher_beats, wait_for
from trainer.runtime.protocol import read_events, read_jsonl

GRACE = 4  # fault.preempt_grace_s: each SIGTERM below, with storage that does not answer, takes all of it
BOUNDS = ["storage.timeout_s=2", "storage.stall_s=4", "fault.hang_timeout_s=60", f"fault.preempt_grace_s={GRACE}",
          "train.steps=40", "checkpoint.every=10", "fault.max_restarts=20"]


def sigterm_exit(proc, run_dir) -> int:
    """SIGTERM to the launcher: it must end within the grace period (GRACE s; a margin for this machine's
    load), writing its `done` record; returns its exit code."""
    os.kill(proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    out = finish(proc, timeout=60)
    assert time.monotonic() - signalled < GRACE + 4, out[-3000:]
    events = read_events(run_dir)
    done, preempt = events[-1], next(e for e in reversed(events) if e["event"] == "preempt")
    assert done["event"] == "done" and done["exit_code"] == proc.returncode, (done, out[-3000:])
    assert done["time"] - preempt["time"] < GRACE + 0.5, (preempt, done)  # the launcher's own clock: signal to done
    return proc.returncode


def test_storage_that_stops_answering_is_bounded_named_and_resumed_bit_identically(cache_dir, s3_bucket,
                                                                                    tmp_path):
    proxy = TcpProxy(int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    try:
        overrides = [*BOUNDS, f"checkpoint.dir={s3_bucket}/ckpt"]
        proc = launch(tmp_path, overrides, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        events = lambda: read_events(tmp_path)  # noqa: E731
        wait_for("the first commit", lambda: any(e["event"] == "commit" for e in events()), 90)
        proxy.pause()
        paused = time.monotonic()

        # A stalled save is reported as storage, naming the URL, within the bound (stall_s + a poll).
        wait_for("a storage failure", lambda: any(e["event"] == "failure" for e in events()), 40)
        failure = next(e for e in events() if e["event"] == "failure")
        assert failure["cause"] == "storage", failure
        assert "storage stalled" in failure["message"] and f"{s3_bucket}/ckpt" in failure["message"], failure
        assert time.monotonic() - paused < 30

        # Restarts block on the resume, each bounded by the same limit; the launcher goes on retrying.
        wait_for("a second storage failure", lambda: sum(e["event"] == "failure" for e in events()) >= 2, 60)
        assert all(e["cause"] == "storage" for e in events() if e["event"] == "failure")

        # SIGTERM while nothing has trained since the last commit: exit 75 within the grace period.
        assert sigterm_exit(proc, tmp_path) == 75

        # The endpoint answers again and a new launch trains on; it stops answering in a save, and a
        # SIGTERM now cannot be honoured with an emergency checkpoint: still exit 75 (requeueable) within the
        # grace period, saying that the next launch resumes from the last commit.
        proxy.resume()
        commits = sum(e["event"] == "commit" for e in events())
        second = launch(tmp_path, overrides, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        wait_for("a commit", lambda: sum(e["event"] == "commit" for e in events()) > commits, 90)
        committed = max(e["step"] for e in events() if e["event"] == "commit")
        proxy.pause()
        # The ranks train on to the next save, and stall in it: a heartbeat in phase `save` past the last commit
        # (a save's record keeps the step before it).
        wait_for("a rank in a save after the pause", lambda: any(
            b.phase == "save" and b.step >= committed for b in launcher_beats(tmp_path, second.pid)), 60,
            every=0.05)
        assert sigterm_exit(second, tmp_path) == 75
        outcome = events()[-1]["outcome"]
        assert "no emergency checkpoint of step" in outcome, outcome
        assert "the next launch resumes from the last commit" in outcome, outcome

        # The endpoint answers again: a new launch resumes and finishes; the redone steps are bit-identical.
        proxy.resume()
        again = launch(tmp_path, overrides, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        out = finish(again, timeout=150)
        assert again.returncode == 0, out[-4000:]
    finally:
        proxy.stop()
    first_loss: dict[int, float] = {}
    redone = 0
    for record in read_jsonl(tmp_path / "metrics.jsonl"):
        step, loss = record["step"], record.get("loss")
        if loss is None:
            continue
        if step in first_loss:
            assert loss == first_loss[step], (step, loss, first_loss[step])
            redone += 1
        first_loss[step] = loss
    assert redone > 0 and max(first_loss) == 40


def test_a_full_disk_fails_periodic_saves_without_ending_the_run(cache_dir, tmp_path):
    """The checkpoint directory is a real 8 MB tmpfs, nearly filled: periodic saves fail (ENOSPC) as
    warnings and `checkpoint_failed` events, leave no partial step behind, and training goes on; once
    space is freed the next save commits, and the run ends with its final checkpoint."""
    import subprocess

    import pytest

    from tests.helpers import REPO, SMOKE, child_env, trainer_cmd

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (7 << 20))  # about 1 MB left: less than one checkpoint (1.8 MB)
        run_dir = tmp_path / "run"
        proc = subprocess.Popen(
            trainer_cmd(1, SMOKE, [f"run.dir={run_dir}", f"checkpoint.dir={disk}/ck", "train.steps=200",
                                   "checkpoint.every=5", "checkpoint.max_failed_saves=1000", "log.progress=false",
                                   "train.eval_every=0"]),
            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for("a failed save", lambda: any(e["event"] == "checkpoint_failed" for e in read_events(run_dir)),
                     90)
            filler.unlink()
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, out[-3000:]
        events = read_events(run_dir)
        failed = [e["step"] for e in events if e["event"] == "checkpoint_failed"]
        commits = [e["step"] for e in events if e["event"] == "commit"]
        assert failed and "No space left on device" in next(e["error"] for e in events
                                                              if e["event"] == "checkpoint_failed")
        assert commits and min(commits) > max(failed) and commits[-1] == 200
        left = sorted(p.name for p in (disk / "ck").iterdir() if p.name.startswith("step-"))
        assert all((disk / "ck" / name / "COMMIT.json").exists() for name in left), left  # no partial step
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
