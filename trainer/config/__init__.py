"""The run configuration: each key declared once (type, default, meaning, limits), loaded from YAML
plus `key=value` overrides and validated before any work starts; every error names the key.

    groups        the key groups (run, data, train, checkpoint, dist, fault, storage, log, profile) and
                  Config: load, validate, save, the config hash
    schema        how a key is declared (`setting`) and checked; also used by trainer.model.args, which
                  declares the `model` group beside the model
    resume_rules  which keys a resume may change, and which it refuses

Torch-free (resume_rules aside), so a config error answers before torch loads. The public API is
re-exported here: `from trainer.config import Config, load`."""

import importlib

# name -> the module that defines it. Loaded on first use (PEP 562), not here: trainer.model.args imports
# trainer.config.schema, whose package this is, and trainer.config.groups imports trainer.model.args, so
# an eager import here made `from trainer.model.args import ModelArgs` in a fresh interpreter a cycle.
_EXPORTS = {
    **dict.fromkeys(["CheckpointConfig", "Config", "DataConfig", "DistConfig", "FaultConfig", "LogConfig",
                     "ProfileConfig", "RunConfig", "StorageConfig", "TrainConfig", "load", "micro_batch_size",
                     "save", "validate"], "groups"),
    "ConfigError": "schema",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"trainer.config.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'trainer.config' has no attribute {name!r}")
