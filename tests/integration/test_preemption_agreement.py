"""The preemption agreement no longer blocks after every step (trainer.runtime.fault.PreemptionFlag.agreed: on
fast steps the ranks agree every few steps, each check reading the all-reduce started at the previous
one; on slow steps they block at every step). On 3 real gloo processes with uneven step times and a
real SIGTERM to one of them: every rank stops at the same step, within the promised delay; on slow
steps at the end of the very step the signal came in; a signal in the last step stops nobody early;
and no collective is left pending either way (the barrier after each phase matches on every rank)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fixtures import free_port
from trainer.runtime import fault

# name: (steps, seconds per step at least (at most 1.5x that), the rank that gets SIGTERM and in which step)
PHASES = {
    "fast steps": (120, 0.01, (1, 40)),
    "slow steps": (6, fault.BLOCK_ABOVE_S + 0.05, (2, 5)),
    "signal in the last step": (30, 0.01, (0, 30)),
    "no signal": (30, 0.01, (None, None)),
}


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng, results = random.Random(rank), {}
    for name, (steps, step_s, target) in PHASES.items():
        flag, stopped = fault.PreemptionFlag(), None
        for step in range(1, steps + 1):
            time.sleep(rng.uniform(1.0, 1.5) * step_s / 2)  # uneven compute, a collective, more compute
            dist.all_reduce(torch.ones(8))
            if (rank, step) == target:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(rng.uniform(1.0, 1.5) * step_s / 2)
            if flag.agreed(step, world, torch.device("cpu"), last=step == steps):
                stopped = step
                break
        results[name] = {"stopped": stopped, "received": flag.received}
        flag.close()
        dist.barrier()  # matched on every rank: nothing of the agreement is left pending
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_every_rank_stops_at_the_same_step_after_a_sigterm(tmp_path):
    world = 3
    mp.start_processes(_ranks, args=(world, free_port(), str(tmp_path)), nprocs=world, start_method="spawn",
                       join=True)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]
    fast = [r["fast steps"] for r in results]
    assert [r["received"] for r in fast] == [False, True, False], fast
    stopped = fast[0]["stopped"]
    # Agreed about every CHECK_EVERY_S: the stop comes after at most two intervals of at most 32 steps.
    assert stopped is not None and 40 <= stopped <= 40 + 2 * fault.MAX_STEPS_BETWEEN and \
        all(r["stopped"] == stopped for r in fast), fast
    assert [r["slow steps"] for r in results] == [
        {"stopped": 5, "received": False}, {"stopped": 5, "received": False}, {"stopped": 5, "received": True}]
    assert [r["signal in the last step"]["stopped"] for r in results] == [None] * world
    assert [r["no signal"] for r in results] == [{"stopped": None, "received": False}] * world
