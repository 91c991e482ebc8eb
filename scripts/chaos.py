"""Chaos run: train CONFIG under the launcher while killing random ranks at random times, then
check the result against an uninterrupted run of the same config and print what recovery cost.

    python scripts/chaos.py configs/smoke.yaml --kills 5 --interval 60 train.steps=6000

Signals: SIGKILL (crash), SIGSTOP (hang: found by the watchdog after fault.hang_timeout_s) and
SIGTERM to one rank (preemption: the ranks commit an emergency checkpoint and exit 75). At the end:
per-step losses and final parameters compared bit for bit with the reference run (CPU, same world
size), each recovery split into detection (kill -> failure noticed), restart (kill the group,
rendezvous, spawn, import, build), checkpoint load and first step, and the run's goodput."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer import logs
from trainer.protocol import read_events, read_heartbeats, read_jsonl

REPO = Path(__file__).resolve().parents[1]

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}


def signal_names(text: str) -> list[str]:
    """--signals: checked before the (long) reference run starts, not at the first kill."""
    names = [s.strip().upper().removeprefix("SIG") for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SIGNALS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown signal(s) {unknown or text!r}: use {', '.join(SIGNALS)}")
    return names


def launcher(config: str, run_dir: Path, nproc: int, overrides: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={nproc}", config, f"run.dir={run_dir}",
           "log.progress=false", "train.log_every=1", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def steady_beats(run_dir: Path, min_steps: int) -> dict[int, dict] | None:
    """Heartbeats of the current attempt once every rank has run min_steps steps in it."""
    for directory in run_dir.glob("heartbeats-*"):
        beats = read_heartbeats(directory)
        if beats and len({b["attempt"] for b in beats.values()}) == 1 and \
                all(b["phase"] == "train" and b["steps_run"] >= min_steps for b in beats.values()):
            return beats
    return None


def metrics(run_dir: Path) -> dict[int, float]:
    """Loss by step; a step logged twice (before a kill and after the resume) keeps the last."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def final_state(config: str, run_dir: Path, overrides: list[str]) -> tuple[int, dict]:
    import torch

    from trainer.checkpoint import Checkpointer
    from trainer.config import load
    from trainer.model import Transformer
    from trainer.optim import build_optimizer
    from trainer.parallel import DistInfo

    cfg = load(config, overrides)
    model = Transformer(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    solo = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    ckpt = Checkpointer(str(run_dir / "checkpoints"), solo)
    state = ckpt.load(ckpt.discover_latest(), model, opt)
    return state.step, model.state_dict()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--interval", type=float, default=60.0, help="mean seconds of training between kills")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--signals", default="KILL,KILL,KILL,STOP,TERM", type=signal_names,
                   help="comma-separated KILL, STOP, TERM (SIG prefix optional); drawn without replacement, "
                        "then repeated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--timeout", type=float, default=3600)
    return p.parse_intermixed_args()


def kill_plan(signals: list[str], kills: int, rng: random.Random) -> list[str]:
    """`kills` signal names: the list shuffled, repeated as often as needed."""
    plan: list[str] = []
    while len(plan) < kills:
        batch = signals[:]
        rng.shuffle(batch)
        plan += batch
    return plan[:kills]


def next_victim(proc: subprocess.Popen, run_dir: Path, kills: list[dict], wait: float,
                deadline: float) -> dict[int, dict] | None:
    """Wait for a fresh attempt to train steadily, then `wait` seconds, then for a moment when every
    rank is training; the ranks' heartbeats then (None if the run ended first)."""
    while proc.poll() is None and time.time() < deadline:  # steady state of a fresh attempt
        beats = steady_beats(run_dir, min_steps=3)
        if beats and (not kills or beats[0]["attempt"] > kills[-1]["attempt"]):
            break
        time.sleep(0.1)
    start = time.time()
    while proc.poll() is None and time.time() - start < wait:
        time.sleep(0.1)
    beats = None  # a rank may be between steps (checkpoint, eval): wait until every rank is training
    while proc.poll() is None and time.time() < deadline and not beats:
        beats = steady_beats(run_dir, min_steps=1) or time.sleep(0.02)
    return beats if proc.poll() is None else None


def run_with_kills(args: argparse.Namespace, run_dir: Path, log: Path, rng: random.Random) -> tuple[int, list]:
    """The chaos run: the launcher, signalled ranks at random times; (its exit code, the kills made)."""
    overrides = args.overrides
    if not any(o.startswith("fault.max_restarts=") for o in args.overrides):
        # The run is here to recover from every kill, not to spend the default restart budget (10).
        overrides = [*args.overrides, f"fault.max_restarts={args.kills + 5}"]
    proc = launcher(args.config, run_dir, args.nproc, overrides, log)
    kills: list[dict] = []
    deadline = time.time() + args.timeout
    for name in kill_plan(args.signals, args.kills, rng):
        beats = next_victim(proc, run_dir, kills, rng.uniform(0.5, 1.5) * args.interval, deadline)
        if not beats:
            print("[chaos] the run ended before all kills were made")
            break
        rank = rng.randrange(len(beats))
        beat = beats[rank]
        os.kill(beat["pid"], SIGNALS[name])
        kills.append({"signal": name, "rank": rank, "step": beat["step"], "time": time.time(),
                      "attempt": beat["attempt"]})
        print(f"[chaos] SIG{name} -> rank {rank} (pid {beat['pid']}) at step {beat['step']}", flush=True)
    return proc.wait(timeout=max(deadline - time.time(), 1)), kills


