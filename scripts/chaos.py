"""Chaos run: train CONFIG under the launcher while killing random ranks at random times, then
check the result against an uninterrupted run of the same config and print what recovery cost.

    python scripts/chaos.py configs/smoke.yaml --kills 5 --interval 60 train.steps=6000
    python scripts/chaos.py configs/smoke.yaml --nodes 3 --nproc 1 --spares 1 --signals KILL,STOP,TERM,NODE ...

Signals: SIGKILL (crash), SIGSTOP (hang: found by the watchdog after fault.hang_timeout_s) and
SIGTERM to one rank (preemption: the ranks commit an emergency checkpoint and exit 75). With
`--nodes N` (N launchers on loopback, one rendezvous, each with its own memory directory) there is
also NODE, a lost node: one launcher and its ranks SIGKILLed, its memory directory deleted, and a
replacement launcher started with an empty one (node 0 hosts the rendezvous store and is never the
one lost). With `--spares K` (several nodes) the job runs under `--nnodes 1:N` with K more launchers
waiting as spares once it trains: a lost node's ranks are started in process on a spare (launch/spares.py),
and the replacement launcher waits as the next spare. The reference run is one launcher with the same world
size. At the end:
per-step losses and final parameters compared bit for bit with the reference run (CPU, same world
size), each recovery split into detection (kill -> failure noticed), restart (kill the group,
rendezvous, spawn, import, build), checkpoint load and first step, the tier the state came from
(memory-local, memory-peer, memory-reshard, durable) and the lost steps, and the run's goodput, with
what it would be at exactly one fault a minute (the goal's rate) given what a fault cost here."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures is not installed

from launch.ledger import recovery_after
from tests.fixtures import free_port, kill_tree, wait_for_rendezvous_host
from trainer.contract import is_alive
from trainer.observability import logs
from trainer.runtime.protocol import HeartbeatRecord, read_events, read_heartbeats, read_jsonl

REPO = Path(__file__).resolve().parents[1]

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}
KINDS = [*SIGNALS, "NODE"]  # NODE: a lost node (--nodes >= 2)


def signal_names(text: str) -> list[str]:
    """--signals: checked before the (long) reference run starts, not at the first kill."""
    names = [s.strip().upper().removeprefix("SIG") for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(KINDS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown signal(s) {unknown or text!r}: use {', '.join(KINDS)}")
    return names


def launcher(config: str, run_dir: Path, nproc: int, overrides: list[str], log: Path,
             node_args: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={nproc}", *node_args, config, f"run.dir={run_dir}",
           "log.progress=false", "train.log_every=1", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


class Nodes:
    """The chaos run's launchers, one per node, on loopback (and its spares): node 0 hosts the rendezvous; each
    launcher has its own memory directory under the run's, as separate machines would."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, log: Path, overrides: list[str]) -> None:
        self.args, self.run_dir, self.log, self.overrides = args, run_dir, log, overrides
        self.node_args: list[str] = []
        self.memory: dict[int, Path] = {}  # launcher pid -> its memory directory
        if args.nodes > 1:
            self.node_args = [f"--nnodes={args.nodes}", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=chaos"]
        if args.nodes > 1 and args.spares:
            # MIN:MAX (a lost node's place taken in process), and a long last call: the first round waits for
            # every node (a round of fewer would train other steps than the reference run's world)
            self.node_args[0] = f"--nnodes=1:{args.nodes}"
            self.node_args.append("--rdzv-conf=last_call_timeout=30")
        self.procs = [self.start(node) for node in range(args.nodes)]

    def start(self, node: int) -> subprocess.Popen:
        overrides, memory = self.overrides, self.run_dir.parent / f"{self.run_dir.name}-memory-node{node}"
        if self.args.nodes > 1:
            overrides = [*overrides, f"checkpoint.memory_dir={memory}"]
        proc = launcher(self.args.config, self.run_dir, self.args.nproc, overrides, self.log, self.node_args)
        self.memory[proc.pid] = memory
        if node == 0 and self.args.nodes > 1:
            wait_for_rendezvous_host(self.run_dir, 120, proc)  # the first launcher hosts the rendezvous store
        return proc

    def add_spares(self, deadline: float) -> None:
        """Start --spares launchers beyond --nnodes MAX, once the job trains; wait until each waits as a spare."""
        for _ in range(self.args.spares):
            self.procs.append(self.start(len(self.memory)))
        while sum(e["event"] == "spare_waiting" for e in read_events(self.run_dir)) < self.args.spares:
            if time.time() > deadline or not self.running():
                raise RuntimeError("the spares did not come to wait")
            time.sleep(0.1)

    def live_beats(self, proc: subprocess.Popen) -> dict[int, HeartbeatRecord]:
        """The heartbeats of the ranks `proc` runs now: a launcher left a spare by a restart keeps its old ranks'
        records (their processes gone) until it starts ranks again."""
        return {r: b for d in self.run_dir.glob(f"heartbeats-*-{proc.pid}-*") for r, b in read_heartbeats(d).items()
                if is_alive(b.pid)}

    def ranks_of(self, i: int) -> set[int]:
        """The ranks launcher `i` runs now (a spare takes a lost node's; a restart may renumber them)."""
        return set(self.live_beats(self.procs[i]))

    def holding(self, rank: int) -> int:
        return next(i for i in range(len(self.procs)) if rank in self.ranks_of(i))

    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def beats(self) -> dict[int, HeartbeatRecord]:
        """Every rank's heartbeat, of the ranks the live launchers run now (a lost launcher's stay behind)."""
        beats: dict[int, HeartbeatRecord] = {}
        for proc in self.procs:
            beats.update(self.live_beats(proc))
        return beats

    def lose(self, node: int) -> None:
        """A lost node: the launcher and its ranks SIGKILLed, its memory gone; a replacement joins (with
        spares: it waits as the next spare)."""
        lost = self.procs.pop(node)
        kill_tree(lost.pid)
        lost.wait(timeout=60)
        shutil.rmtree(self.memory[lost.pid], ignore_errors=True)
        self.procs.append(self.start(len(self.memory)))

    def wait(self, deadline: float) -> int:
        """The first launcher's exit code, once every launcher has exited (the worst one if it is 0)."""
        codes = [p.wait(timeout=max(deadline - time.time(), 1)) for p in self.procs]
        return codes[0] or max(codes, key=abs)


def incarnation(beat: HeartbeatRecord) -> tuple[int, int]:
    """(pid, generation of its groups): new after a restart (new processes) and after an in-process
    recovery (the survivors keep their pids, in a new generation); attempt numbers are per launcher."""
    return beat.pid, beat.generation


def steady_beats(nodes: Nodes, min_steps: int, old: set[tuple[int, int]]) -> dict[int, HeartbeatRecord] | None:
    """Every rank's heartbeat once each has run min_steps steps since it recovered from the last kill."""
    beats = nodes.beats()
    if len(beats) == nodes.args.nproc * nodes.args.nodes and \
            all(incarnation(b) not in old and b.phase == "train" and b.step - b.progress.resumed_step >= min_steps
                for b in beats.values()):
        return beats
    return None


def metrics(run_dir: Path) -> dict[int, float]:
    """Loss by step; a step logged twice (before a kill and after the resume) keeps the last."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def final_state(config: str, run_dir: Path, overrides: list[str]) -> tuple[int, dict]:
    import torch

    from trainer.checkpoint import Checkpointer
    from trainer.config import load
    from trainer.distributed.parallel import DistInfo
    from trainer.model.transformer import Transformer
    from trainer.optim import build_optimizer

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
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="launchers on loopback, one per node (NODE needs 2+)")
    p.add_argument("--spares", type=int, default=0, help="launchers waiting as spares (--nodes 2+)")
    p.add_argument("--signals", default="KILL,KILL,KILL,STOP,TERM", type=signal_names,
                   help="comma-separated KILL, STOP, TERM, NODE (SIG prefix optional); drawn without "
                        "replacement, then repeated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_intermixed_args()
    if ("NODE" in args.signals or args.spares) and args.nodes < 2:
        p.error("NODE (a lost node) and --spares need --nodes 2 or more")
    return args


def kill_plan(signals: list[str], kills: int, rng: random.Random) -> list[str]:
    """`kills` signal names: the list shuffled, repeated as often as needed."""
    plan: list[str] = []
    while len(plan) < kills:
        batch = signals[:]
        rng.shuffle(batch)
        plan += batch
    return plan[:kills]


def next_victim(nodes: Nodes, kills: list[dict], wait: float, deadline: float) -> dict[int, HeartbeatRecord] | None:
    """Wait for a fresh attempt to train steadily, then `wait` seconds, then for a moment when every
    rank is training; the ranks' heartbeats then (None if the run ended first)."""
    old = kills[-1]["incarnations"] if kills else set()
    while nodes.running() and time.time() < deadline and not steady_beats(nodes, 3, old):
        time.sleep(0.1)  # steady state of a fresh attempt
    start = time.time()
    while nodes.running() and time.time() - start < wait:
        time.sleep(0.1)
    beats = None  # a rank may be between steps (checkpoint, eval): wait until every rank is training
    while nodes.running() and time.time() < deadline and not beats:
        beats = steady_beats(nodes, 1, old) or time.sleep(0.02)
    return beats if nodes.running() else None


def run_with_kills(args: argparse.Namespace, run_dir: Path, log: Path, rng: random.Random) -> tuple[int, list]:
    """The chaos run: the launcher, signalled ranks at random times; (its exit code, the kills made)."""
    overrides = args.overrides
    if not any(o.startswith("fault.max_restarts=") for o in args.overrides):
        # The run is here to recover from every kill, not to spend the default restart budget (10).
        overrides = [*args.overrides, f"fault.max_restarts={args.kills + 5}"]
    nodes = Nodes(args, run_dir, log, overrides)
    kills: list[dict] = []
    deadline = time.time() + args.timeout
    for name in kill_plan(args.signals, args.kills, rng):
        beats = next_victim(nodes, kills, rng.uniform(0.5, 1.5) * args.interval, deadline)
        if not beats:
            print("[chaos] the run ended before all kills were made")
            break
        if args.spares and len(nodes.procs) == args.nodes:
            nodes.add_spares(deadline)
        if name == "NODE":
            rank = rng.choice(sorted(set(beats) - nodes.ranks_of(0)))  # node 0 hosts the rendezvous
            node = nodes.holding(rank)
        else:
            rank = rng.randrange(len(beats))
        beat = beats[rank]
        kills.append({"signal": name, "rank": rank, "step": beat.step, "time": time.time(),
                      "incarnations": {incarnation(b) for b in beats.values()}})
        if name != "NODE":
            os.kill(beat.pid, SIGNALS[name])
            print(f"[chaos] SIG{name} -> rank {rank} (pid {beat.pid}) at step {beat.step}", flush=True)
        else:
            nodes.lose(node)
            print(f"[chaos] node {node} lost (launcher and ranks SIGKILLed, memory deleted) at step "
                  f"{beat.step}; a replacement joins", flush=True)
    return nodes.wait(deadline), kills


def recoveries(kills: list[dict], events: list[dict]) -> list[dict]:
    """Each kill with the failure the launcher recorded after it and the resume that followed."""
    rows = []
    for kill in kills:
        found = recovery_after(events, kill["time"])
        if found is None:
            rows.append({**kill, "detected": None})
            continue
        failure, resume = found
        detect = failure["time"] - kill["time"]
        parts = {k: resume[k] for k in ("restart_s", "spawn_s", "startup_s", "wait_s", "reform_s", "load_s",
                                        "first_step_s") if k in resume}
        rows.append({**kill, **parts, "cause": failure["cause"], "detection_s": detect,
                     "path": resume.get("path", "restart"), "recovery_s": detect + resume["recovery_s"],
                     "lost_steps": resume["lost_steps"], "tier": resume.get("tier", "durable")})
    return rows


def kind_name(kind: str) -> str:
    return kind if kind == "NODE" else f"SIG{kind}"


PARTS = (("detection_s", "kill -> failure noticed"),
         ("restart_s", "failure -> checkpoint load starts (restarts and in process alike), of which:"),
         ("spawn_s", "  restarts: stop the group, rendezvous, start processes"),
         ("startup_s", "  restarts: the new processes up to the load"),
         ("wait_s", "  in process: the survivors wait for the replacement"),
         ("reform_s", "  in process: the groups formed again"),
         ("load_s", "checkpoint load"), ("first_step_s", "first step after the load"))


def print_recoveries(rows: list[dict]) -> None:
    print("\n signal  rank   step  cause       path        detect  restart   load  1st step  recovery"
          "  lost steps  tier")
    for r in rows:
        if "cause" not in r:
            print(f" {kind_name(r['signal']):<7} {r['rank']:>4} {r['step']:>6}  (no recovery recorded)")
            continue
        print(f" {kind_name(r['signal']):<7} {r['rank']:>4} {r['step']:>6}  {r['cause']:<10} {r['path']:<10} "
              f"{r['detection_s']:6.2f}s {r['restart_s']:7.2f}s {r['load_s']:5.2f}s {r['first_step_s']:8.2f}s "
              f"{r['recovery_s']:8.2f}s {r['lost_steps']:>10}  {r['tier']}")
    recovered = [r for r in rows if "cause" in r]
    if not recovered:
        return
    median = statistics.median(r["recovery_s"] for r in recovered)
    print(f"\nmedian recovery (kill -> first step after resume): {median:.2f}s (goal <= 1s)")
    for kind in sorted({r["signal"] for r in recovered}):
        mine = [r for r in recovered if r["signal"] == kind]
        print(f"  {kind_name(kind):<7} median {statistics.median(r['recovery_s'] for r in mine):6.2f}s, lost steps "
              f"{'/'.join(str(r['lost_steps']) for r in mine)} (goal <= 1 with memory_every=1), paths "
              f"{', '.join(sorted({r['path'] for r in mine}))}, tiers {', '.join(sorted({r['tier'] for r in mine}))}")
    for part, what in PARTS:
        values = [r[part] for r in recovered if part in r]
        if values:
            print(f"  median {part[:-2]:<11} {statistics.median(values):6.2f}s  {what} ({len(values)})")


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
    done = max((e for e in events if e["event"] == "done"), key=lambda e: e["wall_s"], default={})
    if done:
        wall_min = done["wall_s"] / 60
        print(f"goodput {100 * done.get('goodput', 0):.1f}% with {kills} kills in {wall_min:.1f} min "
              f"({kills / max(wall_min, 1e-9):.2f} failures/min; goal >= 98% at 1/min)")


def print_at_one_a_minute(events: list[dict], kills: int, ref_done: dict) -> None:
    """The goal's rate is one fault a minute, and a run's random intervals rarely give exactly that. What a
    fault cost here on average (the goodput below the undisturbed run's, in seconds of this run's wall),
    projected onto one fault a minute on top of the undisturbed run's goodput."""
    done = max((e for e in events if e["event"] == "done"), key=lambda e: e["wall_s"], default={})
    if not (done and kills and ref_done.get("goodput")):
        return
    per_fault = max(ref_done["goodput"] - done["goodput"], 0.0) * done["wall_s"] / kills
    print(f"at one fault a minute: a fault cost {per_fault:.2f}s on average here (this run's mix), "
          f"{100 * per_fault / 60:.1f}% of each minute; on top of the undisturbed "
          f"{100 * ref_done['goodput']:.1f}%, about {100 * (ref_done['goodput'] - per_fault / 60):.1f}% goodput")


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
    ref = launcher(args.config, out / "reference", args.nproc * args.nodes, args.overrides, out / "reference.log")
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
    print_at_one_a_minute(events, len(kills), ref_done)
    same = same_as_reference(args, out / "reference", run_dir)
    return 0 if code == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
