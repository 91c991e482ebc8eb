"""Warm restarts against cold ones: kill -> first resumed step, side by side in one run.

    python scripts/bench_restart.py [--kills 5] [--rounds 1] [--config configs/smoke.yaml] [key=value ...]

Each round trains the same run under the launcher twice, with `fault.warm_restarts=false` (cold: every
restarted rank starts Python and imports torch) and `true` (warm: forked from the launcher's fork
server, launch.zygote), the order alternating from round to round, with the memory tier on
(`checkpoint.memory_every=1`: the state loads in about 0.1 s). In each run one rank (rank 1, then
rank 0, in turn) is SIGKILLed `--kills` times, each time once every rank of the new group has trained
a few steps. For each kill: kill -> the new group's first step done on every rank of this node (from
the heartbeats), and the ledger's breakdown of it: detection (kill -> failure noticed), spawn (stop the
group, rendezvous, start the processes), start-up (the trainer process up to its checkpoint load:
imports when cold, then the process group, the data, the model), load, first step. Prints each mode's
median and the warm / cold ratio; the goal is a warm median of at most 1 s on 2 CPU cores. Also the
first start (launcher started -> first step) and the start-up of the stub interpreter alone. On a
shared machine compare the two columns of one run, not numbers from different runs."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.ledger import recovery_after
from trainer.runtime.protocol import read_events, read_heartbeats

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 1.0
PARTS = (("detection_s", "detection (kill -> failure noticed)"),
         ("spawn_s", "spawn (stop group, rendezvous, start processes)"),
         ("startup_s", "start-up (process -> checkpoint load)"),
         ("load_s", "load (memory tier)"), ("first_step_s", "first step"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs per run")
    p.add_argument("--rounds", type=int, default=1, help="cold + warm pairs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steady", type=int, default=5, help="steps every rank of a new group trains before the next kill")
    p.add_argument("--timeout", type=float, default=180, help="the most any one wait may take (s)")
    p.add_argument("--modes", default="cold,warm", help="which runs each round makes: cold, warm or both")
    p.add_argument("--keep", default="", help="keep the runs' directories and logs here (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    return p.parse_args()


class Run:
    """One launcher run with kills."""

    def __init__(self, args: argparse.Namespace, out: Path, warm: bool, label: str) -> None:
        self.args, self.warm = args, warm
        self.dir = out / label
        overrides = ["log.progress=false", "train.eval_every=0", "train.steps=1000000", "checkpoint.every=100000",
                     "checkpoint.memory_every=1", f"checkpoint.memory_dir={out / (label + '-shm')}",
                     f"fault.max_restarts={args.kills + 5}", f"fault.warm_restarts={str(warm).lower()}",
                     *args.overrides]
        cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={args.nproc}", str(REPO / args.config),
               f"run.dir={self.dir}", *overrides]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.log = out / f"{label}.log"
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def beats(self) -> dict[int, dict]:
        for directory in self.dir.glob("heartbeats-*"):
            return read_heartbeats(directory)
        return {}

    def wait_for(self, what: str, ready) -> dict[int, dict]:
        """The heartbeats once `ready(beats)` holds (bounded; fails if the launcher ended)."""
        deadline = time.time() + self.args.timeout
        while time.time() < deadline:
            beats = self.beats()
            if len(beats) == self.args.nproc and ready(beats):
                return beats
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited {self.proc.returncode} waiting for {what}: see {self.log}")
            time.sleep(0.005)
        raise RuntimeError(f"no {what} within {self.args.timeout:.0f}s: see {self.log}")

    def kill_loop(self) -> tuple[float, list[dict]]:
        """(launcher start -> first step, one row per kill)."""
        beats = self.wait_for("first step", lambda b: all(x["t_first"] for x in b.values()))
        first_start = max(x["t_first"] for x in beats.values()) - self.started
        rows, attempt = [], beats[0]["attempt"]
        for i in range(self.args.kills):
            steady = self.args.steady

            def training(b, attempt=attempt, steady=steady) -> bool:
                return all(x["attempt"] == attempt and x["steps_run"] >= steady and x["phase"] == "train"
                           for x in b.values())

            beats = self.wait_for(f"{steady} steps of attempt {attempt}", training)
            rank = (i + 1) % self.args.nproc
            killed_at = time.time()
            os.kill(beats[rank]["pid"], signal.SIGKILL)

            def resumed(b, attempt=attempt) -> bool:
                return all(x["attempt"] > attempt and x["t_first"] for x in b.values())

            beats = self.wait_for("the first step after the kill", resumed)
            attempt = beats[0]["attempt"]
            rows.append({"rank": rank, "killed_at": killed_at,
                         "kill_to_step_s": max(x["t_first"] for x in beats.values()) - killed_at})
        return first_start, rows

    def stop(self) -> None:
        """SIGTERM: the ranks commit and exit 75 (bounded; SIGKILL after)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def breakdown(self, rows: list[dict]) -> list[dict]:
        """The rows with the ledger's split of each recovery (the failure and resume after each kill)."""
        events = read_events(self.dir)
        out = []
        for row in rows:
            if found := recovery_after(events, row["killed_at"]):
                failure, resume = found
                row = {**row, "detection_s": failure["time"] - row["killed_at"], "cause": failure["cause"],
                       "tier": resume["tier"], "lost_steps": resume["lost_steps"],
                       **{k: resume[k] for k in ("spawn_s", "startup_s", "load_s", "first_step_s")}}
            out.append(row)
        return out


