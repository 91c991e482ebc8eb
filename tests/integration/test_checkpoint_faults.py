"""Checkpoints with real processes: no usable checkpoint (start fresh, or fail when one is required),
resume=never refusing committed steps, crash-during-save recovery (a real SIGKILL, also with the
checkpoint on S3), async vs sync saves, an async write error stopping every rank, resuming 2->1 and
1->2 ranks, and resharding 2->1 and 1->2 with equal parameters.

Run as a script under torchrun (`tests/integration/test_checkpoint_faults.py reshard-worker ROOT`) it is
the 2-rank worker of the resharding test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    REPO,
    SMOKE,
    SOLO,
    assert_same,
    child_env,
    corrupt,
    free_port,
    read_metrics,
    run_trainer,
    smoke_model,
    trained,
    trainer_cmd,
)
from trainer.checkpoint import COMMIT, Checkpointer, TrainState, step_dir
from trainer.runtime.protocol import read_events

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_no_usable_checkpoint_starts_fresh_or_fails_when_required_and_resume_never_refuses_it(cache_dir, tmp_path):
    """With no committed checkpoint, resume=required fails and the default starts fresh. Then
    resume=never over the committed step that run left would, at the next resume, mix two runs:
    refused, and nothing is deleted."""
    proc = run_trainer(tmp_path, ["train.steps=2", "checkpoint.resume=required"], check=False)
    assert proc.returncode == 1
    assert "checkpoint.resume=required but no usable committed checkpoint" in proc.stderr
    proc = run_trainer(tmp_path, ["train.steps=2", "checkpoint.every=2"])
    assert "starting fresh" in proc.stdout
    proc = run_trainer(tmp_path, ["train.steps=2", "checkpoint.resume=never"], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "checkpoint.resume=never, but" in proc.stderr and "holds committed step(s) [2]" in proc.stderr
    assert (tmp_path / "checkpoints" / "step-00000002" / COMMIT).exists()


# The durable tier alone (memory_every=0): these tests are about what it commits and what a resume finds there.
STEPS = ["train.steps=12", "train.log_every=1", "train.eval_every=0", "checkpoint.every=4", "checkpoint.keep=5",
         "checkpoint.memory_every=0"]


@pytest.fixture(scope="module")
def two_rank_reference(cache_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref2")
    run_trainer(run_dir, STEPS, nproc=2)
    return run_dir


def test_rank_killed_during_save_resumes_from_previous_commit(two_rank_reference, tmp_path):
    """shards: rank 1 dies as the step-8 save starts while rank 0 writes; commit: rank 0 dies after
    every shard of step 8 is written but before COMMIT.json. One run directory: the commit crash comes in
    the run that resumed from step 4 after the shards crash; the third run resumes from step 4 again and
    gives the uninterrupted run's losses."""
    for point in ("shards@8:1", "commit@8:0"):
        crashed = subprocess.run(trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *STEPS]),
                                 cwd=REPO, env=child_env(REKINDLE_CRASH_AT=point), capture_output=True, text=True,
                                 timeout=180)
        assert crashed.returncode != 0 and "Signal 9 (SIGKILL)" in crashed.stderr + crashed.stdout, point
        assert not (tmp_path / "checkpoints" / "step-00000008" / COMMIT).exists(), point
        assert point.startswith("shards") or "resumed from step 4 " in crashed.stdout
    resumed = run_trainer(tmp_path, STEPS, nproc=2)
    assert "resumed from step 4 " in resumed.stdout
    ref, after = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [after[s]["loss"] for s in range(1, 13)] == [ref[s]["loss"] for s in range(1, 13)]


