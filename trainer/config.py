"""The run configuration: one typed schema, loaded from YAML plus `key=value` overrides, validated
before any work starts. This is the only module that knows the schema; every error names the key."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


@dataclass
class RunConfig:
    name: str = "rekindle"
    dir: str = "runs/default"  # run directory: config.yaml, metrics.jsonl, checkpoints/
    seed: int = 1337


@dataclass
class ModelConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = same as n_heads (no grouped KV)
    ffn_mult: float = 4.0  # SwiGLU hidden = round(ffn_mult * dim * 2/3, multiple_of)
    multiple_of: int = 32
    vocab_size: int = 4096
    seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02


@dataclass
class DataConfig:
    path: str = ""  # prepared shards (dir or URL); empty = the built-in corpus
    num_workers: int = 0  # loader worker processes per rank; 0 = read in the training process
    seed: int = 1234
    # RoPE positions restart at 0 after each EOS, as they do when the model generates a new document.
    reset_positions: bool = True
    # Drop the loss of targets that start a new document (input token = EOS): nothing before predicts them.
    mask_boundary_loss: bool = False
    cache_dir: str = ""  # built-in corpus cache; empty = $REKINDLE_CACHE or ~/.cache/rekindle
    builtin_mb: float = 8.0  # size of the built-in corpus in MB of text
    val_fraction: float = 0.01  # held-out share of samples for eval loss


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step, across all ranks
    micro_batch: int = 8  # sequences per forward/backward on one rank
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    eval_every: int = 50  # 0 = only at the end
    eval_batches: int = 4
    log_every: int = 10
    max_bad_steps: int = 5  # abort after this many non-finite steps in a row


@dataclass
class CheckpointConfig:
    dir: str = ""  # path or URL; empty = run.dir/checkpoints
    every: int = 100  # 0 = only at the end
    keep: int = 2
    keep_every: int = 0  # also keep every n-th step forever (0 = off)
    # `async` is a Python keyword: the YAML key is `async`, the attribute `async_`.
    async_: bool = False
    resume: str = "auto"  # auto | never | required


@dataclass
class DistConfig:
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 600.0
    mixed_precision: str = "auto"  # auto | fp32 | bf16
    compile: bool = False  # torch.compile the model (per block under FSDP; inductor, needs a C compiler)
    activation_checkpointing: str = "none"  # none | selective (every other block) | full (every block)
    fused_adamw: str = "auto"  # auto (fused kernel on GPU and CPU) | fused | foreach
    tune_malloc: bool = True  # glibc keeps freed blocks (no page faults), heap on huge pages


@dataclass
class FaultConfig:
    # Read by the launcher (python -m launch) and by the trainer; plain torchrun uses the timeouts only.
    heartbeat_s: float = 0.5  # how often the launcher's watchdog reads the ranks' heartbeats
    hang_timeout_s: float = 60.0  # no step finished for this long (after the first step) = a hung rank
    preempt_grace_s: float = 30.0  # SIGTERM: the emergency checkpoint must be committed within this
    collective_timeout_s: float = 120.0  # collective timeout after the first step (dist.timeout_s before it)
    max_restarts: int = 10  # launcher restart budget (--max-restarts overrides)
    restart_backoff_s: float = 1.0  # wait before a restart after a failure that made no progress; doubles
    crash_loop_repeats: int = 3  # the same failure at the same step this many times in a row = crash loop


@dataclass
class LogConfig:
    progress: bool = True
    tensorboard: bool = False  # scalars to run.dir/tb/ on rank 0 (needs the tensorboard package)
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = known GPU table, or measured on CPU
    cost_per_device_hour: float = 0.0  # price of one device (GPU, or CPU process) per hour; 0 = no cost report


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)  # [first, last]: torch.profiler trace to run.dir/profile/


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the user-facing key names (`checkpoint.async`, not `async_`)."""
        return _rename(dataclasses.asdict(self), _to_yaml_key)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.run.dir) / "checkpoints")


_ENUMS = {
    "checkpoint.resume": ("auto", "never", "required"),
    "dist.backend": ("auto", "gloo", "nccl"),
    "dist.mixed_precision": ("auto", "fp32", "bf16"),
    "dist.activation_checkpointing": ("none", "selective", "full"),
    "dist.fused_adamw": ("auto", "fused", "foreach"),
}
_PYTHON_KEYWORDS = {"async": "async_"}


def _to_yaml_key(name: str) -> str:
    return {v: k for k, v in _PYTHON_KEYWORDS.items()}.get(name, name)


def _to_attr(name: str) -> str:
    return _PYTHON_KEYWORDS.get(name, name)


def _rename(tree: Any, rename) -> Any:
    if isinstance(tree, dict):
        return {rename(k): _rename(v, rename) for k, v in tree.items()}
    return tree