def stub_startup_s(repeats: int = 5) -> float:
    """Median wall time of the stub's interpreter with the stub's imports (`python -S`, stdlib only)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-S", "-c", "import ctypes, json, os, signal, socket, struct, sys"],
                       check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def fmt(value: float | None) -> str:
    return f"{value:8.2f}s" if value is not None else "       -"


def main() -> int:
    args = parse_args()
    cores = os.cpu_count()
    load = os.getloadavg()
    print(f"[bench_restart] {args.nproc} ranks, {args.config}, checkpoint.memory_every=1, {args.kills} SIGKILLs "
          f"per run, {args.rounds} round(s); {cores} CPU cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
          flush=True)
    results: dict[str, dict] = {"cold": {"rows": [], "first": []}, "warm": {"rows": [], "first": []}}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            modes = [m for m in ("cold", "warm") if m in args.modes.split(",")]
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                warm = mode == "warm"
                run = Run(args, out, warm, f"{mode}-{r}")
                try:
                    first, rows = run.kill_loop()
                finally:
                    run.stop()
                rows = run.breakdown(rows)
                results[mode]["rows"] += rows
                results[mode]["first"].append(first)
                print(f"[bench_restart] round {r} {mode}: kill -> first resumed step "
                      + ", ".join(f"{x['kill_to_step_s']:.2f}s" for x in rows)
                      + f" | first start {first:.1f}s | launcher exit {run.proc.returncode}", flush=True)
    stub = stub_startup_s()
    cold, warm = results["cold"]["rows"], results["warm"]["rows"]
    print("\n mode  rank  kill->step  " + "  ".join(f"{k[:-2]:>10}" for k, _ in PARTS) + "  lost")
    for mode, rows in (("cold", cold), ("warm", warm)):
        for x in rows:
            parts = "  ".join(f"{x[k]:9.2f}s" if k in x else f"{'-':>10}" for k, _ in PARTS)
            print(f" {mode}  {x['rank']:>4}  {x['kill_to_step_s']:9.2f}s  {parts}  {x.get('lost_steps', '-'):>4}")
    print(f"\nmedian over {len(cold)} cold and {len(warm)} warm restarts          cold      warm  warm/cold")

    def line(label: str, a: float | None, b: float | None) -> None:
        ratio = f"{b / a:9.2f}" if a and b is not None else "        -"
        print(f"  {label:<48}{fmt(a)}{fmt(b)}  {ratio}")

    line("kill -> first resumed step", median(cold, "kill_to_step_s"), median(warm, "kill_to_step_s"))
    for key, label in PARTS:
        line("  " + label, median(cold, key), median(warm, key))
    line("min", min((x["kill_to_step_s"] for x in cold), default=None),
         min((x["kill_to_step_s"] for x in warm), default=None))
    line("max", max((x["kill_to_step_s"] for x in cold), default=None),
         max((x["kill_to_step_s"] for x in warm), default=None))
    line("first start (launcher -> first step)", statistics.median(results["cold"]["first"] or [0.0]) or None,
         statistics.median(results["warm"]["first"] or [0.0]) or None)
    lost = [x.get("lost_steps", 0) for x in warm]
    tiers = sorted({x.get("tier", "?") for x in cold + warm})
    print(f"  stub interpreter start-up (python -S, its stdlib imports): {stub:.3f}s")
    print(f"  resumed from: {', '.join(tiers)}; steps lost per warm restart: {lost}")
    load = os.getloadavg()
    print(f"  load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    got = median(warm, "kill_to_step_s")
    met = got is not None and got <= GOAL_S
    print(f"goal: warm median kill -> first resumed step <= {GOAL_S:.1f}s on 2 CPU cores: "
          f"{'met' if met else 'NOT met'} ({got:.2f}s)" if got is not None else "goal: no warm restart measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
