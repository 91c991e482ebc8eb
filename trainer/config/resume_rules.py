"""What a resume may change: the config a checkpoint was trained with (kept in its train_state.json)
against this run's. Keys that decide the model, the data order or the shape of the optimizer state
are FIXED: a resume that changes one is refused, naming each key with both values. Every other key
may change (the step count, the schedule, logging, the checkpoint cadence, fault settings, the data's
location, ...): a resume lists what changed, in the log and as a `config_changed` event in the ledger.
Torch-free."""

from __future__ import annotations

from typing import Any

from trainer.checkpoint.format import IncompatibleCheckpointError

# Keys (or whole groups, ending in ".") a resume may not change, and why. The optimizer state's shape
# follows the model's, so the model's keys cover it.
FIXED: dict[str, str] = {
    "model.": "the model's shape and function",
    "data.seed": "the sample order",
    "data.val_fraction": "which samples are trained on and which are held out",
    "data.builtin_mb": "the built-in corpus, and with it the sample order",
    "train.global_batch": "where the saved position lies in the sample order",
}
# Exceptions inside a FIXED group: they only shape the weights before the first step.
MAY_CHANGE = ("model.init_std", "model.init_from")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def is_fixed(key: str) -> bool:
    if key in MAY_CHANGE:
        return False
    return any(key == rule or (rule.endswith(".") and key.startswith(rule)) for rule in FIXED)


def changes(saved: dict[str, Any], ours: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, this run's value)} for each key both configs have and that differs."""
    old, new = flatten(saved), flatten(ours)
    return {key: (old[key], new[key]) for key in sorted(new) if key in old and old[key] != new[key]}


def check_resume(saved_config: dict[str, Any], saved_model: dict[str, Any], ours: dict[str, Any],
                 path: str) -> dict[str, tuple[Any, Any]]:
    """Refuse (IncompatibleCheckpointError, one line naming each key with both values) a resume of the
    checkpoint at `path` that changes a FIXED key; return the allowed changes. `saved_config` is {} for
    checkpoints that predate its record: then only their model arguments (`saved_model`) are compared."""
    saved = saved_config or {"model": saved_model}
    found = changes(saved, ours)
    refused = {key: values for key, values in found.items() if is_fixed(key)}
    if refused:
        listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
        raise IncompatibleCheckpointError(
            f"{path} was trained with other settings that a resume may not change ({listed}): resume with the "
            "settings it was trained with, or set another checkpoint.dir (or run.dir) to start a new run")
    if not saved_config:
        return {}  # (the model's arguments alone: nothing else is known to have changed)
    return found


def describe(allowed: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in allowed.items())
