"""A lost node, seven ways, and a lost rank of a multi-node job, three ways, for each node count, side by
side in one run: the loss -> the first resumed step.

    python scripts/bench_node_loss.py [--losses 3] [--modes inproc,restart,spare,spare-restart,host,host-restart,silent]
                                      [--nodes 2] [--config configs/smoke.yaml] [key=value ...]
    python scripts/bench_node_loss.py --modes spare,spare-restart --nodes 3,4 \
        train.global_batch=12 train.micro_batch=1     # a global batch every node count divides
    python scripts/bench_node_loss.py --modes rank,rank-restart,rank-1node --nodes 2,3,4 \
        train.global_batch=12 train.micro_batch=1     # a global batch every node count divides

Each loss is a fresh job of N launchers on loopback, N from --nodes (`--nnodes 1:N`, one rank each, each
node with its own memory directory, memory tier every step): once all train, the last launcher that does
not host the store and every process below it are SIGKILLed and its memory directory deleted (a lost node),
and the others go on. The modes:
- `inproc` (`fault.in_process=true`): the survivors keep their processes and go on in a smaller world
  (launch/recovery/coordinator.py);
- `restart` (`fault.in_process=false`): the survivors' group restarts through a new rendezvous;
- `spare`: as inproc, with one more launcher started beyond --nnodes MAX once all train (a spare, waiting
  warm): a survivor's launcher claims it, and it starts the lost rank in process in its place
  (launch/spares.py), the world size unchanged; also timed, lost node -> first step of the whole world;
- `spare-restart`: as spare, with `fault.in_process=false`: the group restarts through a new rendezvous,
  the spare in it;
- `host`: the lost node is the one hosting the rendezvous store, with `--rdzv-endpoint A,B`: the
  survivors move to B, their launchers adopt their running ranks, which follow the store there and go on in
  process;
- `host-restart`: as host, with `fault.in_process=false`: the survivors' group restarts at B;
- `silent`: as inproc, but the node is SIGSTOPped instead (lost without a word, as a node whose power or
  link is gone: its connections stay open, so no collective of the survivors fails); their launchers find
  it silent after fault.node_silence_s (pass `fault.node_silence_s=S` to try another bound) and tell their
  ranks to go on without it; the split (found silent + the recovery after it) is printed.
Each restores the N-rank memory snapshot resharded (memory-reshard), or with a spare the lost rank's part from
its peer copy (memory-peer). The modes alternate.

The rank modes run, for each node count N of --nodes, a job of N launchers (`--nnodes N`, one rank each)
and SIGKILL the trainer process of the highest rank of a node that does not host the store:
- `rank` (`fault.in_process=true`): its launcher replaces it alone; every other rank keeps its process;
- `rank-restart` (`fault.in_process=false`): every rank restarts through a new rendezvous;
- `rank-1node`: the one-node figure of the same world: one launcher with N ranks, in process.

One untimed loss of the first mode comes first (the first job of a run pays for cold caches). Prints, per
loss, the ledger's recovery (the survivor noticing -> its first step) and its split, the tier and the lost
steps, the time from the SIGKILL to the first resumed step, and each mode's median; per node count, each
in-process mode / its restart mode, and for the rank modes in process across nodes / on one node. On a shared
machine compare the columns of one run, not numbers from different runs."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures is not installed

from tests.fixtures import free_port, freeze_tree, kill_tree, rendezvous_host
from trainer.runtime.protocol import read_events, read_heartbeats, read_jsonl

REPO = Path(__file__).resolve().parents[1]
MODES = {"inproc": ["fault.in_process=true"], "restart": ["fault.in_process=false"],
         "spare": ["fault.in_process=true"], "spare-restart": ["fault.in_process=false"],
         "host": ["fault.in_process=true"],
         "host-restart": ["fault.in_process=false"], "silent": ["fault.in_process=true"],
         "rank": ["fault.in_process=true"], "rank-restart": ["fault.in_process=false"],
         "rank-1node": ["fault.in_process=true"]}
RANK_MODES = ("rank", "rank-restart", "rank-1node")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--losses", type=int, default=3, help="lost nodes per mode (a fresh job each)")
    p.add_argument("--modes", default="inproc,restart,spare,host,silent",
                   help="which modes: inproc, restart, spare, host, silent (a lost node); rank, rank-restart, "
                        "rank-1node (a lost rank, for each --nodes)")
    p.add_argument("--nodes", default="2", help="node counts, e.g. 2,3,4")
    p.add_argument("--timeout", type=float, default=180, help="the most any one wait may take (s)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    args.nodes = [int(n) for n in args.nodes.split(",") if n]
    if any(n < 2 for n in args.nodes):
        p.error("--nodes: 2 nodes at least")
    if unknown := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    return args


def wait_until(what: str, check, timeout: float) -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise RuntimeError(f"no {what} within {timeout:.0f}s")
        time.sleep(0.01)


def last_step(run_dir: Path) -> int:
    records = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return max((r["step"] for r in records if "step" in r), default=0)


def first_step_after(run_dir: Path, since: float) -> float:
    """The newest first step (heartbeat clock) any rank of the job took after `since`; nan before one."""
    firsts = [b.startup.t_first for d in run_dir.glob("heartbeats-*") for b in read_heartbeats(d).values()]
    first = max(firsts, default=0.0)
    return first - since if first > since else float("nan")


def firsts_after(run_dir: Path, since: float) -> list[float]:
    """The first steps (heartbeat clock) of the ranks that took one after `since`: the spare's and the
    survivor's once the world is whole again."""
    return [b.startup.t_first for d in run_dir.glob("heartbeats-*") for b in read_heartbeats(d).values()
            if b.startup.t_first > since]


