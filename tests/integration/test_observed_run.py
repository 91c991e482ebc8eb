"""Observability of a real run: the step-time breakdown in metrics.jsonl and the summary (with its
cost line), TensorBoard scalars, a profiler trace, and the run plot (real metrics + a synthetic
launcher events ledger)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, read_metrics, run_trainer

OVERRIDES = ["train.steps=8", "train.log_every=2", "train.eval_every=4", "checkpoint.every=0",
             "log.tensorboard=true", "profile.steps=[3,4]", "log.cost_per_device_hour=3.6"]


@pytest.fixture(scope="module")
def run(cache_dir, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("observed")
    proc = run_trainer(run_dir, OVERRIDES)
    return run_dir, proc.stdout


def test_breakdown_in_metrics_adds_up_to_the_step_time(run):
    run_dir, _ = run
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [2, 4, 6, 8]
    for r in metrics.values():
        parts = [r["data_wait_s"], r["fwd_bwd_s"], r["optim_s"], r["other_s"]]
        assert all(p >= 0 for p in parts) and r["fwd_bwd_s"] > 0 and r["optim_s"] > 0
        assert "comm_wait_s" not in r  # one process: nothing to wait for
        assert sum(parts) == pytest.approx(r["step_time_s"], rel=1e-6, abs=1e-9) or (
            r["other_s"] == 0 and sum(parts) >= r["step_time_s"])
    # forward+backward is most of a plain step
    assert metrics[6]["fwd_bwd_s"] > metrics[6]["optim_s"]


def test_summary_prints_breakdown_and_cost(run):
    run_dir, stdout = run
    line = next(s for s in stdout.splitlines() if "time per step:" in s)
    assert "data " in line and "fwd/bwd " in line and "optim " in line and "comm" not in line
    cost = next(s for s in stdout.splitlines() if "] cost " in s)
    # 1 device at 3.6/h: cost = wall seconds / 1000; the per-M-tokens figure follows from 8 x 8 x 64 tokens
    wall = float(stdout.split("done: 8 steps in ")[1].split("s")[0])
    reported = float(cost.split("] cost ")[1].split()[0])
    assert reported == pytest.approx(wall / 1000, abs=0.06 / 1000)  # wall is printed to 0.1 s
    per_mtok = float(cost.split("| ")[1].split()[0])
    assert per_mtok == pytest.approx(reported / (8 * 8 * 64 / 1e6), rel=1e-3)


def test_tensorboard_event_file_has_the_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run
    files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss/train", "loss/eval", "train/lr", "perf/tokens_per_s", "perf/mfu", "time/fwd_bwd_s",
                "time/optim_s", "time/data_wait_s"):
        assert tag in tags, tag
    metrics = read_metrics(run_dir)
    losses = {e.step: e.value for e in acc.Scalars("loss/train")}
    assert sorted(losses) == [2, 4, 6, 8]
    assert losses[8] == pytest.approx(metrics[8]["loss"], rel=1e-6)
    assert [e.step for e in acc.Scalars("loss/eval")] == [4, 8]


def test_profiler_trace_covers_the_requested_steps(run):
    run_dir, stdout = run
    trace = run_dir / "profile" / "rank0-steps3-4.json"
    assert trace.exists(), stdout
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::mm" in names and any(str(n).startswith("Optimizer.step") for n in names)
    # two steps were profiled: two optimizer steps
    assert sum(str(e.get("name")).startswith("Optimizer.step#AdamW.step") for e in events) == 2


def test_plot_writes_png_with_failure_timeline(run, tmp_path):
    run_dir, _ = run
    metrics = read_metrics(run_dir)
    t = metrics[2]["time"]
    events = [
        {"event": "start", "time": t - 5},
        {"event": "commit", "step": 4, "time": metrics[4]["time"]},
        {"event": "failure", "time": metrics[4]["time"] + 0.1, "rank": 1, "cause": "signal", "exit_code": -9,
         "signal": 9},
        {"event": "restart", "n": 1, "time": metrics[4]["time"] + 0.2},
        {"event": "resume", "step": 4, "lost_steps": 0, "recovery_s": 7.5, "time": metrics[4]["time"] + 0.3},
        {"event": "done", "goodput": 0.9, "restarts": 1, "time": metrics[8]["time"] + 1},
    ]
    plotted = tmp_path / "run"
    plotted.mkdir()
    (plotted / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    (plotted / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n{\"torn")
    out = tmp_path / "out.png"
    proc = subprocess.run([sys.executable, "-m", "trainer.plot", str(plotted), "-o", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000

    from trainer.plot import lost_intervals, main

    assert lost_intervals(events) == [(events[2]["time"], events[4]["time"])]
    # without events.jsonl it still plots; without metrics it is an error
    (plotted / "events.jsonl").unlink()
    assert main([str(plotted)]) == 0 and (plotted / "run.png").stat().st_size > 20_000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 1


def test_a_resumed_run_has_each_step_once_in_tensorboard(cache_dir, tmp_path):
    """Steps 1-5 logged, step 4 committed, a crash at step 6: the resumed run redoes step 5, and
    TensorBoard shows each step once, with the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["train.steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=4",
                 "log.tensorboard=true"]
    from tests.helpers import child_env, trainer_cmd

    crashed = subprocess.run(trainer_cmd(1, Path(REPO) / "configs/smoke.yaml", [f"run.dir={tmp_path}", *overrides]),
                             cwd=REPO, env=child_env(REKINDLE_FAIL_AT="6"), capture_output=True, text=True,
                             timeout=180)
    assert crashed.returncode != 0 and sorted(read_metrics(tmp_path)) == [1, 2, 3, 4, 5]
    run_trainer(tmp_path, overrides)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("loss/train")]
    assert [step for step, _ in losses] == list(range(1, 9)), losses
    assert dict(losses)[5] == pytest.approx(read_metrics(tmp_path)[5]["loss"], rel=1e-6)
