"""The run configuration: one typed schema, loaded from YAML plus `key=value` overrides, validated
before any work starts; every error names the key. Each key is declared once, as a field of its
group below (the `model` group is the model's own `ModelArgs`, in trainer/model/args.py), with its
default, its meaning and its limits beside it (`trainer.config.schema.setting`); rules between keys of a
group are that group's `check`, rules that need the world size are in `validate`."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.timing import CONFIRM_S, INTERVAL_S
from trainer.config import schema
from trainer.config.schema import ConfigError, setting
from trainer.model.args import ModelArgs


@dataclass
class RunConfig:
    name: str = setting("rekindle", "run name; with run.dir it derives the launcher's job id")
    dir: str = setting("runs/default", "run directory: config.yaml, metrics.jsonl, events.jsonl, checkpoints/")
    seed: int = setting(1337, "seed of the model init")
    lease_s: float = setting(60.0, "one job per run.dir and checkpoint.dir: a lease its holder renews; one not "
                             "renewed for this long (or whose holder died) is taken over; 0 = no lease", ge=0)


@dataclass
class DataConfig:
    path: str = setting("", "prepared shards (dir or URL); empty = the built-in corpus")
    num_workers: int = setting(0, "loader worker processes per rank; 0 = read in the training process", ge=0)
    seed: int = setting(1234, "seed of the sample order")
    reset_positions: bool = setting(
        True, "RoPE positions restart at 0 after each EOS, as they do when the model generates a new document")
    mask_boundary_loss: bool = setting(
        False, "drop the loss of targets that start a new document (input token = EOS): nothing before predicts them")
    cache_dir: str = setting("", "built-in corpus cache; empty = $REKINDLE_CACHE or ~/.cache/rekindle")
    builtin_mb: float = setting(8.0, "size of the built-in corpus in MB of text", gt=0)
    val_fraction: float = setting(0.01, "held-out share of samples for eval loss", ge=0, lt=0.5)


@dataclass
class TrainConfig:
    steps: int = setting(200, "optimizer steps of the whole run", gt=0)
    global_batch: int = setting(16, "sequences per optimizer step, across all ranks", gt=0)
    micro_batch: int = setting(8, "sequences per forward/backward on one rank (capped at the per-rank batch)", gt=0)
    lr: float = setting(3e-3, "peak learning rate, after warmup", gt=0)
    min_lr: float = setting(3e-4, "learning rate at the end of the cosine decay; at most lr", ge=0)
    warmup_steps: int = setting(20, "linear warmup from 0 to lr", ge=0)
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only)", ge=0)
    beta1: float = setting(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = setting(0.95, "AdamW beta2", ge=0, lt=1)
    grad_clip: float = setting(1.0, "max global gradient norm; 0 = no clipping", ge=0)
    eval_every: int = setting(50, "steps between held-out evals; 0 = only at the end", ge=0)
    eval_batches: int = setting(4, "global batches per eval", ge=0)
    log_every: int = setting(10, "steps between log lines", gt=0)
    max_bad_steps: int = setting(5, "abort after this many non-finite steps in a row", gt=0)

    def check(self, prefix: str = "") -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"config key '{prefix}min_lr' ({self.min_lr}) must not exceed {prefix}lr ({self.lr})")
        if self.global_batch % self.micro_batch:
            raise ConfigError(
                f"config key '{prefix}global_batch' ({self.global_batch}) must be a multiple of "
                f"{prefix}micro_batch ({self.micro_batch})"
            )


@dataclass
class CheckpointConfig:
    dir: str = setting("", "path or URL; empty = run.dir/checkpoints")
    every: int = setting(100, "steps between checkpoints; 0 = only at the end", ge=0)
    keep: int = setting(2, "newest committed checkpoints kept", ge=2,
                        why="the previous commit is the fallback when the newest is corrupt")
    keep_every: int = setting(0, "also keep every n-th step forever; 0 = off", ge=0)
    # `async` is a Python keyword: the YAML key is `async`, the attribute `async_` (schema.yaml_key).
    async_: bool = setting(False, "write checkpoints in the background while training goes on")
    format: str = setting("raw", "raw: each tensor's bytes (faster) | dcp: DCP's standard format, which stock "
                          "torch.distributed.checkpoint tools read (dcp.load, dcp_to_torch_save)",
                          choices=("raw", "dcp"))
    memory_every: Union[int, str] = setting(  # noqa: UP007 - OmegaConf reads typing.Union, not `int | str`
        "auto", "steps between memory snapshots (each rank's shard, node-local memory, written in the background); "
        "a restart resumes from the newest one every rank has when it is newer than the durable checkpoint; 0 = off; "
        "auto = every step when a snapshot costs at most about 1% of a step and fits in memory_dir, else the "
        "smallest interval that keeps that cost, or off when memory_dir is not in memory or lacks room")
    memory_dir: str = setting("", "where memory snapshots go (a local directory); empty = $REKINDLE_MEMORY_DIR, "
                              "else /dev/shm/rekindle-memory")
    memory_max_age_h: float = setting(72.0, "a launcher's start removes this node's memory snapshots of other runs "
                                      "not written for this many hours (and those whose run.dir is gone); 0 = "
                                      "never by age", ge=0)
    memory_replicas: int = setting(1, "with several nodes, copies of each rank's memory snapshot on another node "
                                   "(so losing a node loses nothing in memory); 0 = none", ge=0, lt=2)
    resume: str = setting("auto", "auto: from the newest commit if any | never | required: fail without one",
                          choices=("auto", "never", "required"))
    max_failed_saves: int = setting(3, "periodic saves in a row that may fail (disk full, storage refusing) while "
                                    "training goes on; the final and emergency saves must succeed", ge=0)

    def check(self, prefix: str = "") -> None:
        every = self.memory_every
        if isinstance(every, bool) or not (every == "auto" or (isinstance(every, int) and every >= 0)):
            raise ConfigError(f"config key '{prefix}memory_every' must be auto or a number of steps >= 0 "
                              f"(0 = off); got {every!r}")


@dataclass
class DistConfig:
    backend: str = setting("auto", "process group backend; auto = nccl with CUDA, else gloo",
                           choices=("auto", "gloo", "nccl"))
    timeout_s: float = setting(600.0, "collective timeout until the first step is done", gt=0)
    mixed_precision: str = setting("auto", "compute dtype; auto = bf16 on GPU, fp32 on CPU",
                                   choices=("auto", "fp32", "bf16"))
    compile: bool = setting(False, "torch.compile the model (per block under FSDP; inductor, needs a C compiler)")
    activation_checkpointing: str = setting("none", "recompute activations: selective (every other block) | full",
                                            choices=("none", "selective", "full"))
    fused_adamw: str = setting("auto", "auto (fused kernel on GPU and CPU) | fused | foreach",
                               choices=("auto", "fused", "foreach"))
    tune_malloc: bool = setting(True, "glibc keeps freed blocks (no page faults), heap on huge pages")


@dataclass
class FaultConfig:
    """Read by the launcher (python -m launch) and by the trainer; plain torchrun uses the timeouts only."""

    heartbeat_s: float = setting(0.5, "how often the launcher's watchdog reads the ranks' heartbeats", gt=0)
    hang_timeout_s: float = setting(60.0, "no step finished for this long (after the first step) = a hung rank",
                                    gt=0)
    preempt_grace_s: float = setting(30.0, "SIGTERM: the launcher ends within this; its ranks commit an emergency "
                                     "checkpoint within it less a reserve (25%, at most 5 s)", gt=0)
    collective_timeout_s: float = setting(120.0, "collective timeout after the first step (dist.timeout_s before it)",
                                          ge=0)
    max_restarts: int = setting(10, "launcher restart budget (--max-restarts overrides)", ge=0)
    restart_backoff_s: float = setting(1.0, "wait before a restart after a failure that made no progress; doubles",
                                       ge=0)
    crash_loop_repeats: int = setting(3, "the same failure at the same step this many times in a row = crash loop",
                                      gt=0)
    node_failure_limit: int = setting(3, "several nodes under --nnodes MIN:MAX: a node whose ranks fail (crash, "
                                      "killed, hung) this many times within node_failure_window_s, more often than "
                                      "the rest of the job, is set aside (run.dir/excluded-nodes); 0 = never", ge=0)
    node_failure_window_s: float = setting(3600.0, "the window node_failure_limit counts in", gt=0)
    warm_restarts: bool = setting(True, "the launcher forks restarted ranks from a process with torch and the trainer "
                                  "already imported (launch.zygote) instead of starting Python afresh; false = off")
    in_process: bool = setting(True, "python -m launch: when a rank fails, the other ranks keep their processes "
                               "and restore in place, and only the failed rank is started again "
                               "(trainer.recovery.inplace); false = every rank restarts")
    node_silence_s: float = setting(5.0, "several nodes: a node whose launcher has not been heard for this long is "
                                    "lost (power or link gone: no connection closed), and a node that has not heard "
                                    "the rendezvous store for this long is cut off", gt=0)
    straggler_factor: float = setting(1.5, "a rank whose own work per step (data wait + compute, not waiting in "
                                      "collectives) is this many times the other ranks' median is slow; 0 = off",
                                      ge=0)
    straggler_s: float = setting(30.0, "ranks are compared over periods of at least this many seconds (whole log "
                                 "windows): slow over a period = a straggler (a `straggler` event); not slow over a "
                                 "later one = recovered", gt=0)
    verify_every: int = setting(200, "replay a step every this many steps and compare every rank's results bit for "
                                "bit (a spot check for silent data corruption, trainer.health); 0 = off", ge=0)
    anomaly_window: int = setting(50, "a step whose loss is far above the last this many steps' (or whose loss or "
                                  "gradient norm is non-finite) is replayed: hardware or data at fault "
                                  "(trainer.health); 0 = non-finite steps only", ge=0)
    anomaly_threshold: float = setting(10.0, "how far above: this many robust standard deviations (the median "
                                       "absolute deviation) above the median", gt=0)

    def check(self, prefix: str = "") -> None:
        if self.node_silence_s < max(4 * INTERVAL_S, 2 * CONFIRM_S):
            raise ConfigError(f"config key '{prefix}node_silence_s' ({self.node_silence_s}) must be at least "
                              f"{max(4 * INTERVAL_S, 2 * CONFIRM_S):g} s: several of the launchers' liveness counts "
                              f"(every {INTERVAL_S:g} s) must be missed before a node counts as lost")
        if 0 < self.straggler_factor <= 1:
            raise ConfigError(f"config key '{prefix}straggler_factor' ({self.straggler_factor}) must be above 1 "
                              "(how many times slower than the other ranks), or 0 for no straggler detection")


@dataclass
class StorageConfig:
    """Bounds on every storage call (checkpoints and data, local or object storage)."""

    timeout_s: float = setting(30.0, "object storage: connect and read timeout of one request (s3fs/botocore)",
                               gt=0)
    stall_s: float = setting(90.0, "a checkpoint save or load, the dataset open or a wait for training data that "
                             "takes longer is stalled storage: the rank names the URL and exits 4; 0 = unbounded. "
                             "Keep it below fault.collective_timeout_s, which its peers wait in a save", ge=0)


@dataclass
class LogConfig:
    progress: bool = setting(True, "show progress on the console (rank 0)")
    tensorboard: bool = setting(False, "scalars to run.dir/tb/ on rank 0 (needs the tensorboard package)")
    wandb: bool = setting(False, "the same scalars to Weights & Biases from rank 0, files in run.dir/wandb/ "
                          "(needs the wandb package: pip install 'rekindle[wandb]')")
    wandb_project: str = setting("rekindle", "W&B project (the entity: WANDB_ENTITY or the login's default)")
    wandb_mode: str = setting("auto", "online | offline (`wandb sync` uploads later) | auto = $WANDB_MODE, "
                              "else online", choices=("auto", "online", "offline"))
    peak_tflops: float = setting(0.0, "per-device peak for MFU; 0 = known GPU table, or measured on CPU", ge=0)
    cost_per_device_hour: float = setting(
        0.0, "price of one device (GPU, or CPU process) per hour; 0 = no cost report", ge=0)


@dataclass
class ProfileConfig:
    steps: list[int] = setting([], "[first, last]: torch.profiler trace of these steps to run.dir/profile/")

    def check(self, prefix: str = "") -> None:
        steps = list(self.steps)
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(
                f"config key '{prefix}steps' must be [first, last] with 1 <= first <= last; got {steps}")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the user-facing key names (`checkpoint.async`, not `async_`)."""
        return _rename(dataclasses.asdict(self), schema.yaml_key)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.run.dir) / "checkpoints")


