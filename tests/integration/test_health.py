"""Faults that crash nothing, for real (two gloo ranks under torchrun, the real trainer; each fault injected
through a test-only hook, trainer.health.inject and data.stream's REKINDLE_POISON): one bit flipped once in
one rank's gradient, found by a spot check and the step redone; a poisoned stretch of data, its steps
skipped, and the same samples skipped after a crash and a resume from before them; a rank wrong the same
way every time, named faulty by its work computed elsewhere; a node whose rank's results differ every time,
and one whose rank fails again and again, set aside with a spare in its place."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from tests.fixtures import kill_tree
from tests.helpers import (
    finish,
    free_port,
    launch,
    load_final,
    node_beat,
    read_metrics,
    run_trainer,
    wait_for_event,
    wait_for_one_group,
    wait_for_step,
)
from trainer.runtime.protocol import read_events

RUN = ["train.log_every=1", "train.eval_every=0", "checkpoint.memory_every=0"]


def verdicts(run_dir) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "verdict"]


def same_run(a, b, steps: int, skipped: tuple = ()) -> None:
    """Every step's loss (but those of `skipped` steps, not computed again after a resume) and the final
    parameters, bit for bit."""
    ours, theirs = read_metrics(a), read_metrics(b)
    assert sorted(ours) == sorted(theirs) == list(range(1, steps + 1))
    assert [ours[s]["loss"] for s in ours if s not in skipped] == [theirs[s]["loss"] for s in ours if s not in skipped]
    mine, reference = load_final(a), load_final(b)
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine if k != "step"), "the final parameters differ"


def test_a_bit_flipped_once_in_one_ranks_gradient_is_found_by_a_spot_check_and_the_step_redone(tmp_path):
    """`fault.verify_every=10`; rank 1's gradient gets one bit flipped in the first computation of step 20 (a
    mantissa bit: nothing anomalous). The spot check at step 20 replays it: rank 1's gradients differ, a
    second replay agrees with the first, so the corruption was transient; the replay's results are applied.
    The run is bit-identical to an uninterrupted one, and the ledger names step 20 and rank 1."""
    run = [*RUN, "train.steps=24", "checkpoint.every=24", "fault.verify_every=10"]
    run_trainer(tmp_path / "reference", run, nproc=2)
    out = run_trainer(tmp_path / "flipped", run, nproc=2, env={"REKINDLE_FLIP_GRAD": "1@20"})
    (found,) = verdicts(tmp_path / "flipped")
    assert (found["kind"], found["step"], found["ranks"], found["spot_check"]) == ("transient", 20, [1], True), found
    assert "rank 1: gradients" in found["evidence"], found
    assert "a transient corruption on rank(s) [1]" in out.stdout + out.stderr
    assert not verdicts(tmp_path / "reference")  # the spot checks at 10 and 20 agreed: no verdict
    same_run(tmp_path / "flipped", tmp_path / "reference", 24)


def test_a_poisoned_stretch_of_data_is_skipped_and_a_kill_after_it_resumes_with_the_same_skip(tmp_path):
    """Stream positions 192-215 (steps 25-27 of a global batch of 8) are random tokens: their loss is far above
    the last 20 steps'; each step is replayed, the replay agrees, so the data is at fault: the update is not
    applied and the samples are recorded as skipped. A second run with the same poison, under the launcher
    (in-process recovery off), has its rank 0 SIGKILLed after step 30: the group restarts from its checkpoint
    of step 20, before the skip, and skips the same samples (from the ledger, without judging them again);
    the run is bit-identical to the first. Resumed on one rank from that checkpoint (resharded), the first run
    skips the same samples too."""
    run = [*RUN, "train.steps=40", "checkpoint.every=20", "fault.anomaly_window=20"]
    poison = {"REKINDLE_POISON": "192-215"}
    run_trainer(tmp_path / "whole", run, nproc=2, env=poison)
    found = verdicts(tmp_path / "whole")
    assert [(e["kind"], e["step"], e["samples"]) for e in found] == [
        ("data", 25, [192, 200]), ("data", 26, [200, 208]), ("data", 27, [208, 216])], found
    assert all("the replay agrees on every rank" in e["evidence"] for e in found), found
    killed = tmp_path / "killed"
    proc = launch(killed, [*run, "fault.in_process=false", "train.eval_every=0"], nproc=2,
                  env={**poison, "REKINDLE_SLOW_RANK": "0:0.2@28-40"})
    try:
        victim = wait_for_step(killed, 30, rank=0)
        assert len(verdicts(killed)) == 3
        os.kill(victim.pid, signal.SIGKILL)
        out = finish(proc)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    resumed = next(e for e in read_events(killed) if e["event"] == "resume")
    assert resumed["step"] == 20 and resumed["tier"] == "durable", resumed
    assert len(verdicts(killed)) == 3  # skipped again, not judged again
    same_run(killed, tmp_path / "whole", 40, skipped=(25, 26, 27))

    # Resharded: the first run, resumed on one rank from its checkpoint of step 20, skips the same samples
    # (from the ledger, not judged again); its losses agree with the two ranks' to float tolerance.
    one = tmp_path / "one-rank"
    shutil.copytree(tmp_path / "whole", one)
    shutil.rmtree(one / "checkpoints" / "step-00000040")
    out = run_trainer(one, run, nproc=1, env=poison)
    assert "resumed from step 20" in out.stdout + out.stderr, out.stderr[-3000:]
    assert len(verdicts(one)) == 3, verdicts(one)
    ours, theirs = read_metrics(one), read_metrics(tmp_path / "whole")
    assert ours[40]["skipped_steps"] == 3, ours[40]
    assert [ours[s]["loss"] for s in range(28, 41)] == pytest.approx([theirs[s]["loss"] for s in range(28, 41)],
                                                                      rel=1e-4)


def test_a_rank_that_computes_wrong_the_same_way_every_time_is_found_by_computing_its_work_elsewhere(tmp_path):
    """Three ranks (tokens, RoPE positions and loss masks to move); rank 2 computes its losses 3x too large
    from step 25, the same way every time (a replay agrees with it: alone, that would read as bad data). The
    loss of step 25 is anomalous; computed elsewhere, rank 2's micro-batches (on rank 0) and those rank 2
    computes for rank 1 disagree: rank 2 is named faulty, not the data."""
    run = [*RUN, "train.steps=28", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=100",
           "fault.verify_every=0", "fault.anomaly_window=20", "data.mask_boundary_loss=true"]  # every input moved
    out = run_trainer(tmp_path, run, nproc=3, env={"REKINDLE_WRONG_RANK": "2@25"}, check=False)
    assert out.returncode != 0
    (found,) = verdicts(tmp_path)
    assert (found["kind"], found["step"], found["ranks"]) == ("faulty", 25, [2]), found
    assert "the replay agrees" in found["evidence"] and "elsewhere" in found["evidence"], found
    assert "this rank (rank 2) computes wrong results" in out.stdout + out.stderr, out.stderr[-3000:]


STEPS = 80  # of the node tests: rank 0 slowed to 0.2 s a step, so that the spare waits before the fault


def node_set_aside(tmp_path: Path, overrides: list[str], b_env: dict, fault) -> tuple[int, str]:
    """`--nnodes 1:2`, one rank per node: node a (hosting the store), node b (`b_env`), and a spare started
    once both train, waiting. `fault(run_dir, b, procs)` then strikes node b and returns its rank. Node b
    must end with exit 5, its host set aside (run.dir/excluded-nodes and a `node_excluded` record), and the
    spare start its rank in its place in process; the run finishes. Returns (b's rank, b's output)."""
    run_dir = tmp_path / "run"
    args = ["--nnodes=1:2", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=aside"]
    run = [f"train.steps={STEPS}", "train.global_batch=12", "train.micro_batch=2", "checkpoint.every=200",
           "checkpoint.memory_every=1", "fault.straggler_factor=0", *overrides]

    def node(name: str, env: dict) -> subprocess.Popen:
        return launch(run_dir, [*run, f"checkpoint.memory_dir={tmp_path / name}"], nproc=1, extra_args=args,
                      env={"REKINDLE_SLOW_RANK": f"0:0.2@1-{STEPS}", **env})

    a = node("shm-a", {})
    wait_for_event(run_dir, "rendezvous", launchers=[a])  # a hosts the store
    b = node("shm-b", b_env)
    procs = [a, b]
    try:
        wait_for_one_group(run_dir, procs, 5)
        spare = node("shm-s", {})
        procs.append(spare)
        wait_for_event(run_dir, "spare_waiting", timeout=60, launchers=procs)
        rank = fault(run_dir, b, procs)
        out_b = finish(b, timeout=120)
        outs = [finish(p, timeout=120) for p in (a, spare)]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert b.returncode == 5 and "set aside" in out_b, out_b[-3000:]
    assert [a.returncode, spare.returncode] == [0, 0], [o[-3000:] for o in outs]
    events = read_events(run_dir)
    (excluded,) = [e for e in events if e["event"] == "node_excluded"]
    assert excluded["host"] == socket.gethostname() and excluded["rank"] == rank, excluded
    assert Path(run_dir / "excluded-nodes").read_text().split() == [socket.gethostname()]
    joined = [e for e in events if e["event"] == "spare_joined"]
    assert [e["in_process"] for e in joined] == [True] and joined[0]["ranks"] == [rank], joined
    assert read_metrics(run_dir)[STEPS]["step"] == STEPS
    return rank, out_b


def test_a_node_whose_rank_corrupts_every_step_is_set_aside_and_a_spare_takes_its_place(cache_dir, tmp_path):
    """The rank of node b flips a gradient bit in every computation from step 45 (the spare waits by then):
    the spot check at step 50 finds its results differ from the replay, and differ again: faulty. It writes
    its host to run.dir/excluded-nodes and the ledger (`node_excluded`) and exits EXIT_FAULTY (5); its
    launcher leaves the job with that code, the rendezvous left open. The other node's launcher takes node b
    for lost and claims the spare, which starts the rank in its place in process; the run finishes."""
    rank, out_b = node_set_aside(tmp_path, ["fault.verify_every=10"], {"REKINDLE_CORRUPT_RANK": "*@45"},
                                 lambda run_dir, b, procs: node_beat(run_dir, b.pid).rank)
    assert "computes wrong results" in out_b, out_b[-3000:]
    verdict = [e for e in read_events(tmp_path / "run") if e["event"] == "verdict"]
    assert [(e["kind"], e["step"], e["ranks"]) for e in verdict] == [("faulty", 50, [rank])], verdict
    assert [e["by"] for e in read_events(tmp_path / "run") if e["event"] == "node_excluded"] == ["trainer"]


def test_a_node_whose_rank_fails_again_and_again_is_set_aside_and_a_spare_takes_its_place(cache_dir, tmp_path):
    """`fault.node_failure_limit=2`. Node b's trainer process (its heartbeat pid) is SIGKILLed once: replaced
    in process. Killed again: its ranks failed twice and nowhere else did anything fail, so its launcher sets
    it aside (`node_excluded` by the launcher, exit 5, the rendezvous left open), and the spare takes its
    place."""

    def killed_twice(run_dir: Path, b: subprocess.Popen, procs: list) -> int:
        first = node_beat(run_dir, b.pid)
        os.kill(first.pid, signal.SIGKILL)
        wait_for_event(run_dir, "in_process_done", timeout=60, launchers=procs)
        second = node_beat(run_dir, b.pid)
        assert second.pid != first.pid, "node b's rank was not replaced"
        os.kill(second.pid, signal.SIGKILL)
        return first.rank

    _, out_b = node_set_aside(tmp_path, ["fault.node_failure_limit=2"], {}, killed_twice)
    assert "failed 2 times" in out_b, out_b[-3000:]
    assert [e["by"] for e in read_events(tmp_path / "run") if e["event"] == "node_excluded"] == ["launcher"]