def _schema_keys(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every valid dotted key (user spelling) -> its dataclass field type name."""
    keys: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        name = prefix + _to_yaml_key(f.name)
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            keys[name] = dict
            keys.update(_schema_keys(f.default_factory, name + "."))
        else:
            keys[name] = f.type
    return keys


def _check_keys(tree: Any, source: str, valid: dict[str, type], prefix: str = "") -> None:
    if not isinstance(tree, dict):
        return
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if dotted not in valid:
            close = difflib.get_close_matches(dotted, list(valid), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config key '{dotted}' in {source}{hint}")
        if valid[dotted] is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{dotted}' in {source} must be a group of keys, got {value!r}")
            _check_keys(value, source, valid, dotted + ".")


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML (optional) + `key=value` overrides into a validated Config.

    Raises ConfigError naming the offending key for unknown keys, wrong types or bad values.
    """
    valid = _schema_keys()
    layers: list[tuple[str, dict]] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # noqa: BLE001 - YAML parser errors come in many types
            raise ConfigError(f"cannot parse {path}: {e}") from e
        tree = OmegaConf.to_container(loaded, resolve=False) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} must hold a mapping of config groups")
        layers.append((str(path), tree))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            tree = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
        except OmegaConfBaseException as e:
            raise ConfigError(f"cannot parse override '{item}': {e}") from e
        layers.append((f"override '{item}'", tree))

    merged = OmegaConf.structured(Config)
    for source, tree in layers:
        _check_keys(tree, source, valid)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(_rename(tree, _to_attr)))
        except OmegaConfBaseException as e:
            full_key = getattr(e, "full_key", None) or "?"
            raise ConfigError(
                f"bad value for config key '{_to_yaml_key_path(full_key)}' in {source}: {str(e).splitlines()[0]}"
            ) from e
    try:
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {e}") from e
    validate(cfg)
    return cfg


def _to_yaml_key_path(full_key: str) -> str:
    return ".".join(_to_yaml_key(part) for part in str(full_key).split("."))


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Semantic checks that types alone cannot express. With world_size, also batch divisibility."""
    for dotted, allowed in _ENUMS.items():
        group, key = dotted.split(".")
        value = getattr(getattr(cfg, group), _to_attr(key))
        if value not in allowed:
            raise ConfigError(f"config key '{dotted}' must be one of {', '.join(allowed)}; got '{value}'")
    m, t = cfg.model, cfg.train
    positive = {
        "model.dim": m.dim, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
        "model.vocab_size": m.vocab_size, "model.seq_len": m.seq_len, "train.steps": t.steps,
        "train.global_batch": t.global_batch, "train.micro_batch": t.micro_batch,
        "train.log_every": t.log_every, "train.max_bad_steps": t.max_bad_steps,
        "model.multiple_of": m.multiple_of, "fault.heartbeat_s": cfg.fault.heartbeat_s,
        "fault.hang_timeout_s": cfg.fault.hang_timeout_s, "fault.preempt_grace_s": cfg.fault.preempt_grace_s,
        "fault.crash_loop_repeats": cfg.fault.crash_loop_repeats,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key '{key}' must be positive; got {value}")
    non_negative = {
        "model.n_kv_heads": m.n_kv_heads, "train.warmup_steps": t.warmup_steps,
        "train.eval_every": t.eval_every, "train.eval_batches": t.eval_batches,
        "train.grad_clip": t.grad_clip, "train.weight_decay": t.weight_decay,
        "checkpoint.every": cfg.checkpoint.every, "checkpoint.keep_every": cfg.checkpoint.keep_every,
        "data.num_workers": cfg.data.num_workers, "log.peak_tflops": cfg.log.peak_tflops,
        "log.cost_per_device_hour": cfg.log.cost_per_device_hour,
        "train.min_lr": t.min_lr, "fault.collective_timeout_s": cfg.fault.collective_timeout_s,
        "fault.max_restarts": cfg.fault.max_restarts, "fault.restart_backoff_s": cfg.fault.restart_backoff_s,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0; got {value}")
    if t.lr <= 0:
        raise ConfigError(f"config key 'train.lr' must be positive; got {t.lr}")
    if t.min_lr > t.lr:
        raise ConfigError(f"config key 'train.min_lr' ({t.min_lr}) must not exceed train.lr ({t.lr})")
    if m.dim % m.n_heads:
        raise ConfigError(f"config key 'model.dim' ({m.dim}) must be divisible by model.n_heads ({m.n_heads})")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError("config keys 'model.dim'/'model.n_heads' must give an even head dim for RoPE")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(
            f"config key 'model.n_kv_heads' ({kv}) must divide model.n_heads ({m.n_heads})"
        )
    if cfg.checkpoint.keep < 2:
        raise ConfigError(
            f"config key 'checkpoint.keep' must be >= 2 (the previous commit is the fallback when the newest is "
            f"corrupt); got {cfg.checkpoint.keep}"
        )
    if not 0.0 <= cfg.data.val_fraction < 0.5:
        raise ConfigError(f"config key 'data.val_fraction' must be in [0, 0.5); got {cfg.data.val_fraction}")
    steps = list(cfg.profile.steps)
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(f"config key 'profile.steps' must be [first, last] with 1 <= first <= last; got {steps}")
    if t.global_batch % t.micro_batch:
        raise ConfigError(
            f"config key 'train.global_batch' ({t.global_batch}) must be a multiple of "
            f"train.micro_batch ({t.micro_batch})"
        )
    if world_size is not None:
        if t.global_batch % world_size:
            raise ConfigError(
                f"config key 'train.global_batch' ({t.global_batch}) must be a multiple of the world size "
                f"({world_size})"
            )
        local, micro = t.global_batch // world_size, micro_batch_size(cfg, world_size)
        if local % micro:
            raise ConfigError(
                f"config key 'train.micro_batch' ({t.micro_batch}) must divide the per-rank batch "
                f"train.global_batch / world size = {t.global_batch} / {world_size} = {local}"
            )


def micro_batch_size(cfg: Config, world_size: int) -> int:
    """train.micro_batch, capped at the per-rank batch so a config runs unchanged on more ranks."""
    return min(cfg.train.micro_batch, cfg.train.global_batch // world_size)


def save(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(cfg.to_yaml())
