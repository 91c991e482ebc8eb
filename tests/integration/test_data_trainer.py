"""The trainer reads through data.loader.BatchLoader: with 2 ranks under torchrun and 2 loader
workers per rank, a run whose rank is SIGKILLed and which is then started again gives exactly the
per-step losses of an uninterrupted run that read its batches in-process (num_workers=0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import REPO, SMOKE, child_env, read_metrics, run_trainer, trainer_cmd

# 30 steps: the kill lands a step or two after step 5 (polled every 20 ms), 25 steps before the end.
# The durable tier alone: the memory tier (on by default where /dev/shm is in memory) would resume from a
# snapshot of the step or two after 5, and which one depends on when the kill lands.
OVERRIDES = ["train.steps=30", "train.log_every=1", "train.eval_every=0", "checkpoint.every=5",
             "checkpoint.memory_every=0", "log.progress=false"]


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def rank_pid(agent: int, rank: int) -> int | None:
    for pid in children(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def test_two_ranks_with_workers_killed_and_resumed_match_in_process_reading(cache_dir, tmp_path):
    reference = tmp_path / "reference"
    run_trainer(reference, [*OVERRIDES, "data.num_workers=0"], nproc=2)

    crashed = tmp_path / "crashed"
    args = [f"run.dir={crashed}", *OVERRIDES, "data.num_workers=2"]
    agent = subprocess.Popen(trainer_cmd(2, SMOKE, args), cwd=REPO, env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    commit = crashed / "checkpoints" / "step-00000005" / "COMMIT.json"
    deadline = time.monotonic() + 120
    while not commit.exists() and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = rank_pid(agent.pid, 1)
    assert victim is not None and agent.poll() is None, "the run finished (or failed) before it could be killed"
    os.kill(victim, signal.SIGKILL)
    _, stderr = agent.communicate(timeout=60)
    assert agent.returncode != 0, stderr.decode()[-2000:]
    before = read_metrics(crashed)
    assert 5 <= max(before) < 30

    second = run_trainer(crashed, [*OVERRIDES, "data.num_workers=2"], nproc=2)
    resumed_from = int(second.stdout.split("resumed from step ")[1].split()[0])
    assert resumed_from >= 5 and resumed_from % 5 == 0
    ref, after = read_metrics(reference), read_metrics(crashed)
    assert sorted(after) == list(range(1, 31))
    assert [after[s]["loss"] for s in after] == [ref[s]["loss"] for s in ref]
    state = json.loads((crashed / "checkpoints" / "step-00000030" / "train_state.json").read_text())
    assert state["data"]["samples_consumed"] == 30 * 8  # the loader's state, as the trainer saved it
