"""End-to-end training in real processes: python -m trainer and torchrun with 2 gloo ranks (FSDP2)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fixtures import free_port, kill_tree
from tests.helpers import REPO, SMOKE, child_env, read_metrics, run_trainer, trainer_cmd, wait_for
from trainer.runtime.protocol import read_events, read_heartbeats

STEPS = ["train.steps=12", "train.log_every=1", "train.eval_every=6", "checkpoint.every=6"]


@pytest.fixture(scope="module")
def single(cache_dir, tmp_path_factory) -> Path:
    """A reference run: 1 process, 12 steps, global batch 8 = 2 micro-batches of 4."""
    run_dir = tmp_path_factory.mktemp("single")
    run_trainer(run_dir, STEPS)
    return run_dir


def test_single_process_run_writes_metrics_config_and_checkpoints(single):
    metrics = read_metrics(single)
    assert sorted(metrics) == list(range(1, 13))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_mb", "data_wait_s"):
        assert key in metrics[12]
    assert "eval_loss" in metrics[6] and "eval_loss" in metrics[12]
    assert 0 < metrics[12]["mfu"] < 1.5 and metrics[12]["tokens_per_s"] > 0
    assert (single / "config.yaml").read_text().count("steps: 12") == 1
    steps = sorted(p.name for p in (single / "checkpoints").iterdir())
    assert steps == ["step-00000006", "step-00000012"]
    for step in steps:
        assert (single / "checkpoints" / step / "COMMIT.json").exists()
        state = json.loads((single / "checkpoints" / step / "train_state.json").read_text())
        assert state["step"] == int(step[-8:]) and state["data"]["samples_consumed"] == 8 * state["step"]


def test_two_ranks_fsdp_match_one_process(single, tmp_path):
    """Same global batch (8): 2 ranks x 1 micro-batch of 4 vs 1 process x 2 micro-batches of 4."""
    proc = run_trainer(tmp_path, STEPS, nproc=2)
    assert "world 2 (gloo" in proc.stdout
    one, two = read_metrics(single), read_metrics(tmp_path)
    assert sorted(two) == sorted(one)
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=2e-4), step
    assert two[12]["eval_loss"] == pytest.approx(one[12]["eval_loss"], abs=2e-4)


def test_loss_goes_down_on_the_smoke_config(cache_dir, tmp_path):
    run_trainer(tmp_path, ["train.steps=60", "train.log_every=5", "train.eval_every=0", "checkpoint.every=0"])
    metrics = read_metrics(tmp_path)
    assert metrics[60]["loss"] < metrics[5]["loss"] - 0.5
    assert metrics[60]["eval_loss"] < 6.0


@pytest.mark.parametrize("no_eval", ["data.val_fraction=0", "train.eval_batches=0"])
def test_run_without_evaluation_completes_and_commits_its_last_step(cache_dir, tmp_path, no_eval):
    proc = run_trainer(tmp_path, ["train.steps=4", "train.log_every=1", "train.eval_every=2", "checkpoint.every=2",
                                  no_eval])
    assert "no evaluation" in proc.stdout
    assert not any("eval_loss" in r for r in read_metrics(tmp_path).values())
    assert (tmp_path / "checkpoints" / "step-00000004" / "COMMIT.json").exists()
    if no_eval.startswith("data."):  # resuming with another held-out share: refused in one clear line
        again = run_trainer(tmp_path, ["train.steps=6", "checkpoint.every=2"], check=False)
        assert again.returncode == 2 and "Traceback" not in again.stderr  # bad input: not worth a restart
        assert "a resume may not change (data.val_fraction: 0.0 -> 0.01)" in again.stderr


def test_killed_run_resumes_from_last_checkpoint_bit_identical(cache_dir, tmp_path):
    """SIGKILL the trainer right after its first checkpoint commits; a second start resumes from it
    and produces exactly the losses of an uninterrupted run."""
    # 100 steps: the kill lands a step or two after step 10 (polled every 20 ms); 90 steps to spare. The
    # durable tier alone: a memory snapshot of the step or two after 10 would otherwise be resumed from.
    overrides = ["train.steps=100", "train.log_every=1", "train.eval_every=0", "checkpoint.every=10",
                 "checkpoint.keep=50", "checkpoint.memory_every=0", "log.progress=false"]
    reference = tmp_path / "reference"
    run_trainer(reference, overrides)

    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(trainer_cmd(1, SMOKE, [f"run.dir={crashed}", *overrides]), cwd=REPO,
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    commit = crashed / "checkpoints" / "step-00000010" / "COMMIT.json"
    deadline = time.monotonic() + 120
    while not commit.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    before = read_metrics(crashed)
    assert max(before) < 100

    second = run_trainer(crashed, overrides)
    resumed_from = int(second.stdout.split("resumed from step ")[1].split()[0])
    assert resumed_from >= 10 and resumed_from % 10 == 0
    ref, after = read_metrics(reference), read_metrics(crashed)
    assert sorted(after) == list(range(1, 101))
    assert [after[s]["loss"] for s in after] == [ref[s]["loss"] for s in ref]


def test_torchrun_smoke_config_end_to_end(cache_dir, tmp_path):
    """The CLI contract: `torchrun --nproc-per-node 2 -m trainer configs/smoke.yaml` as a user types it."""
    run_trainer(tmp_path, [], nproc=2)
    metrics = read_metrics(tmp_path)
    assert max(metrics) == 40 and all(r["loss"] > 0 for r in metrics.values())


def test_collectives_wait_dist_timeout_in_the_first_step_and_fault_collective_timeout_after_it(cache_dir, tmp_path):
    """Start-up is slow and uneven, so the first step's collectives wait dist.timeout_s; from the second step
    on they wait fault.collective_timeout_s (trainer.loop.start_up_over), so that a rank stuck mid-step fails
    its peers within seconds, under plain torchrun too. Rank 1 stalls 3 s in step 1 and again in step 2,
    with a collective timeout of 2 s: step 1 completes, step 2 fails on the timeout."""
    opts = [f"run.dir={tmp_path}", "log.progress=false", "train.steps=3", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=0", "checkpoint.memory_every=0", "dist.timeout_s=60", "fault.collective_timeout_s=2"]
    proc = subprocess.run(trainer_cmd(2, SMOKE, opts), cwd=REPO, env=child_env(REKINDLE_SLOW_RANK="1:3@1-2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Timed out waiting 2000ms" in proc.stderr, proc.stderr[-3000:]
    assert sorted(read_metrics(tmp_path)) == [1], proc.stdout[-2000:]


def test_non_finite_steps_are_skipped_then_abort_with_clear_error(cache_dir, tmp_path):
    """An absurd learning rate blows the weights up after one step: every later gradient is NaN."""
    proc = run_trainer(tmp_path, ["train.lr=1e30", "train.min_lr=0", "train.grad_clip=0", "train.warmup_steps=0",
                                  "train.log_every=1", "train.max_bad_steps=3"], check=False)
    assert proc.returncode == 1
    assert "error: 3 steps in a row had a non-finite loss or gradient (last at step 4)" in proc.stderr
    metrics = read_metrics(tmp_path)
    assert metrics[1]["skipped_steps"] == 0 and metrics[3]["skipped_steps"] == 2
    assert not list((tmp_path / "checkpoints").glob("step-*"))  # nothing bad was saved
    # Each was replayed first (trainer.health): the same again, so the data's, and skipped.
    found = [e for e in read_events(tmp_path) if e["event"] == "verdict"]
    assert [(e["kind"], e["step"]) for e in found] == [("data", 2), ("data", 3), ("data", 4)], found
    assert all(e["evidence"].startswith("non-finite") for e in found), found


def test_resume_refuses_a_changed_model_and_lists_allowed_changes(cache_dir, tmp_path):
    """The checkpoint records the config it was trained with: a resume that changes the model (a RoPE
    base that would load without complaint, a width that would fail in DCP) or the data order stops
    before loading, names each key with both values and exits 2 (bad input: the launcher does not
    restart it); a change a resume may make (the step count, the schedule) is listed in the log and the
    ledger, and the run resumes."""
    run_trainer(tmp_path, ["train.steps=2", "checkpoint.every=2"])
    # Two refused resumes: changes that would load without complaint (each named, keys in order), and
    # alone the width, which would fail in DCP: refused before loading all the same.
    for changes, listed in ((["model.rope_theta=500000.0", "data.seed=7"],
                             "data.seed: 1234 -> 7; model.rope_theta: 10000.0 -> 500000.0"),
                            (["model.dim=32"], "model.dim: 64 -> 32")):
        proc = run_trainer(tmp_path, ["train.steps=4", *changes], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "a resume may not change (" + listed + ")" in proc.stderr
    proc = run_trainer(tmp_path, ["train.steps=4", "train.lr=0.002"])
    assert "resumed from step 2" in proc.stdout
    assert ("settings changed since that checkpoint: checkpoint.every 2 -> 20, train.lr 0.003 -> 0.002, "
            "train.steps 2 -> 4") in proc.stdout
    changed = [e for e in read_events(tmp_path) if e["event"] == "config_changed"]
    assert changed == [{**changed[0], "step": 2, "changes": {
        "checkpoint.every": [2, 20], "train.lr": [0.003, 0.002], "train.steps": [2, 4]}}]


def test_a_rank_whose_peer_died_exits_in_one_line_under_a_launcher_that_does_not_recover(cache_dir, tmp_path):
    """Two ranks started by hand (no agent to stop the survivor first), rank 1 SIGKILLed mid-run: rank 0's
    collective fails, and rank 0 exits 1 saying a peer is gone, without a traceback that would bury the
    dead rank's own story (its error still reaches torchelastic's error file through record())."""
    beats, port = tmp_path / "beats", free_port()
    opts = [f"run.dir={tmp_path / 'run'}", "log.progress=false", "train.steps=400", "train.eval_every=0",
            "checkpoint.every=0", "checkpoint.memory_every=0"]
    procs = [subprocess.Popen(trainer_cmd(1, SMOKE, opts), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=child_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                            REKINDLE_HEARTBEAT_DIR=str(beats)))
             for r in (0, 1)]
    try:
        wait_for("rank 1 at step 3", lambda: (b := read_heartbeats(beats).get(1)) and b.step >= 3, timeout=90)
        procs[1].send_signal(signal.SIGKILL)
        _, stderr = procs[0].communicate(timeout=60)
    finally:
        for proc in procs:
            kill_tree(proc.pid)
    assert procs[0].returncode == 1, stderr[-3000:]
    assert "[rekindle] a peer rank is gone (" in stderr and "Traceback" not in stderr, stderr[-3000:]
