"""`python -m trainer.export`: consolidated safetensors weights equal the trained model bit for bit
(from a 1-process save and from a 2-rank FSDP run), tied embeddings stored once and re-tied on load,
and a clear error for a missing, uncommitted or corrupt checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, child_env, run_trainer
from safetensors import safe_open
from safetensors.torch import load_model
from test_checkpoint import SOLO, corrupt, smoke_model, trained

from trainer.checkpoint import COMMIT, Checkpointer, TrainState
from trainer.export import main
from trainer.model import Transformer


def assert_params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters(remove_duplicate=False)), dict(b.named_parameters(remove_duplicate=False))
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_export_cli_writes_the_trained_weights(tmp_path):
    model, opt = trained(0)
    assert model.args.tie_embeddings
    ckpt = Checkpointer(str(tmp_path / "ck"), SOLO)
    ckpt.save(TrainState(step=1), *trained(1))
    ckpt.save(TrainState(step=2), model, opt)
    out = tmp_path / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "trainer.export", str(tmp_path / "ck"), str(out)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    n_params = model.num_params()
    assert f"exported step 2 of {tmp_path / 'ck'}/step-00000002" in proc.stdout
    assert f"{n_params:,} parameters (float32)" in proc.stdout and "output.weight tied to" in proc.stdout
    with safe_open(str(out), "pt") as f:
        assert "output.weight" not in f.keys() and "tok_embeddings.weight" in f.keys()
        assert sum(f.get_tensor(k).numel() for k in f.keys()) == n_params
    fresh = Transformer(model.args)
    load_model(fresh, str(out))
    assert fresh.output.weight is fresh.tok_embeddings.weight
    assert_params_equal(fresh, model)


def test_export_consolidates_a_two_rank_run(cache_dir, tmp_path, capsys):
    run_trainer(tmp_path, ["train.steps=3", "train.eval_every=0", "checkpoint.every=3"], nproc=2)
    assert main([str(tmp_path / "checkpoints/step-00000003"), str(tmp_path / "out.safetensors")]) == 0
    assert "exported step 3" in capsys.readouterr().out
    reference, opt = smoke_model()  # the same step through the checkpointer's own (resharding) load
    Checkpointer(str(tmp_path / "checkpoints"), SOLO).load(3, reference, opt)
    exported, _ = smoke_model()
    torch.nn.init.zeros_(exported.norm.weight)  # so that an export that loads nothing cannot pass
    load_model(exported, str(tmp_path / "out.safetensors"))
    assert_params_equal(exported, reference)


@pytest.fixture
def two_steps(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"), SOLO, keep=3)
    ckpt.save(TrainState(step=1), *trained(0))
    ckpt.save(TrainState(step=2), *trained(1))
    return tmp_path / "ck"


def test_export_refuses_a_bad_checkpoint(two_steps, tmp_path, capsys):
    out = str(tmp_path / "out.safetensors")
    assert main([str(tmp_path / "nowhere"), out]) == 1
    assert f"no checkpoint at {tmp_path / 'nowhere'}" in capsys.readouterr().err
    corrupt(two_steps / "step-00000002" / "__0_0.distcp", "flip")
    assert main([str(two_steps / "step-00000002"), out]) == 1
    assert "step-00000002/__0_0.distcp fails its checksum" in capsys.readouterr().err
    (two_steps / "step-00000001" / COMMIT).unlink()
    assert main([str(two_steps / "step-00000001"), out]) == 1
    assert "step-00000001 is not committed" in capsys.readouterr().err
    assert main([str(two_steps), out]) == 1  # the root: step 2 corrupt, step 1 uncommitted
    err = capsys.readouterr().err
    assert "step 2 is unusable" in err and f"no usable committed checkpoint in {two_steps}" in err
    assert not (tmp_path / "out.safetensors").exists()


def test_export_of_a_root_skips_a_damaged_newest_step(two_steps, tmp_path, capsys):
    corrupt(two_steps / "step-00000002" / "train_state.json", "truncate")
    assert main([str(two_steps), str(tmp_path / "out.safetensors")]) == 0
    captured = capsys.readouterr()
    assert "step 2 is unusable" in captured.err and "exported step 1 " in captured.out
    fresh = Transformer(trained(0)[0].args)
    load_model(fresh, str(tmp_path / "out.safetensors"))
    assert_params_equal(fresh, trained(0)[0])


def test_export_from_s3(s3_bucket, tmp_path, capsys):
    model, opt = trained(0)
    Checkpointer(f"{s3_bucket}/ck", SOLO).save(TrainState(step=4), model, opt)
    assert main([f"{s3_bucket}/ck", str(tmp_path / "out.safetensors")]) == 0
    assert f"exported step 4 of {s3_bucket}/ck/step-00000004" in capsys.readouterr().out
    fresh = Transformer(model.args)
    load_model(fresh, str(tmp_path / "out.safetensors"))
    assert_params_equal(fresh, model)
