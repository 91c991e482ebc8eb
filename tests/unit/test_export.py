"""trainer.export in this process: a clear error for a missing, uncommitted or corrupt checkpoint, and
a checkpoint root whose newest step is damaged exports the previous one. (The CLI, a 2-rank FSDP run
and a checkpoint on S3: tests/integration/test_export_runs.py.)"""

from __future__ import annotations

import pytest
from safetensors.torch import load_model

from tests.helpers import SOLO, assert_params_equal, corrupt, trained
from trainer.checkpoint import COMMIT, Checkpointer, TrainState
from trainer.config import CheckpointConfig
from trainer.export import main
from trainer.model.transformer import Transformer


@pytest.fixture
def two_steps(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"), SOLO, CheckpointConfig(keep=3))
    ckpt.save(TrainState(step=1), *trained(0))
    ckpt.save(TrainState(step=2), *trained(1))
    return tmp_path / "ck"


def test_export_refuses_a_bad_checkpoint(two_steps, tmp_path, capsys):
    out = str(tmp_path / "out.safetensors")
    assert main([str(tmp_path / "nowhere"), out]) == 2  # bad input
    assert f"no checkpoint at {tmp_path / 'nowhere'}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), out]) == 2
    assert f"no committed checkpoint in {tmp_path / 'empty'}" in capsys.readouterr().err
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
