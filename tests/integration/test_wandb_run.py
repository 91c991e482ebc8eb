"""W&B logging of a real run, offline (no network), read back from wandb's own files: a run that
crashes at step 6 and resumes from its step-4 checkpoint has in W&B the scalars TensorBoard has, at
the same steps, each step once."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import (
    REPO,
    SMOKE,
    child_env,
    read_metrics,
    run_trainer,
    trainer_cmd,
    wandb_offline_env,
    wandb_offline_runs,
)

OVERRIDES = ["train.steps=8", "train.log_every=1", "train.eval_every=4", "checkpoint.every=4",
             "log.tensorboard=true", "log.wandb=true", "log.wandb_mode=offline"]


def test_a_resumed_run_has_tensorboards_scalars_in_wandb_each_step_once(cache_dir, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for key, value in wandb_offline_env(tmp_path).items():  # the trainer's processes inherit them
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    run_dir = tmp_path / "run"
    crashed = subprocess.run(trainer_cmd(1, SMOKE, [f"run.dir={run_dir}", "log.progress=false", *OVERRIDES]),
                             cwd=REPO, env=child_env(REKINDLE_FAIL_AT="6"), capture_output=True, text=True,
                             timeout=180)
    assert crashed.returncode != 0 and sorted(read_metrics(run_dir)) == [1, 2, 3, 4, 5], crashed.stderr
    resumed = run_trainer(run_dir, OVERRIDES)
    assert "steps up to 5 were logged before" in resumed.stdout

    (first_id, first), (second_id, second) = wandb_offline_runs(run_dir)  # one offline run per attempt
    assert first_id == second_id == json.loads((run_dir / "wandb" / "rekindle-run.json").read_text())["id"]
    assert [step for step, _ in first] == [1, 2, 3, 4, 5] and [step for step, _ in second] == [6, 7, 8]
    wandb = {(key, step): value for step, row in first + second for key, value in row.items()}

    tb = EventAccumulator(str(run_dir / "tb"))
    tb.Reload()
    tensorboard = {(tag, e.step): e.value for tag in tb.Tags()["scalars"] for e in tb.Scalars(tag)}
    assert {"loss/train", "loss/eval", "train/lr", "perf/tokens_per_s", "time/fwd_bwd_s"} <= {k for k, _ in wandb}
    assert sorted(wandb) == sorted(tensorboard)  # the same names at the same steps
    assert [step for key, step in sorted(wandb) if key == "loss/eval"] == [4, 8]
    # the same values, but at the step both attempts did: W&B keeps the crashed attempt's (TensorBoard
    # purged it); float32 in TensorBoard
    for (key, step), value in wandb.items():
        if step != 5:
            assert value == pytest.approx(tensorboard[key, step], rel=1e-6), (key, step)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert wandb["loss/train", 5] == next(r["loss"] for r in lines if r["step"] == 5)  # the first step 5
