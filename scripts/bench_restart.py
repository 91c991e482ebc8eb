"""Recovery from a SIGKILLed rank, three ways, side by side in one run: kill -> first resumed step.

    python scripts/bench_restart.py [--nproc 2,4,8] [--modes warm,inproc] [--kills 5] [--rounds 1]
                                    [--config configs/smoke.yaml] [key=value ...]

The modes: `cold` restarts every rank as a new Python process (`fault.warm_restarts=false`,
`fault.in_process=false`); `warm` restarts every rank forked from the launcher's fork server
(launch.zygote, `fault.in_process=false`); `inproc` replaces only the killed rank, forked warm, while the
others keep their processes and re-form their groups (`fault.in_process=true`, trainer.recovery.inplace). Each
round runs every mode once per rank count, the order alternating from round to round, with the memory
tier on (`checkpoint.memory_every=1`). In each run one rank (rank 1, 2, ... in turn) is SIGKILLed
`--kills` times, each time once every rank has trained a few steps since the last recovery. For each
kill: kill -> the first step after it done on every rank (from the heartbeats), and the ledger's split:
detection (kill -> failure noticed); for restarts spawn (stop the group, rendezvous, start the
processes) and start-up (process -> checkpoint load); for in-process recovery wait (the survivors
waiting for the replacement) and re-form (the groups formed again); then load and first step.

Prints each mode's median per rank count, inproc / warm, and how the in-process median grows with the
ranks (the goals: at most 0.5 s at 2 ranks, and the largest rank count at most 1.25x the 2-rank
median). Before each kill it times a few undisturbed steps, and prints the time lost too: kill -> first
resumed step, less one undisturbed step. Where the ranks outnumber the cores a step grows with the ranks
(they share the cores), and the time lost shows what recovery itself adds. On a shared machine compare
the columns of one run, not numbers from different runs."""

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
from trainer.runtime.protocol import HeartbeatRecord, read_events, read_heartbeats

REPO = Path(__file__).resolve().parents[1]
GOAL_2_RANKS_S = 0.5  # in-process median at 2 ranks
GOAL_GROWTH = 1.25  # in-process median at the largest rank count / at 2 ranks
STEP_SAMPLE = 3  # undisturbed steps timed before each kill
MODES = {"cold": ["fault.warm_restarts=false", "fault.in_process=false"],
         "warm": ["fault.warm_restarts=true", "fault.in_process=false"],
         "inproc": ["fault.warm_restarts=true", "fault.in_process=true"]}
