"""The memory tier (checkpoint.memory_every): a SIGKILLed rank resumes from the node-local snapshot of
the last step or the one before it, bit-identical to an uninterrupted run; a lost node (launcher killed,
memory deleted) from the peer copies on the other node; a corrupt snapshot, one of
another config or of another run is never loaded (the newest good one every rank has is, else the
durable checkpoint), and the log says why; the run's snapshots are removed when it ends. Real
processes, real kills, real files; every wait bounded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, child_env, free_port, read_metrics, trainer_cmd
from tests.integration.test_launch_faults import finish, launch, load_final, wait_for_step
from trainer.protocol import read_events, read_jsonl

STEPS = 30
BASE = [f"train.steps={STEPS}", "checkpoint.every=50"]  # durable: only the final step


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank launcher run, memory tier off."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = finish(launch(run_dir, BASE))
    assert "done: 0 restart(s)" in out, out[-3000:]
    return run_dir


def assert_same_run(ours: Path, reference: Path, steps: int = STEPS) -> None:
    mine, theirs = read_metrics(ours), read_metrics(reference)
    assert [mine[s]["loss"] for s in range(1, steps + 1)] == [theirs[s]["loss"] for s in range(1, steps + 1)]
    a, b = load_final(ours), load_final(reference)
    assert a["step"] == b["step"] == steps
    for name in b:
        assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name


def test_a_sigkilled_rank_resumes_from_memory_and_matches_an_uninterrupted_run(reference, tmp_path):
    shm = tmp_path / "shm"
    run_dir = tmp_path / "run"
    proc = launch(run_dir, [*BASE, "checkpoint.memory_every=1", f"checkpoint.memory_dir={shm}"])
    victim = wait_for_step(run_dir, 15, rank=1)
    os.kill(victim["pid"], signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    resume = next(e for e in read_events(run_dir) if e["event"] == "resume")
    assert resume["tier"] == "memory-local", resume
    assert resume["lost_steps"] <= 2 and resume["step"] >= 14, resume
    assert resume["tier_why"].startswith(f"memory snapshot of step {resume['step']} is newer than"), resume
    # The records not yet written when the snapshot was taken came back with it: each step up to the
    # resumed one is in metrics.jsonl once (the steps after it are redone and logged again).
    logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert [logged.count(s) for s in range(1, resume["step"] + 1)] == [1] * resume["step"], logged
    assert f"resumed at step {resume['step']} from the memory-local tier" in out
    assert "s (memory-local)" in out, out[-2000:]  # the summary line: recovery 1.2s (memory-local)
    assert_same_run(run_dir, reference)
    assert not any(shm.iterdir()), "the run's snapshots outlived it"


def test_a_lost_node_resumes_from_the_copies_on_the_other_node(reference, tmp_path):
    """Two launchers on loopback, one node each, each with its own memory directory: SIGKILL one launcher
    (its rank dies with it) and delete its memory (a lost node); a replacement node joins, and the
    parts come from the surviving node's peer copies: bit-identical to the uninterrupted run."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=peers"]
    run_dir, memory = tmp_path / "run", {node: tmp_path / f"shm-{node}" for node in "ab"}

    def node(name: str) -> subprocess.Popen:
        return launch(run_dir, [*BASE, "checkpoint.memory_every=1", f"checkpoint.memory_dir={memory[name]}"],
                      nproc=1, extra_args=args)

    host = node("a")
    time.sleep(1.0)  # the first launcher hosts the rendezvous store
    guest = node("b")
    wait_for_step(run_dir, 15)
    assert any(memory["a"].rglob("peer-slot-*.json")) and any(memory["b"].rglob("peer-slot-*.json"))
    os.killpg(guest.pid, signal.SIGKILL)
    guest.wait(timeout=30)
    shutil.rmtree(memory["b"])
    replacement = node("b")
    outs = [finish(host), finish(replacement)]
    for proc, out in zip((host, replacement), outs, strict=True):
        assert proc.returncode == 0, out[-4000:]
    resume = next(e for e in read_events(run_dir) if e["event"] == "resume")
    assert resume["tier"] == "memory-peer" and resume["lost_steps"] <= 2, resume
    assert "sent by the rank(s) holding them" in "".join(outs)
    assert_same_run(run_dir, reference)
    assert not any(memory["a"].iterdir()) and not any(memory["b"].iterdir())