def resumes_after(run_dir: Path, since: float) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "resume" and e["time"] > since]


def one_group(run_dir: Path, nodes: int) -> bool:
    """Whether `nodes` ranks train in one worker group, each past its first step."""
    beats = [b for d in run_dir.glob("heartbeats-*") for b in read_heartbeats(d).values()]
    return len(beats) == nodes and len({b.group for b in beats}) == 1 and all(b.startup.t_first for b in beats)


def one_loss(args: argparse.Namespace, out: Path, mode: str, nodes: int, label: str) -> dict:
    """`nodes` launchers (and a spare), one lost once all train; the first resume event after it, with
    `kill_to_step_s` (and for a spare `kill_to_whole_s`: until the world of `nodes` trains again)."""
    run_dir = out / label
    endpoint = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2 if mode.startswith("host") else 1))
    procs = {}

    def start(node: str) -> None:
        cmd = [sys.executable, "-m", "launch", f"--nnodes=1:{nodes}", "--nproc-per-node=1",
               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={label}", str(REPO / args.config), f"run.dir={run_dir}",
               "log.progress=false", "train.eval_every=0", "train.steps=1000000", "checkpoint.every=100000",
               "checkpoint.memory_every=1",
               f"checkpoint.memory_dir={out / (label + '-shm-' + node)}", *MODES[mode], *args.overrides]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs[node] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=(out / f"{label}-{node}.log").open("w"),
                                       stderr=subprocess.STDOUT, start_new_session=True)

    names = "abcdefgh"[:nodes]
    start(names[0])
    time.sleep(1.0)  # within the rendezvous's last call (3 s): every node takes part
    for name in names[1:]:
        start(name)
    try:
        def training() -> bool:
            if ended := [n for n, p in procs.items() if p.poll() is not None]:
                raise RuntimeError(f"launcher(s) {ended} ended before training (see {out}/{label}-*.log)")
            return last_step(run_dir) >= 20 and one_group(run_dir, nodes)

        wait_until(f"{nodes}-node training", training, args.timeout)
        if mode.startswith("spare"):
            start("spare")
            wait_until("the spare waiting", lambda: any(e["event"] == "spare_waiting" for e in read_events(run_dir)),
                       args.timeout)
        host = names[rendezvous_host(run_dir, [procs[n] for n in names])]  # the first to bind, not always a
        lost = host if mode.startswith("host") else names.replace(host, "")[-1]
        killed = time.time()
        (freeze_tree if mode == "silent" else kill_tree)(procs[lost].pid)
        shutil.rmtree(out / f"{label}-shm-{lost}", ignore_errors=True)
        wait_until("a resume", lambda: resumes_after(run_dir, killed), args.timeout)
        row = {**resumes_after(run_dir, killed)[0], "mode": mode, "kill_to_step_s": first_step_after(run_dir, killed)}
        if mode == "silent":  # the split: the silence bound (fault.node_silence_s), then the recovery after it
            found = [e["time"] for e in read_events(run_dir) if e["event"] == "partition" and e["time"] > killed]
            row["found_s"] = min(found) - killed if found else float("nan")
        if mode.startswith("spare"):
            wait_until("the whole world training", lambda: len(firsts_after(run_dir, killed)) >= nodes, args.timeout)
            row["kill_to_whole_s"] = max(firsts_after(run_dir, killed)) - killed
        return row
    finally:
        for proc in procs.values():
            kill_tree(proc.pid)


