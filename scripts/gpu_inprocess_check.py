"""GPU check of in-process recovery with NCCL (called by scripts/gpu_check.sh; needs 2 or more GPUs:
NCCL refuses two ranks on one GPU). Runs `configs/smoke.yaml` under `python -m launch` with NCCL, one rank
per GPU and the memory tier on every step; once every rank trains, SIGKILLs rank 1's trainer (its
heartbeat pid). Passes when the other ranks kept their processes (the ledger's `in_process_done`), the
resume took the in-process path from memory with no step lost, and the run finished; prints the split.

    python scripts/gpu_inprocess_check.py [--gpus N] [--timeout 240] [--backend nccl]

`--backend gloo --gpus 2` runs the same check on CPU (the script's own dry run).

Exit status: 0 passed, 1 failed (the line says what), 2 fewer than 2 GPUs (skipped, said)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures is not installed

import torch

from tests.fixtures import kill_tree
from trainer.runtime.protocol import HeartbeatRecord, read_events, read_heartbeats

REPO = Path(__file__).resolve().parents[1]


def rank_beats(run_dir: Path) -> dict[int, HeartbeatRecord]:
    beats: dict[int, HeartbeatRecord] = {}
    for d in run_dir.glob("heartbeats-*"):
        beats.update(read_heartbeats(d))
    return beats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    args = p.parse_args()
    if args.gpus < 2:
        print(f"gpu_inprocess_check: skipped: in-process recovery with NCCL needs 2 GPUs or more ({args.gpus} here)")
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-inproc-"))
    cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={args.gpus}", str(REPO / "configs/smoke.yaml"),
           f"run.dir={run_dir}", f"dist.backend={args.backend}", "train.steps=400", "train.eval_every=0",
           "checkpoint.every=0", "checkpoint.memory_every=1", "log.progress=false"]
    log = (run_dir / "launcher.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + args.timeout
    try:
        while not (len(b := rank_beats(run_dir)) == args.gpus and all(x.step >= 20 for x in b.values())):
            if time.time() > deadline or proc.poll() is not None:
                print(f"gpu_inprocess_check: FAILED: the ranks did not all train (log: {run_dir}/launcher.log)")
                return 1
            time.sleep(0.1)
        victim = rank_beats(run_dir)[1].pid
        kill_tree(victim)
        killed = time.time()
        proc.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        print(f"gpu_inprocess_check: FAILED: the run did not finish within {args.timeout:.0f}s ({run_dir})")
        return 1
    finally:
        kill_tree(proc.pid)
    events = read_events(run_dir)
    resume = next((e for e in events if e["event"] == "resume" and e["time"] > killed), None)
    done = next((e for e in events if e["event"] == "in_process_done"), None)
    ok = (proc.returncode == 0 and resume is not None and resume["path"] == "in-process" and done is not None
          and resume["lost_steps"] == 0 and resume["tier"].startswith("memory"))
    split = ("no resume" if resume is None else
             f"path {resume['path']}, tier {resume['tier']}, {resume['lost_steps']} lost, recovery "
             f"{resume['recovery_s']:.2f}s (left {resume.get('leave_s', 0):.3f}s, "
             f"waited {resume.get('wait_s', 0):.2f}s, "
             f"re-formed {resume.get('reform_s', 0):.2f}s, restored {resume.get('restore_s', 0):.2f}s, first step "
             f"{resume['first_step_s']:.2f}s), kept pids {done['kept_pids'] if done else '-'}")
    print(f"gpu_inprocess_check: {'passed' if ok else 'FAILED'}: {args.backend}, {args.gpus} ranks, rank 1 "
          f"(pid {victim}) SIGKILLed: {split}; launcher exit {proc.returncode} (log: {run_dir}/launcher.log)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
