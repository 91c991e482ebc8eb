"""What the step checks (trainer.health) cost and find, on 2 ranks (torchrun, gloo), in one run:

    python scripts/bench_health.py [--configs configs/smoke.yaml:2000,configs/default.yaml:600] [--every 100]

1. a bit flip -> its verdict: one gradient bit of rank 1 flipped in step S's first computation
   (REKINDLE_FLIP_GRAD), S a spot-check step (fault.verify_every=V): the verdict comes within that step,
   after three more computations (the replay, each rank's micro-batches computed elsewhere, a second
   replay); the step's time against the run's median step. A flip in another step waits for the next spot
   check: up to V steps more.
   1b. on 3 ranks, a rank wrong the same way every time from step S (REKINDLE_WRONG_RANK: its replay
   agrees): the verdict (faulty, from its micro-batches computed elsewhere) against the median step.
2. a rollback and skip: a poisoned stretch of data (REKINDLE_POISON) spanning three steps after the
   anomaly window: each is found anomalous, replayed once and computed elsewhere, and skipped (its update
   not applied); each such step's time against the median, and the samples skipped.
3. the anomaly rule's false positives on clean runs of the shipped configs (`--configs`, each `config:steps`):
   `data` verdicts on clean data, per judged step.

Spot checks' cost at their default: scripts/bench.py (section 6c)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import child_env, read_metrics, trainer_cmd  # noqa: E402
from trainer import config as config_  # noqa: E402
from trainer.runtime.protocol import read_events  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="configs/smoke.yaml:2000,configs/default.yaml:600",
                    help="the clean runs, config:steps (3.)")
    ap.add_argument("--every", type=int, default=100, help="fault.verify_every of the flip run (1.)")
    return ap.parse_args()


def train(run_dir: Path, config: str, overrides: list[str], env: dict | None = None, nproc: int = 2,
          fails: bool = False) -> float:
    """A run to its end (`fails`: one that must end with an error); its wall time."""
    args = [f"run.dir={run_dir}", "log.progress=false", "train.log_every=1", "train.eval_every=0",
            "checkpoint.memory_every=0", "checkpoint.every=100000", *overrides]
    started = time.monotonic()
    proc = subprocess.run(trainer_cmd(nproc, REPO / config, args), cwd=REPO, env=child_env(**(env or {})),
                          capture_output=True, text=True, timeout=3600)
    if (proc.returncode != 0) != fails:
        raise RuntimeError(f"{config} {overrides} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return time.monotonic() - started


def step_times(run_dir: Path) -> dict[int, float]:
    return {s: r["step_time_s"] for s, r in read_metrics(run_dir).items()}


def verdicts(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "verdict"]


def flip(tmp: Path, every: int) -> None:
    steps, at = 3 * every, 2 * every
    run_dir = tmp / "flip"
    train(run_dir, "configs/smoke.yaml", [f"train.steps={steps}", f"fault.verify_every={every}"],
          {"REKINDLE_FLIP_GRAD": f"1@{at}"})
    times = step_times(run_dir)
    median = statistics.median(times[s] for s in times if s % every)
    spot = statistics.median(times[s] for s in times if s % every == 0 and s != at)
    found = verdicts(run_dir)
    print(f"\n## 1. a bit flip -> its verdict (configs/smoke.yaml, 2 ranks, fault.verify_every={every}, flip at step "
          f"{at})")
    print(f"verdicts: {[(e['kind'], e['step'], e['ranks']) for e in found]}")
    print(f"the flipped step {times[at]:.3f} s (the verdict at its end: its computation, two replays and one "
          f"elsewhere); a "
          f"spot check that agrees {spot:.3f} s (one replay); a step {median:.3f} s (median)")
    print(f"flip -> verdict: {times[at]:.3f} s when the flip is in a spot-checked step; up to {every} steps "
          f"({every * median:.1f} s at this step time) more when it is in another")


def wrong(tmp: Path) -> None:
    cfg = config_.load(REPO / "configs/smoke.yaml")
    at, run_dir = cfg.fault.anomaly_window + 20, tmp / "wrong"
    train(run_dir, "configs/smoke.yaml", [f"train.steps={at + 5}", "train.global_batch=12", "train.micro_batch=2",
                                          "fault.verify_every=0"], {"REKINDLE_WRONG_RANK": f"2@{at}"}, nproc=3,
          fails=True)
    metrics, found = read_metrics(run_dir), verdicts(run_dir)
    median = statistics.median(r["step_time_s"] for s, r in metrics.items() if s > 5)
    # The records of the last steps before the rank ended may not be written (they are gathered a step late).
    last = max(s for s in metrics if s < at)
    since = found[0]["time"] - metrics[last]["time"] if found else float("nan")
    took = since - (at - 1 - last) * median
    print(f"\n## 1b. a rank wrong the same way every time (configs/smoke.yaml, 3 ranks, rank 2 from step {at})")
    print(f"verdicts: {[(e['kind'], e['step'], e['ranks']) for e in found]}")
    print(f"from the end of step {last} (the last one logged) to the verdict {since:.3f} s; less {at - 1 - last} "
          f"median step(s): its first wrong step to the verdict {took:.3f} s (its computation, a replay that "
          f"agrees, each rank's micro-batches computed elsewhere) against a step {median:.3f} s: {took / median:.2f}x")


def poison(tmp: Path) -> None:
    cfg = config_.load(REPO / "configs/smoke.yaml")
    batch, first = cfg.train.global_batch, cfg.fault.anomaly_window + 20
    run_dir = tmp / "poison"
    train(run_dir, "configs/smoke.yaml", [f"train.steps={first + 30}"],
          {"REKINDLE_POISON": f"{(first - 1) * batch}-{(first + 2) * batch - 1}"})
    times = step_times(run_dir)
    found = [e for e in verdicts(run_dir) if e["kind"] == "data"]
    skipped = {e["step"] for e in found}
    median = statistics.median(t for s, t in times.items() if s not in skipped and s > 5)
    print(f"\n## 2. a rollback and skip (configs/smoke.yaml, 2 ranks, samples of steps {first}-{first + 2} poisoned)")
    print(f"data verdicts at steps {sorted(skipped)}, samples {[e['samples'] for e in found]}")
    cost = [times[s] for s in sorted(skipped)]
    print(f"each skipped step {statistics.median(cost):.3f} s (median; its computation, one replay and one "
          f"computed elsewhere, its update "
          f"not applied) against a step {median:.3f} s: {statistics.median(cost) / median:.2f}x a step, plus the "
          "step's samples, not trained on")


def false_positives(tmp: Path, configs: list[str]) -> None:
    print("\n## 3. false positives on clean runs (2 ranks, the shipped configs, their default anomaly rule)")
    for item in configs:
        config, _, steps = item.partition(":")
        cfg = config_.load(REPO / config)
        steps = int(steps or cfg.train.steps)
        run_dir = tmp / Path(config).stem
        wall = train(run_dir, config, [f"train.steps={steps}"])
        found = verdicts(run_dir)
        judged = max(steps - cfg.fault.anomaly_window, 0)
        print(f"{config}: {steps} steps in {wall:.0f} s, {judged} judged, {len(found)} verdict(s): "
              f"{[(e['kind'], e['step']) for e in found]} -> false-positive rate {len(found) / max(judged, 1):.4f} "
              f"per judged step (spot checks every {cfg.fault.verify_every}: "
              f"{steps // cfg.fault.verify_every if cfg.fault.verify_every else 0} agreed or said so)")


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        flip(Path(tmp), args.every)
        wrong(Path(tmp))
        poison(Path(tmp))
        false_positives(Path(tmp), args.configs.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
