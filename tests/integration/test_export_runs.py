"""`python -m trainer.export`: consolidated safetensors weights equal the trained model bit for bit
(from a 1-process save through the CLI, from a 2-rank FSDP run, and from a checkpoint on the loopback
S3 server), tied embeddings stored once and re-tied on load."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_model

from tests.helpers import REPO, SOLO, assert_params_equal, assert_same, child_env, run_trainer, smoke_model, trained
from trainer.checkpoint import Checkpointer, TrainState, verify
from trainer.export import main
from trainer.model.transformer import Transformer


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


def test_stock_dcp_tools_read_a_two_rank_run_and_a_dcp_export(cache_dir, tmp_path, capsys):
    """checkpoint.format=dcp on 2 FSDP ranks: stock `dcp_to_torch_save` consolidates the step as it is.
    A raw-format step exported with --format dcp: stock tools read the copy, and rekindle verifies and
    loads it like any committed step."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_trainer(tmp_path, ["train.steps=3", "train.eval_every=0", "checkpoint.every=3", "checkpoint.format=dcp"],
                nproc=2)
    step = tmp_path / "checkpoints/step-00000003"
    reference, opt = smoke_model()
    Checkpointer(str(tmp_path / "checkpoints"), SOLO).load(3, reference, opt)
    dcp_to_torch_save(str(step), str(tmp_path / "stock.pt"))
    stock = torch.load(tmp_path / "stock.pt", weights_only=True)
    for name, t in reference.state_dict().items():
        assert torch.equal(stock["model"][name], t), name

    raw = tmp_path / "raw"
    model, opt = trained(0)
    Checkpointer(str(raw), SOLO).save(TrainState(step=5), model, opt)
    copy = tmp_path / "copies/step-00000005"
    assert main([str(raw), str(copy), "--format", "dcp"]) == 0
    assert "DCP standard format" in capsys.readouterr().out
    dcp_to_torch_save(str(copy), str(tmp_path / "copy.pt"))
    stock = torch.load(tmp_path / "copy.pt", weights_only=True)
    for name, t in model.state_dict().items():
        assert torch.equal(stock["model"][name], t), name
    assert verify(str(copy)) == ""
    ckpt = Checkpointer(str(tmp_path / "copies"), SOLO)
    assert ckpt.discover_latest() == 5
    fresh = trained(1)
    ckpt.load(5, *fresh)
    assert_same((model, opt), fresh)
    assert main([str(raw), str(copy), "--format", "dcp"]) == 2  # never overwritten
    assert "not an empty directory" in capsys.readouterr().err


def test_export_from_s3(s3_bucket, tmp_path, capsys):
    model, opt = trained(0)
    Checkpointer(f"{s3_bucket}/ck", SOLO).save(TrainState(step=4), model, opt)
    assert main([f"{s3_bucket}/ck", str(tmp_path / "out.safetensors")]) == 0
    assert f"exported step 4 of {s3_bucket}/ck/step-00000004" in capsys.readouterr().out
    fresh = Transformer(model.args)
    load_model(fresh, str(tmp_path / "out.safetensors"))
    assert_params_equal(fresh, model)
