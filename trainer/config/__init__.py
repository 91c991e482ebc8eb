"""The run configuration: each key declared once (type, default, meaning, limits), loaded from YAML
plus `key=value` overrides and validated before any work starts; every error names the key.

    groups        the key groups (run, data, train, checkpoint, dist, fault, storage, log, profile) and
                  Config: load, validate, save, the config hash
    schema        how a key is declared (`setting`) and checked; also used by trainer.model.args, which
                  declares the `model` group beside the model
    resume_rules  which keys a resume may change, and which it refuses

Torch-free (resume_rules aside), so a config error answers before torch loads. The public API is
re-exported here: `from trainer.config import Config, load`."""

from trainer.config.groups import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    FaultConfig,
    LogConfig,
    ProfileConfig,
    RunConfig,
    StorageConfig,
    TrainConfig,
    load,
    micro_batch_size,
    save,
    validate,
)
from trainer.config.schema import ConfigError

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistConfig", "FaultConfig", "LogConfig",
    "ProfileConfig", "RunConfig", "StorageConfig", "TrainConfig", "load", "micro_batch_size", "save", "validate",
]
