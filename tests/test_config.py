"""Config loading and validation: errors name the key (and the closest valid one) before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, SMOKE

from trainer import config
from trainer.config import ConfigError


def test_smoke_and_default_configs_load():
    for name in ("smoke", "default", "gpt2-124m", "llama-1b"):
        cfg = config.load(REPO / "configs" / f"{name}.yaml")
        assert cfg.model.dim > 0


def test_overrides_are_typed_and_applied():
    cfg = config.load(SMOKE, ["train.steps=7", "model.dim=128", "checkpoint.async=true", "train.lr=1e-3"])
    assert (cfg.train.steps, cfg.model.dim, cfg.checkpoint.async_, cfg.train.lr) == (7, 128, True, 1e-3)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz' in override 'train.stepz=3' (did you mean 'train.steps'?)"),
        ("modle.dim=3", "unknown config key 'modle' in override 'modle.dim=3' (did you mean 'model'?)"),
        ("model.dim=abc", "bad value for config key 'model.dim'"),
        ("checkpoint.async=maybe", "bad value for config key 'checkpoint.async'"),
        ("dist.backend=mpi", "'dist.backend' must be one of auto, gloo, nccl"),
        ("train.global_batch=10", "'train.global_batch' (10) must be a multiple of train.micro_batch (4)"),
        ("model.n_heads=3", "'model.dim' (64) must be divisible by model.n_heads (3)"),
        ("train.lr=-1", "'train.lr' must be positive"),
        ("model", "not of the form key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        config.load(SMOKE, [override])
    assert message in str(e.value)


def test_unknown_key_in_yaml_names_file_and_suggestion(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stpes: 3\n")
    expected = r"unknown config key 'train.stpes' in .*bad.yaml \(did you mean 'train.steps'\?\)"
    with pytest.raises(ConfigError, match=expected):
        config.load(bad)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        config.load("no/such.yaml")


def test_world_size_divisibility():
    cfg = config.load(SMOKE, ["train.global_batch=12", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"'train.micro_batch' \(4\) must divide the per-rank batch .* = 6"):
        config.validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"'train.global_batch' \(12\) must be a multiple of the world size \(5\)"):
        config.validate(cfg, world_size=5)
    config.validate(cfg, world_size=4)  # micro-batch capped at the per-rank batch of 3
    assert config.micro_batch_size(cfg, 4) == 3 and config.micro_batch_size(cfg, 1) == 4


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(SMOKE, ["checkpoint.async=true", "train.steps=3"])
    config.save(cfg, tmp_path / "config.yaml")
    again = config.load(tmp_path / "config.yaml")
    assert again == cfg and again.sha256() == cfg.sha256()


def test_cli_reports_config_error_before_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", str(SMOKE), "train.setps=3", f"run.dir={tmp_path}/run"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "config error: unknown config key 'train.setps'" in proc.stderr
    assert "did you mean 'train.steps'" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