def _rename(tree: Any, rename) -> Any:
    if isinstance(tree, dict):
        return {rename(k): _rename(v, rename) for k, v in tree.items()}
    return tree


def _schema_keys(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every valid dotted key (user spelling) -> its dataclass field type name."""
    keys: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        name = prefix + schema.yaml_key(f.name)
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


def _merge_into(into: dict, tree: dict) -> None:
    """Merge a layer's tree into `into` as OmegaConf.merge would: groups key by key, values replaced."""
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge_into(into[key], value)
        else:
            into[key] = value


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

    for source, tree in layers:
        _check_keys(tree, source, valid)
    combined: dict = {}
    for _, tree in layers:
        _merge_into(combined, _rename(tree, schema.attr_name))
    try:  # the layers merged as plain dicts, then into the schema once (a restarted rank waits for this)
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(combined))
    except OmegaConfBaseException as first:
        merged = OmegaConf.structured(Config)
        for source, tree in layers:  # one by one, to name the layer a bad value came from
            try:
                merged = OmegaConf.merge(merged, OmegaConf.create(_rename(tree, schema.attr_name)))
            except OmegaConfBaseException as e:
                full_key = getattr(e, "full_key", None) or "?"
                raise ConfigError(f"bad value for config key '{_to_yaml_key_path(full_key)}' in {source}: "
                                  f"{str(e).splitlines()[0]}") from e
        raise ConfigError(f"invalid config: {first}") from first
    try:
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {e}") from e
    validate(cfg)
    return cfg


def _to_yaml_key_path(full_key: str) -> str:
    return ".".join(schema.yaml_key(part) for part in str(full_key).split("."))


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every key within the limits declared beside it and each group's cross-field rules
    (`trainer.config.schema.check`); with world_size, also batch divisibility."""
    schema.check(cfg)
    t = cfg.train
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