def recoveries(kills: list[dict], events: list[dict]) -> list[dict]:
    """Each kill with the failure the launcher recorded after it and the resume that followed."""
    failures = [e for e in events if e["event"] == "failure"]
    resumes = [e for e in events if e["event"] == "resume"]
    rows = []
    for kill in kills:
        failure = next((f for f in failures if f["time"] >= kill["time"]), None)
        resume = next((r for r in resumes if failure and r["time"] >= failure["time"]), None)
        if failure is None or resume is None:
            rows.append({**kill, "detected": None})
            continue
        detect = failure["time"] - kill["time"]
        rows.append({**kill, "cause": failure["cause"], "detection_s": detect, "restart_s": resume["restart_s"],
                     "spawn_s": resume["spawn_s"], "startup_s": resume["startup_s"],
                     "load_s": resume["load_s"], "first_step_s": resume["first_step_s"],
                     "recovery_s": detect + resume["recovery_s"], "lost_steps": resume["lost_steps"]})
    return rows


def print_recoveries(rows: list[dict]) -> None:
    print("\n signal  rank   step  cause       detect  restart   load  1st step  recovery  lost steps")
    for r in rows:
        if "cause" not in r:
            print(f" SIG{r['signal']:<4} {r['rank']:>4} {r['step']:>6}  (no recovery recorded)")
            continue
        print(f" SIG{r['signal']:<4} {r['rank']:>4} {r['step']:>6}  {r['cause']:<10} {r['detection_s']:6.1f}s "
              f"{r['restart_s']:7.1f}s {r['load_s']:5.2f}s {r['first_step_s']:8.2f}s {r['recovery_s']:8.1f}s "
              f"{r['lost_steps']:>10}")
    recovered = [r for r in rows if "cause" in r]
    if not recovered:
        return
    median = statistics.median(r["recovery_s"] for r in recovered)
    print(f"\nmedian recovery (kill -> first step after resume): {median:.1f}s (goal <= 8s)")
    for part, what in (("detection_s", "kill -> failure noticed"),
                       ("restart_s", "failure -> checkpoint load starts, of which:"),
                       ("spawn_s", "  stop the group, rendezvous, start processes"),
                       ("startup_s", "  import torch, join the process group, build model and data"),
                       ("load_s", "checkpoint load"), ("first_step_s", "first step after the load")):
        print(f"  median {part[:-2]:<11} {statistics.median(r[part] for r in recovered):6.2f}s  {what}")


def print_goals(rows: list[dict], run_dir: Path, events: list[dict], kills: int) -> None:
    """Hang detection against fault.hang_timeout_s, and the goodput."""
    hang_timeout = None
    for line in (run_dir / "config.yaml").read_text().splitlines():
        if line.strip().startswith("hang_timeout_s:"):
            hang_timeout = float(line.split(":")[1])
    for r in rows:
        if "cause" in r and r["signal"] == "STOP" and hang_timeout is not None:
            ok = "ok" if r["detection_s"] <= hang_timeout + 2 else "MISSED"
            print(f"hang detected {r['detection_s']:.1f}s after SIGSTOP (goal <= hang_timeout_s + 2 = "
                  f"{hang_timeout + 2:.0f}s): {ok}")
    done = next((e for e in reversed(events) if e["event"] == "done"), {})
    if done:
        wall_min = done["wall_s"] / 60
        print(f"goodput {100 * done.get('goodput', 0):.1f}% with {kills} kills in {wall_min:.1f} min "
              f"({kills / max(wall_min, 1e-9):.2f} failures/min; goal >= 80% at 1/min)")


def same_as_reference(args: argparse.Namespace, reference: Path, run_dir: Path) -> bool:
    """Per-step losses and final parameters of the chaos run bit-identical to the reference run's."""
    ref_losses, losses = metrics(reference), metrics(run_dir)
    same_losses = ref_losses == losses
    ref_step, ref_params = final_state(args.config, reference, args.overrides)
    step, params = final_state(args.config, run_dir, args.overrides)
    same_params = step == ref_step and all((params[k] == v).all().item() for k, v in ref_params.items())
    print(f"per-step losses identical to the uninterrupted run: {same_losses} ({len(losses)} steps)")
    print(f"final parameters bit-identical (step {step} vs {ref_step}): {same_params}")
    return same_losses and same_params


def main() -> int:
    args = parse_args()
    logs.setup()  # the checkpoint loads' warnings, as the trainer says them
    rng = random.Random(args.seed)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    print(f"[chaos] reference run (no faults) -> {out / 'reference'}", flush=True)
    ref = launcher(args.config, out / "reference", args.nproc, args.overrides, out / "reference.log")
    if ref.wait(timeout=args.timeout) != 0:
        print(f"[chaos] the reference run failed: see {out / 'reference.log'}")
        return 1
    ref_done = next((e for e in reversed(read_events(out / "reference")) if e["event"] == "done"), {})
    if ref_done:
        print(f"[chaos] reference run: goodput {100 * ref_done.get('goodput', 0):.1f}% undisturbed "
              f"({ref_done['productive_s']:.1f}s in steps of {ref_done['wall_s']:.1f}s wall; goal >= 97%)", flush=True)
    run_dir = out / "chaos"
    print(f"[chaos] chaos run with {args.kills} kills -> {run_dir}", flush=True)
    code, kills = run_with_kills(args, run_dir, out / "chaos.log", rng)
    print(f"[chaos] launcher exited {code}")

    events = read_events(run_dir)
    rows = recoveries(kills, events)
    print_recoveries(rows)
    print_goals(rows, run_dir, events, len(kills))
    same = same_as_reference(args, out / "reference", run_dir)
    return 0 if code == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
