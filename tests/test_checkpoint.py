"""Checkpoints: bit-exact round trips (local and a real loopback S3), corruption detection with
fallback, retention, crash-during-save recovery (real SIGKILL), async vs sync, resharding, and a
checkpoint that tries to run code on load."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMOKE, child_env, read_metrics, run_trainer, trainer_cmd

from trainer.checkpoint import COMMIT, Checkpointer, CheckpointError, TrainState, step_dir
from trainer.ckpt_storage import UnsafeCheckpointError
from trainer.model import ModelArgs, Transformer
from trainer.parallel import DistInfo

SOLO = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def trained(seed: int = 0) -> tuple[Transformer, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def smoke_model() -> tuple[Transformer, torch.optim.AdamW]:
    from trainer.config import load
    from trainer.loop import build_optimizer

    cfg = load(SMOKE)
    model = Transformer(ModelArgs(**{k: getattr(cfg.model, k) for k in ModelArgs.__dataclass_fields__}))
    return model, build_optimizer(model, cfg, torch.device("cpu"))


def assert_same(a: tuple, b: tuple) -> None:
    for (n, p), q in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(p, q), n
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_round_trip_is_bit_exact(tmp_path, where, request):
    root = str(tmp_path / "ck") if where == "local" else request.getfixturevalue("s3_bucket") + "/run/ck"
    saved = trained(0)
    ckpt = Checkpointer(root, SOLO)
    ckpt.save(TrainState(step=7, tokens_seen=70, data={"samples_consumed": 14}), *saved)
    fresh = trained(1)
    assert ckpt.discover_latest() == 7
    state = ckpt.load(7, *fresh)
    assert (state.step, state.tokens_seen, state.data) == (7, 70, {"samples_consumed": 14})
    assert_same(saved, fresh)


def corrupt(path: Path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-5])
    else:
        path.unlink()


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "train_state.json", COMMIT])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, capsys, name, how):
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=3)
    first = trained(0)
    ckpt.save(TrainState(step=1), *first)
    ckpt.save(TrainState(step=2), *trained(1))
    corrupt(tmp_path / "step-00000002" / name, how)
    expected = 1
    assert ckpt.discover_latest() == expected
    out = capsys.readouterr().out
    if name != COMMIT or how != "delete":  # a deleted COMMIT.json means "never committed": silently skipped
        assert "step 2 is unusable" in out and "step-00000002/" in out
    restored = trained(2)
    ckpt.load(expected, *restored)
    assert_same(first, restored)


def test_no_usable_checkpoint_starts_fresh_or_fails_when_required(cache_dir, tmp_path):
    proc = run_trainer(tmp_path, ["train.steps=2", "checkpoint.resume=required"], check=False)
    assert proc.returncode == 1
    assert "checkpoint.resume=required but no usable committed checkpoint" in proc.stderr
    proc = run_trainer(tmp_path, ["train.steps=2"])
    assert "starting fresh" in proc.stdout


def test_retention_keeps_newest_and_milestones(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2, keep_every=3)
    model, opt = trained(0)
    (tmp_path / "step-00000000").mkdir(parents=True)  # an uncommitted leftover of a crashed save
    for step in range(1, 8):
        ckpt.save(TrainState(step=step), model, opt)
    assert ckpt.committed_steps() == [3, 6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000006", "step-00000007"]


def test_metadata_that_would_run_code_is_refused(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO)
    ckpt.save(TrainState(step=1), *trained(0))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = tmp_path / "step-00000001" / ".metadata"
    meta.write_bytes(pickle.dumps(Exploit()))
    commit = json.loads((tmp_path / "step-00000001" / COMMIT).read_text())  # a forger can fix the checksums
    digest = hashlib.sha256(meta.read_bytes()).hexdigest()
    commit["files"][".metadata"] = {"size": meta.stat().st_size, "sha256": digest}
    (tmp_path / "step-00000001" / COMMIT).write_text(json.dumps(commit))
    assert ckpt.discover_latest() is None  # refused at verification...
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system, which is not allowed"):
        ckpt.load(1, *trained(1))  # ...and at load
    assert not marker.exists()


STEPS = ["train.steps=12", "train.log_every=1", "train.eval_every=0", "checkpoint.every=4", "checkpoint.keep=5"]


@pytest.fixture(scope="module")
def two_rank_reference(cache_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref2")
    run_trainer(run_dir, STEPS, nproc=2)
    return run_dir


@pytest.mark.parametrize("point", ["shards@8:1", "commit@8:0"])
def test_rank_killed_during_save_resumes_from_previous_commit(two_rank_reference, tmp_path, point):
    """shards: rank 1 dies as the step-8 save starts while rank 0 writes; commit: rank 0 dies after
    every shard of step 8 is written but before COMMIT.json."""
    crashed = subprocess.run(trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *STEPS]), cwd=REPO,
                             env=child_env(REKINDLE_CRASH_AT=point), capture_output=True, text=True, timeout=180)
    assert crashed.returncode != 0 and "Signal 9 (SIGKILL)" in crashed.stderr + crashed.stdout
    assert not (tmp_path / "checkpoints" / "step-00000008" / COMMIT).exists()
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
    sync_state.pop("config_sha256"), async_state.pop("config_sha256")  # the configs differ in checkpoint.async
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
    losses within reduction-order tolerance."""
    run_trainer(tmp_path, STEPS, nproc=first)
    for step in (8, 12):
        subprocess.run(["rm", "-rf", step_dir(str(tmp_path / "checkpoints"), step)], check=True)
    proc = run_trainer(tmp_path, STEPS, nproc=second)
    assert "resumed from step 4 " in proc.stdout and f"saved by {first} rank(s)" in proc.stdout
    ref, got = read_metrics(two_rank_reference), read_metrics(tmp_path)
    for step in range(5, 13):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=5e-4), step


def test_save_failure_is_loud(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "file-not-dir"), SOLO)
    (tmp_path / "file-not-dir").write_text("in the way")
    with pytest.raises(CheckpointError, match="not committed"):
        ckpt.save(TrainState(step=1), *trained(0))