def one_rank_loss(args: argparse.Namespace, out: Path, mode: str, nodes: int, label: str) -> dict:
    """A job of `nodes` ranks (one launcher per rank, or one launcher with them all for rank-1node): the
    trainer of the highest rank of a node without the store SIGKILLed once all train; the first resume
    event after it, with `kill_to_step_s`."""
    run_dir = out / label
    endpoint, launchers = f"127.0.0.1:{free_port()}", 1 if mode == "rank-1node" else nodes
    procs = []
    for node in range(launchers):
        cmd = [sys.executable, "-m", "launch", f"--nnodes={launchers}", f"--nproc-per-node={nodes // launchers}",
               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={label}", str(REPO / args.config), f"run.dir={run_dir}",
               "log.progress=false", "train.eval_every=0", "train.steps=1000000", "checkpoint.every=100000",
               "checkpoint.memory_every=1", f"checkpoint.memory_dir={out / f'{label}-shm-{node}'}", *MODES[mode],
               *args.overrides]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=(out / f"{label}-{node}.log").open("w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        def training() -> bool:
            if ended := [p.pid for p in procs if p.poll() is not None]:
                raise RuntimeError(f"a launcher ended before training (see {out}/{label}-*.log): {ended}")
            return last_step(run_dir) >= 20

        wait_until(f"{nodes}-rank training", training, args.timeout)
        host = rendezvous_host(run_dir, procs) if launchers > 1 else 0
        node = launchers - 1 if host != launchers - 1 else 0
        beats = {b.rank: b.pid for d in run_dir.glob(f"heartbeats-*{procs[node].pid}-*")
                 for b in read_heartbeats(d).values()}
        killed = time.time()
        os.kill(beats[max(beats)], 9)
        wait_until("a resume", lambda: resumes_after(run_dir, killed), args.timeout)
        time.sleep(0.5)  # every node's first step in the new generation
        return {**resumes_after(run_dir, killed)[0], "mode": mode, "nodes": nodes,
                "kill_to_step_s": first_step_after(run_dir, killed)}
    finally:
        for proc in procs:
            kill_tree(proc.pid)


def main() -> int:
    args = parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-node-loss-"))
    print(f"[bench_node_loss] modes {args.modes}, {args.losses} lost node(s) each, {args.config}, "
          f"{os.cpu_count()} CPU cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    rows = []
    runs = [(m, n) for m in args.modes for n in args.nodes]
    mode, nodes = runs[0]  # one untimed loss first: the first job of a run pays for cold caches
    (one_rank_loss if mode in RANK_MODES else one_loss)(args, out, mode, nodes, "warm-up")
    for i in range(args.losses):
        for mode, nodes in (runs if i % 2 == 0 else runs[::-1]):
            mode_label = f"{mode}-{nodes}n"
            row = (one_rank_loss if mode in RANK_MODES else one_loss)(args, out, mode, nodes, f"{mode_label}-{i}")
            row["mode"] = mode_label
            rows.append(row)
            split = (f" = found silent after {row['found_s']:.2f}s + {row['kill_to_step_s'] - row['found_s']:.2f}s "
                     f"to the first step" if "found_s" in row else "")
            print(f"[bench_node_loss] {mode_label} #{i}: kill -> first resumed step "
                  f"{row['kill_to_step_s']:.2f}s{split}, recovery {row['recovery_s']:.2f}s ({row['path']}, "
                  f"{row['tier']}, {row['lost_steps']} lost)",
                  flush=True)
    print(f"\n{'mode':>16} {'path':>11} {'kill->step':>11} {'recovery':>9} {'wait/restart':>13} {'load':>7} "
          f"{'first step':>11} {'tier':>15} {'lost':>5}")
    for r in rows:
        waited = r.get("wait_s", r.get("restart_s", 0.0))
        print(f"{r['mode']:>16} {r['path']:>11} {r['kill_to_step_s']:>10.2f}s {r['recovery_s']:>8.2f}s "
              f"{waited:>12.2f}s {r['load_s']:>6.2f}s {r['first_step_s']:>10.2f}s {r['tier']:>15} {r['lost_steps']:>5}")
    labels = list(dict.fromkeys(r["mode"] for r in rows))
    medians = {m: statistics.median(r["kill_to_step_s"] for r in rows if r["mode"] == m) for m in labels}
    print("\nmedian lost node -> first resumed step: " + ", ".join(f"{m} {v:.2f}s" for m, v in medians.items()))
    for n in args.nodes:
        wholes = {}
        for m in (f"spare-{n}n", f"spare-restart-{n}n"):
            if whole := [r["kill_to_whole_s"] for r in rows if r["mode"] == m]:
                wholes[m] = statistics.median(whole)
                print(f"{m}: median lost node -> first step of the whole world again (the spare in) "
                      f"{wholes[m]:.2f}s ({', '.join(f'{w:.2f}s' for w in whole)})")
        if len(wholes) == 2:
            print(f"{n} nodes: a node lost with a spare, in process / restart: "
                  f"{wholes[f'spare-{n}n'] / wholes[f'spare-restart-{n}n']:.2f}")
        for fast, slow, what in (("inproc", "restart", "a node lost"), ("host", "host-restart", "the host lost")):
            if {f"{fast}-{n}n", f"{slow}-{n}n"} <= set(medians):
                ratio = medians[f"{fast}-{n}n"] / medians[f"{slow}-{n}n"]
                print(f"{n} nodes: {what}, in process / restart: {ratio:.2f}")
        rank, restart, one = (medians.get(f"{m}-{n}n") for m in RANK_MODES)
        if rank and one:
            print(f"{n} nodes: a rank lost, in process across nodes / on one node: {rank / one:.2f}")
        if rank and restart:
            print(f"{n} nodes: a rank lost, in process / restart: {rank / restart:.2f}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
