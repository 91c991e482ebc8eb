"""The memory tier (checkpoint.memory_every): a SIGKILLed rank resumes from the node-local snapshot of
the last step or the one before it, bit-identical to an uninterrupted run; a lost node (launcher killed,
memory deleted) from the peer copies on the other node; a corrupt snapshot, one of
another config or of another run is never loaded (the newest good one every rank has is, else the
durable checkpoint), and the log says why; the run's snapshots are removed when it ends. Real
processes, real kills, real files; every wait bounded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.fixtures import kill_tree, wait_for_rendezvous_host
from tests.helpers import (
    REPO,
    child_env,
    finish,
    free_port,
    launch,
    load_final,
    read_metrics,
    trainer_cmd,
    wait_for_step,
)
from trainer.checkpoint import memory_auto
from trainer.runtime.protocol import read_events, read_heartbeats, read_jsonl

STEPS = 80
BASE = [f"train.steps={STEPS}", "checkpoint.every=50"]  # durable: only the final step


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank launcher run, memory tier off."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = finish(launch(run_dir, [*BASE, "fault.warm_restarts=false"]))  # (no restarts: no fork server)
    assert "done: 0 restart(s)" in out, out[-3000:]
    return run_dir


def assert_same_run(ours: Path, reference: Path) -> None:
    """Per-step losses and final parameters (the newest commit) bit-identical to the reference run's."""
    mine, theirs = read_metrics(ours), read_metrics(reference)
    steps = max(theirs)
    assert [mine[s]["loss"] for s in range(1, steps + 1)] == [theirs[s]["loss"] for s in range(1, steps + 1)]
    a, b = load_final(ours), load_final(reference)
    assert a["step"] == b["step"] == steps
    for name in b:
        assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name


def test_sigkilled_ranks_resume_from_memory_each_time_and_match_an_uninterrupted_run(reference, tmp_path):
    """The real trainer process (its heartbeat pid) SIGKILLed three times, each rank at least once, 20 or
    more steps after each resume. With an eval every step, each first snapshot after a resume lists the
    tensors right after a forward without backward, which leaves FSDP2's root and last block unsharded:
    listing them from the modules' attributes then failed (KeyError of a parameter's id) in every attempt.
    Under in-process recovery (the default) the survivor's first snapshot after a recovery finds its
    listing cached and the replacement's does not: unless every snapshot reshards alike, the two ran
    different all-gathers at the next forward and the replacement aborted."""
    shm = tmp_path / "shm"
    run_dir = tmp_path / "run"
    proc = launch(run_dir, [*BASE, "checkpoint.memory_every=1", f"checkpoint.memory_dir={shm}", "train.eval_every=1"])
    killed = []
    for rank, step in ((1, 8), (0, 33), (1, 55)):
        # Reached only after the previous recovery; in any phase, polled often: with an eval every step a
        # rank is seldom in `train`, and a late look overshoots the planned step (once by 8: 17 steps left).
        victim = wait_for_step(run_dir, step, rank=rank, phases=("train", "eval"), poll_s=0.005)
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(victim.step)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    resumes = [e for e in read_events(run_dir) if e["event"] == "resume"]
    assert [e["tier"] for e in resumes] == ["memory-local"] * 3, resumes
    assert all(e["lost_steps"] <= 2 for e in resumes), resumes
    after = [nxt - e["step"] for e, nxt in zip(resumes, [*killed[1:], STEPS], strict=True)]
    assert min(after) >= 20, (killed, resumes)
    assert resumes[0]["tier_why"].startswith(f"memory snapshot of step {resumes[0]['step']} is newer than"), resumes
    # The records not yet written when a snapshot was taken came back with it: each step up to the last
    # resumed one is in metrics.jsonl once (the steps after a resumed one are redone and logged again).
    logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    last = resumes[-1]["step"]
    assert [logged.count(s) for s in range(1, last + 1)] == [1] * last, logged
    assert f"resumed at step {last} from the memory-local tier" in out
    assert "s (memory-local)" in out, out[-2000:]  # the summary line: recovery 1.2s (memory-local)
    assert_same_run(run_dir, reference)
    assert not any(shm.iterdir()), "the run's snapshots outlived it"