def test_async_saves_match_sync(two_rank_reference, tmp_path):
    run_trainer(tmp_path, [*STEPS, "checkpoint.async=true"], nproc=2)
    ref, got = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [got[s]["loss"] for s in got] == [ref[s]["loss"] for s in ref]
    names = lambda run: sorted(  # noqa: E731
        (p.parent.name, p.name) for p in (run / "checkpoints").rglob("*") if p.is_file() and p.name != COMMIT)
    assert names(tmp_path) == names(two_rank_reference)
    sync_state = json.loads((two_rank_reference / "checkpoints/step-00000008/train_state.json").read_text())
    async_state = json.loads((tmp_path / "checkpoints/step-00000008/train_state.json").read_text())
    for state in (sync_state, async_state):  # the configs differ in checkpoint.async (and run.dir)
        state.pop("config_sha256"), state.pop("config")
    assert sync_state == async_state
    # the same tensors: load both step-8 checkpoints into one process (2 -> 1 resharding)
    models = []
    for run in (two_rank_reference, tmp_path):
        model, opt = smoke_model()
        Checkpointer(str(run / "checkpoints"), SOLO).load(8, model, opt)
        models.append((model, opt))
    assert_same(*models)


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resharded_resume_continues_the_same_run(two_rank_reference, cache_dir, tmp_path, first, second):
    """Save with `first` ranks, resume the step-4 checkpoint on `second` ranks: same samples, same
    losses within reduction-order tolerance. Step 12 has a bit flipped in the last rank's shard (on 2
    ranks, rank 1 verifies that file): every rank must agree to skip it."""
    if first == 2:  # that run is the reference: its copy
        shutil.copytree(two_rank_reference, tmp_path, dirs_exist_ok=True)
    else:
        run_trainer(tmp_path, STEPS, nproc=first)
    subprocess.run(["rm", "-rf", step_dir(str(tmp_path / "checkpoints"), 8)], check=True)
    corrupt(Path(step_dir(str(tmp_path / "checkpoints"), 12)) / f"__{first - 1}_0.distcp", "flip")
    proc = run_trainer(tmp_path, STEPS, nproc=second)
    assert f"step 12 is unusable, falling back: {tmp_path}/checkpoints/step-00000012/__{first - 1}_0.distcp fails" \
        in proc.stdout
    assert "resumed from step 4 " in proc.stdout and f"saved by {first} rank(s)" in proc.stdout
    ref, got = read_metrics(two_rank_reference), read_metrics(tmp_path)
    for step in range(5, 13):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=5e-4), step


def write_error_on_rank_1(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """Rank 1's background write of step 8 fails (disk full)."""
    return subprocess.run(
        trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *STEPS, "checkpoint.async=true",
                               *overrides]),
        cwd=REPO, env=child_env(REKINDLE_CRASH_AT="write-error@8:1"), capture_output=True, text=True, timeout=180)


def test_async_write_error_on_one_rank_stops_every_rank(two_rank_reference, tmp_path):
    """With no failed save allowed: both ranks report it and the run exits nonzero right away, without
    committing step 8 and long before its next save (step 12)."""
    proc = write_error_on_rank_1(tmp_path, "checkpoint.max_failed_saves=0")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        voice = "[rekindle] rank 1: error: " if rank else "[rekindle] error: "  # said on every rank
        assert (f"{voice}checkpoint step 8 at {tmp_path}/checkpoints/step-00000008 was not "
                f"committed: background save failed: rank 1: OSError: [Errno 28] No space left on device") in out
    assert "error: checkpoint step 8" in proc.stderr  # the trainer's own last word
    assert not (tmp_path / "checkpoints" / "step-00000008" / COMMIT).exists()
    assert (tmp_path / "checkpoints" / "step-00000004" / COMMIT).exists()
    steps = read_metrics(tmp_path)
    assert 8 in steps and max(steps) < 12, sorted(steps)


