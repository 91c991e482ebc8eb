"""What a resume may change (trainer.config.resume_rules): fixed keys refused naming both values, the rest listed."""

from __future__ import annotations

import pytest

from trainer.checkpoint import IncompatibleCheckpointError
from trainer.config import Config
from trainer.config.resume_rules import check_resume, is_fixed


def test_fixed_keys_are_the_model_the_data_order_and_the_batch():
    for key in ("model.dim", "model.rope_theta", "data.seed", "data.val_fraction", "train.global_batch"):
        assert is_fixed(key), key
    for key in ("model.init_std", "train.steps", "train.lr", "checkpoint.every", "fault.hang_timeout_s",
                "data.path", "data.num_workers", "log.progress", "dist.compile"):
        assert not is_fixed(key), key


def test_a_fixed_change_is_refused_naming_every_key_with_both_values():
    saved = Config().to_dict()
    ours = Config().to_dict()
    ours["model"]["dim"], ours["data"]["seed"], ours["train"]["steps"] = 512, 9, 1000
    with pytest.raises(IncompatibleCheckpointError) as e:
        check_resume(saved, saved["model"], ours, "ck/step-00000010")
    assert "(data.seed: 1234 -> 9; model.dim: 256 -> 512)" in str(e.value)
    assert "train.steps" not in str(e.value)


def test_allowed_changes_are_returned_and_old_checkpoints_compare_the_model_only():
    saved, ours = Config().to_dict(), Config().to_dict()
    ours["train"]["lr"], ours["model"]["init_std"] = 1e-3, 0.01
    assert check_resume(saved, saved["model"], ours, "p") == {"model.init_std": (0.02, 0.01), "train.lr": (3e-3, 1e-3)}
    assert check_resume({}, saved["model"], ours, "p") == {}  # before the config was kept: nothing listed
    ours["model"]["n_layers"] = 2
    with pytest.raises(IncompatibleCheckpointError, match=r"model.n_layers: 4 -> 2"):
        check_resume({}, saved["model"], ours, "p")