def test_plain_torchrun_restarts_a_sigkilled_rank_from_memory_forming_its_groups_at_once(reference, tmp_path):
    """`torchrun --max-restarts 3` as users type it (its agent shares its rendezvous store with the ranks,
    the same store across restarts), the memory tier on, rank 1's trainer process SIGKILLed: the restarted
    group forms its process group on the first try (it read the dead ranks' addresses from that store:
    `Gloo connectFullMesh failed`, or waited without bound), resumes from memory, and matches the
    uninterrupted run."""
    shm, run_dir, beats = tmp_path / "shm", tmp_path / "run", tmp_path / "heartbeats"
    env = child_env(REKINDLE_HEARTBEAT_DIR=str(beats))  # only to find rank 1's pid: nothing else reads them
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=3",
           f"--master-port={free_port()}", "-m", "trainer", str(REPO / "configs/smoke.yaml"), f"run.dir={run_dir}",
           "log.progress=false", "train.log_every=1", "train.eval_every=0", *BASE, "checkpoint.memory_every=1",
           f"checkpoint.memory_dir={shm}"]
    log = tmp_path / "torchrun.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not ((beat := read_heartbeats(beats).get(1)) and beat.step >= 15 and beat.phase == "train"):
            assert time.time() < deadline and proc.poll() is None, "rank 1 did not reach step 15"
            time.sleep(0.05)
        os.kill(beat.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)  # torchrun's workers do not die with it: none may outlive the test
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "connectFullMesh" not in out and "Traceback" not in out, out[-4000:]
    assert out.count("resumed from step") == 1 and "(memory snapshot in" in out, out[-4000:]
    assert_same_run(run_dir, reference)


