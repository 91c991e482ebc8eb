"""Config loading and validation: errors name the key (and the closest valid one) before any work."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.helpers import REPO, SMOKE
from trainer import config
from trainer.config import ConfigError, schema
from trainer.config.schema import setting
from trainer.model.transformer import ModelArgs, Transformer


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
        ("fault.node_silence_s=0.5", "'fault.node_silence_s' (0.5) must be at least 2 s"),
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


@pytest.mark.parametrize(
    "override, message",
    [
        ("log.peak_tflops=-1", "config key 'log.peak_tflops' must be >= 0; got -1.0"),
        ("fault.preempt_grace_s=0", "config key 'fault.preempt_grace_s' must be positive; got 0.0"),
        ("data.val_fraction=0.5", "config key 'data.val_fraction' must be in [0, 0.5); got 0.5"),
        ("checkpoint.keep=1", "config key 'checkpoint.keep' must be >= 2 (the previous commit is the fallback"),
        ("checkpoint.resume=maybe", "config key 'checkpoint.resume' must be one of auto, never, required; got 'maybe'"),
        ("model.n_kv_heads=-1", "config key 'model.n_kv_heads' must be >= 0; got -1"),
    ],
)
def test_limit_declared_beside_the_field_is_enforced(override, message):
    with pytest.raises(ConfigError) as e:
        config.load(SMOKE, [override])
    assert message in str(e.value)


def test_limits_come_from_the_field_declaration():
    @dataclasses.dataclass
    class Group:
        count: int = setting(1, "how many", gt=0)
        share: float = setting(0.1, "a fraction", ge=0, lt=1)
        mode: str = setting("a", "which", choices=("a", "b"))

    @dataclasses.dataclass
    class Root:
        group: Group = dataclasses.field(default_factory=Group)

    schema.check(Root())
    for bad, message in [
        (Group(count=0), "config key 'group.count' must be positive; got 0"),
        (Group(share=1.0), "config key 'group.share' must be in [0, 1); got 1.0"),
        (Group(share=float("nan")), "config key 'group.share' must be in [0, 1); got nan"),
        (Group(mode="c"), "config key 'group.mode' must be one of a, b; got 'c'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            schema.check(Root(group=bad))


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("model.n_kv_head=2", "model.n_kv_heads"),  # the model group is declared in trainer/model/transformer.py
        ("checkpoint.asynch=true", "checkpoint.async"),  # the user's spelling, not the attribute `async_`
    ],
)
def test_unknown_key_still_gets_did_you_mean(override, suggestion):
    with pytest.raises(ConfigError, match=re.escape(f"unknown config key '{override.split('=')[0]}' in override "
                                                    f"'{override}' (did you mean '{suggestion}'?)")):
        config.load(SMOKE, [override])


def test_model_group_is_the_models_own_arguments():
    cfg = config.load(SMOKE, ["model.n_kv_heads=1"])
    assert isinstance(cfg.model, ModelArgs) and cfg.model.kv_heads == 1
    assert Transformer(cfg.model).args.n_kv_heads == 1  # trainer/loop.py builds the model from it as it is


# A checkpoint records its config's hash: moving code must not change them. A new key does (it is in
# every config's dict): fault.in_process, 2026-12-05 (fault settings may change on resume);
# checkpoint.memory_max_age_h and fault.node_silence_s, 2026-12-06 (may change on resume; memory snapshots'
# hash leaves them out); fault.verify_every, anomaly_window and anomaly_threshold, 2026-12-07.
SHIPPED_CONFIG_HASHES = {
    "smoke": "0d1b2007b9b7baf2a4d2e664c6d7111840ec464222070a8d70ed0b46a9a4dfea",
    "default": "2d64aa7f64bac18b05ad2b26cd74bf35d351f9d23fa7aaa8609a3ea42684922a",
    "gpt2-124m": "a73faa31b52fda7d82eeddfda1f7b0fedecbb959b9cabc2d6320f98ddc6a326a",
    "llama-1b": "4fcc29dc617a9135fdfc8e149bc4061863ecf86d8cd3f99b86fdabd9141d7c56",
}


@pytest.mark.parametrize("name", sorted(SHIPPED_CONFIG_HASHES))
def test_the_shipped_configs_keep_their_hashes(name):
    assert config.load(REPO / "configs" / f"{name}.yaml").sha256() == SHIPPED_CONFIG_HASHES[name]