def train(run_dir: Path, overrides: list[str], fail_at: int | None = None, nproc: int = 2) -> str:
    """`nproc` ranks without the launcher; with `fail_at`, REKINDLE_FAIL_AT stops them before that step
    (their snapshots stay). Returns the output."""
    env = child_env(**({"REKINDLE_FAIL_AT": str(fail_at)} if fail_at else {}))
    proc = subprocess.run(trainer_cmd(nproc, REPO / "configs/smoke.yaml",
                                      [f"run.dir={run_dir}", "log.progress=false", "train.log_every=1",
                                       "train.eval_every=0", *overrides]),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    if fail_at:
        assert proc.returncode != 0 and f"injected failure at step {fail_at}" in out, out[-3000:]
    else:
        assert proc.returncode == 0, out[-3000:]
    return out


def snapshot_steps(shm: Path, rank: int) -> dict[int, Path]:
    out = {}
    for head in shm.rglob(f"slot-*.rank-{rank}.json"):
        out[json.loads(head.read_text())["step"]] = head.with_suffix(".bin")
    return out


def test_bad_snapshots_are_never_loaded_and_the_log_says_why(reference, tmp_path):
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    opts = [*BASE, "checkpoint.every=5", "checkpoint.memory_every=1", f"checkpoint.memory_dir={shm}"]
    train(run_dir, opts, fail_at=13)
    assert sorted(snapshot_steps(shm, 0)) == sorted(snapshot_steps(shm, 1)) == [10, 11, 12]

    # A flipped byte in rank 1's newest part: step 11 is the newest that every rank has.
    newest = snapshot_steps(shm, 1)[12]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    out = train(run_dir, opts, fail_at=17)
    assert "fails its checksum" in out and "resumed from step 11 (memory snapshot" in out, out[-3000:]
    mine, theirs = read_metrics(run_dir), read_metrics(reference)
    assert [mine[s]["loss"] for s in range(1, 16)] == [theirs[s]["loss"] for s in range(1, 16)]

    # Another config (train.lr): its snapshots (steps 14-16) are not loaded; the durable step 15 is.
    out = train(run_dir, [*opts, "train.lr=0.002"], fail_at=21)
    assert "written with another config" in out and "resumed from step 15 (" in out, out[-3000:]
    assert "memory tier not used: no memory snapshot that every rank has" in out, out[-3000:]

    # Another world size: the 2-rank snapshots (steps 18-20) are passed over, the durable step 20 loaded.
    out = train(run_dir, [*opts, "train.lr=0.002"], fail_at=22, nproc=1)
    assert "memory tier not used: no memory snapshot that every rank has (on rank 0's node: world 2, this " \
           "run's is 1)" in out and "resumed from step 20 (" in out, out[-3000:]

    # Another run under the same run.dir name (made afresh): its snapshots are not this run's.
    (run_dir / "memory-tier.json").unlink()
    out = train(run_dir, [*opts, "train.lr=0.002"])
    assert "removed the memory snapshots of an earlier run" in out and "resumed from step 20 (" in out, out[-3000:]
    assert not any(shm.iterdir()), "the run's snapshots outlived it"


def test_memory_tier_off_writes_no_snapshot(cache_dir, tmp_path):
    """The default (memory_every=0) is the durable tier alone: no snapshot, no run id file."""
    shm = tmp_path / "shm"
    train(tmp_path / "run", ["train.steps=6", "checkpoint.every=2", f"checkpoint.memory_dir={shm}"], fail_at=4)
    assert not shm.exists() and not (tmp_path / "run" / "memory-tier.json").exists()