def test_a_lost_node_resumes_from_the_copies_on_the_other_node(reference, tmp_path):
    """Two launchers on loopback, one node each, each with its own memory directory: SIGKILL one launcher
    (its rank dies with it) and delete its memory (a lost node); a replacement node joins, and the
    parts come from the surviving node's peer copies: bit-identical to the uninterrupted run."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=peers"]
    run_dir, memory = tmp_path / "run", {node: tmp_path / f"shm-{node}" for node in "ab"}

    def node(name: str) -> subprocess.Popen:
        return launch(run_dir, [*BASE, "checkpoint.memory_every=1", f"checkpoint.memory_dir={memory[name]}"],
                      nproc=1, extra_args=args)

    host = node("a")
    wait_for_rendezvous_host(run_dir, proc=host)  # the first launcher hosts the rendezvous store
    guest = node("b")
    wait_for_step(run_dir, 15)
    assert any(memory["a"].rglob("peer-slot-*.json")) and any(memory["b"].rglob("peer-slot-*.json"))
    kill_tree(guest.pid)  # the launcher, its fork server and its rank: none writes into memory["b"] after
    guest.wait(timeout=30)
    shutil.rmtree(memory["b"])
    replacement = node("b")
    outs = [finish(host), finish(replacement)]
    for proc, out in zip((host, replacement), outs, strict=True):
        assert proc.returncode == 0, out[-4000:]
    resume = next(e for e in read_events(run_dir) if e["event"] == "resume")
    assert resume["tier"] == "memory-peer" and resume["lost_steps"] <= 2, resume
    assert "sent by the rank(s) holding them" in "".join(outs)
    assert_same_run(run_dir, reference)
    assert not any(memory["a"].iterdir()) and not any(memory["b"].iterdir())


def train(run_dir: Path, overrides: list[str], fail_at: int | None = None, nproc: int = 2) -> str:
    """`nproc` ranks without the launcher; with `fail_at`, REKINDLE_FAIL_AT stops them before that step
    (their snapshots stay). Returns the output."""
    env = child_env(**({"REKINDLE_FAIL_AT": str(fail_at)} if fail_at else {}))
    proc = subprocess.run(trainer_cmd(nproc, REPO / "configs/smoke.yaml",
                                      [f"run.dir={run_dir}", "log.progress=false", "train.log_every=1",
                                       "train.eval_every=0", *overrides]),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    if fail_at:
        assert proc.returncode != 0 and f"injected failure at step {fail_at}" in out, out[-3000:]
    else:
        assert proc.returncode == 0, out[-3000:]
    return out


def snapshot_steps(shm: Path, rank: int) -> dict[int, Path]:
    out = {}
    for head in shm.rglob(f"slot-*.rank-{rank}.json"):
        out[json.loads(head.read_text())["step"]] = head.with_suffix(".bin")
    return out


def test_bad_snapshots_are_never_loaded_and_the_log_says_why(reference, tmp_path):
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    opts = [*BASE, "checkpoint.every=5", "checkpoint.memory_every=1", f"checkpoint.memory_dir={shm}"]
    train(run_dir, opts, fail_at=13)
    assert sorted(snapshot_steps(shm, 0)) == sorted(snapshot_steps(shm, 1)) == [10, 11, 12]

    # A flipped byte in rank 1's newest part: step 11 is the newest that every rank has.
    newest = snapshot_steps(shm, 1)[12]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    out = train(run_dir, opts, fail_at=17)
    assert "fails its checksum" in out and "resumed from step 11 (memory snapshot" in out, out[-3000:]
    mine, theirs = read_metrics(run_dir), read_metrics(reference)
    assert [mine[s]["loss"] for s in range(1, 16)] == [theirs[s]["loss"] for s in range(1, 16)]

    # Another config (train.lr): its snapshots (steps 14-16) are not loaded; the durable step 15 is.
    out = train(run_dir, [*opts, "train.lr=0.002"], fail_at=21)
    assert "written with another config" in out and "resumed from step 15 (" in out, out[-3000:]
    assert "memory tier not used: no memory snapshot that every rank has" in out, out[-3000:]

    # Another world size: the 2-rank snapshots (steps 18-20) could be resharded, but the durable step 20
    # is as new: it is loaded.
    out = train(run_dir, [*opts, "train.lr=0.002"], fail_at=22, nproc=1)
    assert "memory tier not used: the 2-rank memory snapshot of step 20, resharded, is not newer than the " \
           "newest durable checkpoint (step 20)" in out and "resumed from step 20 (" in out, out[-3000:]

    # Another run under the same run.dir name (made afresh): its snapshots are not this run's.
    (run_dir / "memory-tier.json").unlink()
    out = train(run_dir, [*opts, "train.lr=0.002", "train.steps=24"])
    assert "removed the memory snapshots of an earlier run" in out and "resumed from step 20 (" in out, out[-3000:]
    assert not any(shm.iterdir()), "the run's snapshots outlived it"


def test_a_smaller_world_resumes_from_the_memory_snapshot_resharded_as_from_the_durable_one(cache_dir, tmp_path):
    """2 ranks stop before step 13: the durable checkpoint of step 12 and the snapshots of steps 10-12
    (both parts on this node). 1 rank then resumes twice: in a copy of the run, from the durable checkpoint
    (DCP reshards it); in the run, with that checkpoint deleted, from the memory snapshot resharded from
    the two parts. The two are the same run: losses and final parameters bit-identical."""
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    opts = ["train.steps=16", "checkpoint.every=12", f"checkpoint.memory_dir={shm}"]
    train(run_dir, [*opts, "checkpoint.memory_every=1"], fail_at=13)
    assert sorted(snapshot_steps(shm, 1)) == [10, 11, 12]
    shutil.copytree(run_dir, tmp_path / "copy")
    shutil.rmtree(run_dir / "checkpoints" / "step-00000012")

    memory = train(run_dir, [*opts, "checkpoint.memory_every=1"], nproc=1)
    assert "resumed from step 12 (memory snapshot of 2 rank(s)" in memory and "resharded to 1" in memory, \
        memory[-3000:]
    assert not any(shm.rglob("*.bin")), "the 2-rank parts outlived the run"
    durable = train(tmp_path / "copy", [*opts, "checkpoint.memory_every=0"], nproc=1)
    assert "resumed from step 12 (" in durable and "saved by 2 rank(s)" in durable, durable[-3000:]
    mine, theirs = read_metrics(run_dir), read_metrics(tmp_path / "copy")
    assert [mine[s]["loss"] for s in range(13, 17)] == [theirs[s]["loss"] for s in range(13, 17)]
    a, b = load_final(run_dir), load_final(tmp_path / "copy")
    assert a["step"] == b["step"] == 16
    for name in b:
        assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name


def test_memory_every_auto_chooses_an_interval_or_says_why_it_is_off_and_0_is_off(cache_dir, tmp_path):
    """memory_every=0: the durable tier alone (no snapshot, no run id file). auto (the default): off with
    one line when memory_dir is on a disk; in memory, every step while the first steps are timed, then
    the chosen interval, kept in run.dir for the run's next starts."""
    shm = tmp_path / "shm"
    train(tmp_path / "off", ["train.steps=3", f"checkpoint.memory_dir={shm}", "checkpoint.memory_every=0"], nproc=1)
    assert not shm.exists() and not (tmp_path / "off" / "memory-tier.json").exists()

    disk = REPO / ".pytest-memory-dir-on-disk" if memory_auto.filesystem_type(tmp_path) == "tmpfs" else shm
    out = train(tmp_path / "disk", ["train.steps=3", f"checkpoint.memory_dir={disk}"], nproc=1)
    assert f"memory tier: off (checkpoint.memory_every=auto): checkpoint.memory_dir {disk} is on a disk" in out, out
    assert not any(disk.rglob("slot-*")) if disk.exists() else True
    shutil.rmtree(REPO / ".pytest-memory-dir-on-disk", ignore_errors=True)

    memory = Path("/dev/shm") / f"rekindle-test-{os.getpid()}-{time.time_ns()}"
    run_dir = tmp_path / "auto"
    try:
        out = train(run_dir, ["train.steps=12", f"checkpoint.memory_dir={memory}"], nproc=1)
        assert "memory tier: auto: every step while the first 8 steps are timed" in out, out
        chosen = re.search(r"memory tier: auto chose every (\d+) step\(s\)", out)
        assert chosen, out
        kept = json.loads((run_dir / "memory-tier.json").read_text())["auto_every"]
        assert kept["every"] == int(chosen[1]) >= 1
        out = train(run_dir, ["train.steps=12", f"checkpoint.memory_dir={memory}"], nproc=1)  # its next start
        assert f"memory tier: auto: every {kept['every']} step(s), as this run chose at its first start" in out, out
    finally:
        shutil.rmtree(memory, ignore_errors=True)