PARTS = (("detection_s", "detection (kill -> failure noticed)"),
         ("spawn_s", "spawn (stop group, rendezvous, start processes)"),
         ("startup_s", "start-up (process -> checkpoint load)"),
         ("wait_s", "wait (survivors wait for the replacement)"),
         ("reform_s", "re-form (the groups formed again)"),
         ("load_s", "load (memory tier)"), ("first_step_s", "first step"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs per run")
    p.add_argument("--rounds", type=int, default=1, help="cold + warm pairs")
    p.add_argument("--nproc", default="2", help="rank counts, comma-separated (2,4,8)")
    p.add_argument("--steady", type=int, default=5, help="steps every rank of a new group trains before the next kill")
    p.add_argument("--timeout", type=float, default=180, help="the most any one wait may take (s)")
    p.add_argument("--modes", default="warm,inproc", help="which runs each round makes: cold, warm, inproc")
    p.add_argument("--keep", default="", help="keep the runs' directories and logs here (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = p.parse_args()
    args.nprocs = [int(n) for n in args.nproc.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    return args


class Run:
    """One launcher run with kills."""

    def __init__(self, args: argparse.Namespace, out: Path, mode: str, nproc: int, label: str) -> None:
        self.args, self.mode, self.nproc = args, mode, nproc
        self.dir = out / label
        overrides = ["log.progress=false", "train.eval_every=0", "train.steps=1000000", "checkpoint.every=100000",
                     "checkpoint.memory_every=1", f"checkpoint.memory_dir={out / (label + '-shm')}",
                     f"fault.max_restarts={args.kills + 5}", *MODES[mode], *args.overrides]
        cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={nproc}", str(REPO / args.config),
               f"run.dir={self.dir}", *overrides]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.log = out / f"{label}.log"
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def beats(self) -> dict[int, HeartbeatRecord]:
        for directory in self.dir.glob("heartbeats-*"):
            return read_heartbeats(directory)
        return {}

    def wait_for(self, what: str, ready) -> dict[int, HeartbeatRecord]:
        """The heartbeats once `ready(beats)` holds (bounded; fails if the launcher ended)."""
        deadline = time.time() + self.args.timeout
        while time.time() < deadline:
            beats = self.beats()
            if len(beats) == self.nproc and ready(beats):
                return beats
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited {self.proc.returncode} waiting for {what}: see {self.log}")
            time.sleep(0.005)
        raise RuntimeError(f"no {what} within {self.args.timeout:.0f}s: see {self.log}")

    def kill_loop(self) -> tuple[float, list[dict]]:
        """(launcher start -> first step, one row per kill)."""
        beats = self.wait_for("first step", lambda b: all(x.startup.t_first for x in b.values()))
        first_start = max(x.startup.t_first for x in beats.values()) - self.started
        rows, era = [], era_of(beats[0])
        for i in range(self.args.kills):
            steady = self.args.steady

            def training(b, era=era, steady=steady) -> bool:  # steps since the recovery: the step counter
                return all(era_of(x) == era and x.phase == "train" for x in b.values()) and \
                    min(x.step for x in b.values()) >= max(x.progress.resumed_step for x in b.values()) + steady

            beats = self.wait_for(f"{steady} steps of {era}", training)
            step_s, beats = self.step_time(beats, era)
            rank = (i + 1) % self.nproc
            killed_at = time.time()
            os.kill(beats[rank].pid, signal.SIGKILL)

            def resumed(b, era=era) -> bool:
                return all(era_of(x) > era and x.startup.t_first for x in b.values())

            beats = self.wait_for("the first step after the kill", resumed)
            era = min(era_of(x) for x in beats.values())
            kill_to_step = max(x.startup.t_first for x in beats.values()) - killed_at
            rows.append({"rank": rank, "killed_at": killed_at, "kill_to_step_s": kill_to_step, "step_s": step_s,
                         "net_s": kill_to_step - step_s})
        return first_start, rows

    def step_time(self, beats: dict[int, HeartbeatRecord], era: tuple[int, int],
                  steps: int = STEP_SAMPLE) -> tuple[float, dict[int, HeartbeatRecord]]:
        """An undisturbed step's time just before the kill: `steps` steps of rank 0, from the times its
        heartbeat records each step done. Returns it and the newest heartbeats."""
        t0, s0 = beats[0].t, beats[0].step
        beats = self.wait_for(f"{steps} more steps of {era}",
                              lambda b: era_of(b[0]) == era and b[0].phase == "train" and b[0].step >= s0 + steps)
        return (beats[0].t - t0) / (beats[0].step - s0), beats

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
                       "path": resume.get("path", "restart"),
                       **{k: resume[k] for k, _ in PARTS if k in resume and k != "detection_s"}}
            out.append(row)
        return out


def era_of(beat: HeartbeatRecord) -> tuple[int, int]:
    """(restart attempt, in-process generation) of a heartbeat: it grows with every recovery."""
    return beat.attempt, beat.generation


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def fmt(value: float | None) -> str:
    return f"{value:7.3f}s" if value is not None else "       -"


def main() -> int:
    args = parse_args()
    load = os.getloadavg()
    print(f"[bench_restart] {args.nprocs} ranks, modes {args.modes}, {args.config}, checkpoint.memory_every=1, "
          f"{args.kills} SIGKILLs per run, {args.rounds} round(s); {os.cpu_count()} CPU cores, load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    results: dict[tuple[str, int], list[dict]] = {(m, n): [] for m in args.modes for n in args.nprocs}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            for nproc in args.nprocs:
                for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
                    run = Run(args, out, mode, nproc, f"{mode}-{nproc}-{r}")
                    try:
                        first, rows = run.kill_loop()
                    finally:
                        run.stop()
                    rows = run.breakdown(rows)
                    results[(mode, nproc)] += rows
                    print(f"[bench_restart] round {r}, {nproc} ranks, {mode}: kill -> first resumed step "
                          + ", ".join(f"{x['kill_to_step_s']:.2f}s" for x in rows)
                          + f" | first start {first:.1f}s | launcher exit {run.proc.returncode}", flush=True)
    print_rows(results)
    print("\nmedian kill -> first resumed step (s); an undisturbed step (s); time lost = the first, less the step")
    print("  ranks  " + "  ".join(f"{m:>8}" for m in args.modes)
          + ("  inproc/warm" if {"inproc", "warm"} <= set(args.modes) else "") + "      step  "
          + "  ".join(f"{m + ' lost':>11}" for m in args.modes))
    for nproc in args.nprocs:
        medians = {m: median(results[(m, nproc)], "kill_to_step_s") for m in args.modes}
        ratio = ""
        if medians.get("inproc") is not None and medians.get("warm"):
            ratio = f"  {medians['inproc'] / medians['warm']:11.2f}"
        step = median([x for m in args.modes for x in results[(m, nproc)]], "step_s")
        print(f"  {nproc:>5}  " + "  ".join(fmt(medians[m]) for m in args.modes) + ratio + f"  {fmt(step)}  "
              + "  ".join(f"   {fmt(median(results[(m, nproc)], 'net_s'))}" for m in args.modes))
    for mode in args.modes:
        lost = [x.get("lost_steps", 0) for n in args.nprocs for x in results[(mode, n)]]
        paths = sorted({x.get("path", "?") for n in args.nprocs for x in results[(mode, n)]})
        print(f"  {mode}: paths taken {paths}; steps lost {lost}")
    load = os.getloadavg()
    print(f"  load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if "inproc" in args.modes:
        at = {n: median(results[("inproc", n)], "kill_to_step_s") for n in args.nprocs}
        if at.get(2) is not None:
            met = at[2] <= GOAL_2_RANKS_S
            print(f"goal: in-process median at 2 ranks <= {GOAL_2_RANKS_S:.2f}s: {'met' if met else 'NOT met'} "
                  f"({at[2]:.3f}s)")
            top = max(args.nprocs)
            if top > 2 and at.get(top) is not None:
                print_growth(results, top)
    return 0


def print_rows(results: dict[tuple[str, int], list[dict]]) -> None:
    """One row per kill: kill -> first resumed step, the ledger's split, the step before the kill."""
    print("\n  mode  ranks  rank  path        kill->step  " + "  ".join(f"{k[:-2][:9]:>10}" for k, _ in PARTS)
          + "       step  lost")
    for (mode, nproc), rows in results.items():
        for x in rows:
            parts = "  ".join(f"{x[k]:9.3f}s" if k in x else f"{'-':>10}" for k, _ in PARTS)
            print(f"{mode:>6}  {nproc:>5}  {x['rank']:>4}  {x.get('path', '?'):<10}  {x['kill_to_step_s']:9.3f}s  "
                  f"{parts}  {x['step_s']:9.3f}s  {x.get('lost_steps', '-'):>4}")


def print_growth(results: dict[tuple[str, int], list[dict]], top: int) -> None:
    """The growth goal, as the issue states it (kill -> first resumed step), and less the resumed step
    itself: on a machine with fewer cores than ranks an undisturbed step grows with the ranks too (the
    ranks share the cores), which is not recovery's doing."""
    kill_to_step = {n: median(results[("inproc", n)], "kill_to_step_s") for n in (2, top)}
    lost = {n: median(results[("inproc", n)], "net_s") for n in (2, top)}
    step = {n: median(results[("inproc", n)], "step_s") for n in (2, top)}
    growth = kill_to_step[top] / kill_to_step[2]
    print(f"goal: in-process median at {top} ranks <= {GOAL_GROWTH:.2f}x the 2-rank one: "
          f"{'met' if growth <= GOAL_GROWTH else 'NOT met'} ({growth:.2f}x)")
    print(f"  an undisturbed step takes {step[top] / step[2]:.2f}x as long at {top} ranks as at 2 "
          f"({os.cpu_count()} CPU cores); the time lost (kill -> first resumed step, less one undisturbed step) "
          f"grows {lost[top] / lost[2]:.2f}x ({lost[2]:.3f}s -> {lost[top]:.3f}s)")


if __name__ == "__main__":
    sys.exit(main())