def test_a_failed_periodic_save_is_a_warning_and_training_goes_on(two_rank_reference, tmp_path):
    """By default (checkpoint.max_failed_saves=3) the same failure is a warning on every rank and a
    `checkpoint_failed` event; step 8's partial files are deleted; the run ends with its last step
    committed and the losses of the undisturbed run."""
    proc = write_error_on_rank_1(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for voice in ("[rekindle] warning: ", "[rekindle] rank 1: warning: "):
        assert f"{voice}checkpoint step 8 at {tmp_path}/checkpoints/step-00000008 was not committed" in proc.stdout
    assert not (tmp_path / "checkpoints" / "step-00000008").exists()
    assert (tmp_path / "checkpoints" / "step-00000012" / COMMIT).exists()
    failed = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [8] and "No space left on device" in failed[0]["error"]
    ref, got = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [got[s]["loss"] for s in range(1, 13)] == [ref[s]["loss"] for s in range(1, 13)]


def test_s3_run_killed_during_save_resumes_from_s3(two_rank_reference, s3_bucket, tmp_path):
    """checkpoint.dir on the loopback S3 server: rank 0 is SIGKILLed after every shard of step 8 is
    uploaded but before COMMIT.json; the restarted 2-rank run resumes from step 4 on S3 and reproduces
    the uninterrupted run's losses exactly; retention (keep=2) then leaves exactly steps 8 and 12."""
    import s3fs

    root = f"{s3_bucket}/run/ckpt"
    steps = [*STEPS, f"checkpoint.dir={root}", "checkpoint.keep=2"]
    crashed = subprocess.run(trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *steps]), cwd=REPO,
                             env=child_env(REKINDLE_CRASH_AT="commit@8:0"), capture_output=True, text=True,
                             timeout=180)
    assert crashed.returncode != 0 and "Signal 9 (SIGKILL)" in crashed.stderr + crashed.stdout
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    assert fs.exists(f"{root}/step-00000008/__1_0.distcp") and not fs.exists(f"{root}/step-00000008/{COMMIT}")
    resumed = run_trainer(tmp_path, steps, nproc=2)
    assert f"resumed from step 4 ({root}/step-00000004, saved by 2 rank(s))" in resumed.stdout
    ref, after = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [after[s]["loss"] for s in range(1, 13)] == [ref[s]["loss"] for s in range(1, 13)]
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["step-00000008", "step-00000012"]
    assert Checkpointer(root, SOLO).discover_latest() == 12


def test_reshard_gives_equal_parameters(tmp_path):
    """2 ranks (FSDP2) save; 1 process loads (2->1); that process saves; 2 ranks load it (1->2). Every
    parameter and AdamW moment equals the 2-rank original bit for bit (the worker asserts it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", str(Path(__file__)), "reshard-worker",
         str(tmp_path)],
        cwd=REPO, env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("2->1 equal") == 1 and proc.stdout.count("1->2 equal") == 2, proc.stdout


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, unsharded, by parameter name."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()  # noqa: E731
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param {n}": full(p) for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"{key} {names[id(p)]}": full(v) for key, v in st.items()})
    return out


def reshard_worker(root: Path) -> None:
    from trainer.config import DistConfig
    from trainer.distributed.parallel import init_distributed, parallelize

    info = init_distributed(DistConfig())
    model, opt = trained(0)  # identical on both ranks; then sharded and trained a little more
    model = parallelize(model, DistConfig(), info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    Checkpointer(str(root / "two"), info).save(TrainState(step=1), model, opt)
    want = full_state(model, opt)
    assert len(want) == 4 * len(list(model.parameters())) and want["step layers.0.attention.wq.weight"] == 2
    if info.rank == 0:  # 2 -> 1: a plain process (no process group needed by the checkpointer)
        single, single_opt = trained(5)
        Checkpointer(str(root / "two"), SOLO).load(1, single, single_opt)
        got = full_state(single, single_opt)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "2->1 differs"
        print("2->1 equal", flush=True)
        Checkpointer(str(root / "one"), SOLO).save(TrainState(step=1), single, single_opt)
    torch.distributed.barrier()
    fresh, _ = trained(7)  # 1 -> 2: different weights until loaded
    fresh = parallelize(fresh, DistConfig(), info)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    Checkpointer(str(root / "one"), info).load(1, fresh, fresh_opt)
    got = full_state(fresh, fresh_opt)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "1->2 differs"
    print(f"1->2 equal on rank {info.rank}", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["reshard-worker"]:
    from trainer.distributed.parallel import shutdown

    reshard_worker(Path(sys.argv[2]))
    shutdown()  # after the FSDP modules are out of scope: see parallel.shutdown
