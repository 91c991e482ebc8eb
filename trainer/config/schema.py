"""How a config key is declared: `setting(default, doc, limits)` on the dataclass field it describes,
and `check(cfg)`, which walks the groups and enforces those limits, then each group's own cross-field
rules (its `check(prefix)` method, beside its fields). Plain dataclasses, no torch and no OmegaConf,
so `trainer/model/args.py` declares the model's arguments with it and `trainer/config/groups.py` loads them."""

from __future__ import annotations

import dataclasses
import keyword
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


def setting(default: Any, doc: str, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
            choices: tuple[str, ...] | None = None, why: str = "") -> Any:
    """A config field: its default, what it means, and its limits (value > gt, >= ge, < lt, one of
    `choices`; `why` is added to the error message). A list default is copied for each instance."""
    if gt is not None and ge is not None:
        raise TypeError("setting: give gt or ge, not both")
    metadata = {"doc": doc, "gt": gt, "ge": ge, "lt": lt, "choices": choices, "why": why}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def yaml_key(name: str) -> str:
    """The user's spelling of a field name: `async_` (a Python keyword plus `_`) is `async`."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def attr_name(key: str) -> str:
    """The field name of a user's key: `async` -> `async_`."""
    return key + "_" if keyword.iskeyword(key) else key


def groups(cfg: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted prefix, dataclass instance) for `cfg` and every group nested in it, outermost first."""
    found = [(prefix, cfg)]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            found += groups(value, f"{prefix}{yaml_key(f.name)}.")
    return found


def check(cfg: Any) -> None:
    """Raise ConfigError naming the key for the first value outside its declared limits (all groups),
    then for the first broken cross-field rule (each group's `check(prefix)`, outermost first)."""
    found = groups(cfg)
    for prefix, group in found:
        for f in dataclasses.fields(group):
            check_limits(prefix + yaml_key(f.name), getattr(group, f.name), f.metadata)
    for prefix, group in found:
        rules = getattr(group, "check", None)
        if callable(rules):
            rules(prefix)


def check_limits(key: str, value: Any, limits: Any) -> None:
    choices = limits.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"config key '{key}' must be one of {', '.join(choices)}; got '{value}'")
    gt, ge, lt = limits.get("gt"), limits.get("ge"), limits.get("lt")
    if gt is None and ge is None and lt is None:
        return
    # written as "not within" so that NaN, which compares False with everything, is out of limits
    within = (gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
    if not within:
        why = f" ({limits['why']})" if limits.get("why") else ""
        raise ConfigError(f"config key '{key}' must be {_describe(gt, ge, lt)}{why}; got {value}")


def _describe(gt: float | None, ge: float | None, lt: float | None) -> str:
    if lt is None:
        return "positive" if gt == 0 else f"> {gt}" if gt is not None else f">= {ge}"
    if gt is None and ge is None:
        return f"< {lt}"
    return f"in ({gt}, {lt})" if gt is not None else f"in [{ge}, {lt})"
