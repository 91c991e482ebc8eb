"""`python -m trainer.export CHECKPOINT OUT.safetensors`: consolidated model weights for inference;
`python -m trainer.export CHECKPOINT OUT_DIR --format hf [--dtype bf16|fp32] [--tokenizer tokenizer.json]`:
a Hugging Face model directory that `transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)` loads;
`python -m trainer.export CHECKPOINT OUT_DIR --format dcp`: the whole step (model, optimizer, train state)
in DCP's standard format, which stock tools read (`dcp.load(sd, checkpoint_id=OUT_DIR)`,
`format_utils.dcp_to_torch_save`), and a committed, checksummed rekindle step that training resumes from.

CHECKPOINT is a step directory (`.../step-NNNNNNNN`) or a checkpoint root (then its newest committed
step that verifies; a damaged newer step is skipped with a warning naming the file), a local path or
any fsspec URL (`s3://...`). Before anything is read, every file of the step is checked against the
sizes and checksums in COMMIT.json: an uncommitted, missing, truncated or corrupt checkpoint is an error
naming the file. Only the model weights are read (no optimizer state), consolidated from however many
ranks wrote them, in this one process without a process group.

Tied parameters (output.weight = tok_embeddings.weight) are stored once, as safetensors requires; the
file's metadata `tied` lists them (JSON {name: name it shares}), and `safetensors.torch.load_model`
restores the tie when loading into a model that ties them:

    model = Transformer(ModelArgs(...)); safetensors.torch.load_model(model, "OUT.safetensors")

`--format hf` writes config.json (from the model arguments in train_state.json, or for a checkpoint that
predates them the run's config.yaml beside the checkpoint root), model.safetensors (HF names and RoPE row
order, `trainer.model.hf`; float32 unless `--dtype bf16`), tokenizer_config.json, generation_config.json and
tokenizer.json: the one given, else the tokenizer of the dataset the checkpoint was trained on, found by
its manifest checksum (train_state.json's data state) under the run config's data.path or in the
built-in corpus cache. Without one the model files are still written, with a warning that says how to
add it (the EOS id in config.json is then unknown: null).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from common import storage
from trainer.checkpoint import (
    COMMIT,
    STEP_DIR,
    TRAIN_STATE,
    CheckpointError,
    IncompatibleCheckpointError,
    committed_steps,
    read_train_state,
    step_dir,
    verify,
)
from trainer.checkpoint.commit import read_commit, write_commit
from trainer.checkpoint.format import (
    CheckpointNotFoundError,
    load_metadata,
    load_state,
    quiet_single_process,
    set_element,
)
from trainer.checkpoint.writing import writer as shard_writer
from trainer.config import Config, ConfigError
from trainer.config import load as load_config
from trainer.model import hf
from trainer.model.args import ModelArgs
from trainer.observability import logs
from trainer.runtime.protocol import EXIT_FAILED, EXIT_USAGE

log = logs.get_logger("export")

USAGE = (
    "usage: python -m trainer.export CHECKPOINT OUT.safetensors  (CHECKPOINT: a step directory or a root)\n"
    "       python -m trainer.export CHECKPOINT OUT_DIR --format hf [--dtype bf16|fp32] [--tokenizer tokenizer.json "
    "[--eos-token TOKEN]]\n"
    "       python -m trainer.export CHECKPOINT OUT_DIR --format dcp  (the whole step in DCP's standard format)"
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class UsageError(ValueError):
    """A bad command line or argument file (exit EXIT_USAGE)."""


class TokenizerNotFoundError(LookupError):
    """No tokenizer.json of the checkpoint's dataset could be found; the message says why."""


def resolve(checkpoint: str) -> str:
    """The verified step directory `checkpoint` names (itself, or the newest good step of a root)."""
    fs, p = storage.filesystem(checkpoint)
    checkpoint = checkpoint.rstrip("/")
    if not fs.exists(p):
        raise CheckpointNotFoundError(f"no checkpoint at {checkpoint}: it does not exist")
    if STEP_DIR.match(p.rstrip("/").rsplit("/", 1)[-1]) or fs.exists(f"{p}/{COMMIT}"):
        if not fs.exists(f"{p}/{COMMIT}"):
            raise CheckpointError(f"{checkpoint} is not committed (no {COMMIT}): a save that did not finish")
        problem = verify(checkpoint)
        if problem:
            raise CheckpointError(f"{checkpoint} is unusable: {problem}")
        return checkpoint
    steps = committed_steps(checkpoint)  # a save that did not finish is never a candidate
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint in {checkpoint}")
    for step in reversed(steps):
        path = step_dir(checkpoint, step)
        problem = verify(path)
        if not problem:
            return path
        log.warning("step %d is unusable, trying the previous one: %s", step, problem)
    raise CheckpointError(f"no usable committed checkpoint in {checkpoint}")


def consolidate(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str], dict]:
    """Full (unsharded) model weights of the verified step at `path`, its tied names and train state."""
    fs, p = storage.filesystem(path)
    state = asdict(read_train_state(path))
    tied = state.get("tied") or {}
    metadata = load_metadata(fs.cat_file(f"{p}/.metadata"))
    weights = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise CheckpointError(f"{path} holds no model weights")
    tied = {name: first for name, first in tied.items() if name in weights and first in weights}
    for name in tied:
        del weights[name]  # stored once, under the name it is tied to
    load_state({"model": weights}, path, no_dist=True)
    return weights, tied, state


def export(checkpoint: str, out: str) -> dict:
    """Write the model weights of `checkpoint` to `out` (safetensors); returns what was written."""
    path = resolve(checkpoint)
    weights, tied, state = consolidate(path)
    metadata = {"format": "pt", "step": str(state.get("step", "")), "source": path, "tied": json.dumps(tied)}
    if not storage.is_local(out):
        fs, p = storage.filesystem(out)
        fs.pipe_file(p, save(weights, metadata=metadata))
        size = int(fs.size(p))
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, out, metadata=metadata)
        size = Path(out).stat().st_size
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    return {"source": path, "out": out, "step": state.get("step"), "tensors": len(weights), "tied": tied,
            "params": sum(t.numel() for t in weights.values()), "bytes": size, "dtypes": dtypes}


def export_dcp(checkpoint: str, out: str) -> dict:
    """Copy the verified step `checkpoint` to the new directory `out` in DCP's standard format (every
    item: weights, optimizer state and hyper-parameters), with its train_state.json and a COMMIT.json of
    the new files. Items are read with the safe reader (nothing is unpickled but plain data)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = resolve(checkpoint)
    fs, p = storage.filesystem(path)
    out_fs, out_p = storage.filesystem(out)
    if out_fs.exists(out_p) and (not out_fs.isdir(out_p) or out_fs.ls(out_p)):
        raise FileExistsError(f"{out} exists and is not an empty directory: not overwritten")
    metadata = load_metadata(fs.cat_file(f"{p}/.metadata"))
    sd: dict = {}
    for key, meta in metadata.state_dict_metadata.items():  # flat: the checkpoint's own item names
        if isinstance(meta, TensorStorageMetadata):
            sd[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            sd[key] = None  # replaced by the stored value
    load_state(sd, path, no_dist=True)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested: dict = {}
    for key, value in sd.items():  # the nesting it was saved from ({"model": ..., "optim": ...}): same names
        set_element(nested, tuple(paths.get(key, (key,))), value)
    state = read_train_state(path)
    w = shard_writer(out, fmt="dcp")
    with quiet_single_process():
        dcp.save(nested, storage_writer=w, no_dist=True)
    write_commit(out, out, state, dict(w.digests), int(read_commit(path).get("world", state.world or 1)))
    tensors = [t for t in sd.values() if torch.is_tensor(t)]
    return {"source": path, "out": out, "step": state.step, "items": len(sd), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors), "format": "dcp"}


# ---------------------------------------------------------------------- --format hf
def export_hf(checkpoint: str, out: str, dtype: str = "fp32", tokenizer: str | None = None,
              eos_token: str = hf.EOS) -> dict:
    """Write `checkpoint` as a Hugging Face Llama directory `out` (see the module docstring); returns what
    was written. `eos_token`: the document separator of a `tokenizer` given (a found one's manifest says)."""
    given = read_tokenizer(tokenizer) if tokenizer else None  # a bad argument fails before any real work
    path = resolve(checkpoint)
    weights, _, state = consolidate(path)
    config = run_config(path)
    args = model_args(path, state, config)
    tok_json, tok_source = given, tokenizer
    if tok_json is None:
        try:
            tok_json, tok_source, eos_token = find_tokenizer(state, config)
        except TokenizerNotFoundError as e:
            log.warning("no %s written: %s. Pass --tokenizer FILE (the tokenizer.json of the dataset the model was "
                        "trained on), or copy that file into %s", hf.TOKENIZER, e, out)
    eos = check_tokenizer(tok_json, args, tok_source, eos_token) if tok_json is not None else None
    files = hf.write_hf_llama(out, weights, args, DTYPES[dtype], tok_json, eos, eos_token)
    return {"source": path, "out": out, "step": state.get("step"), "dtype": str(DTYPES[dtype]).removeprefix("torch."),
            "params": sum(t.numel() for t in weights.values()), "files": files, "tokenizer": tok_source}


def read_tokenizer(path: str) -> bytes:
    """The bytes of the tokenizer.json at `path` (a path or URL); UsageError if there is none."""
    fs, p = storage.filesystem(path)
    try:
        return fs.cat_file(p)
    except (FileNotFoundError, IsADirectoryError):
        raise UsageError(f"--tokenizer {path}: no such file") from None


def check_tokenizer(data: bytes, args: ModelArgs, where: str, eos_token: str = hf.EOS) -> int:
    """The id of `eos_token` in tokenizer.json `data` (from `where`), which must fit the model."""
    from data import tokenizer as tokenizers_

    try:
        tok = tokenizers_.from_bytes(data)
        eos = tokenizers_.eos_id(tok, eos_token)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a malformed file
        raise UsageError(f"{where} is not a rekindle tokenizer.json: {e}") from None
    if tok.get_vocab_size() > args.vocab_size:
        raise UsageError(f"{where} has {tok.get_vocab_size()} tokens, more than the model's "
                         f"vocab_size {args.vocab_size}: not the tokenizer it was trained with")
    return eos


def run_config(path: str) -> Config | None:
    """The run's config.yaml beside checkpoint root (run.dir/checkpoints/step-N, the default layout), if
    there is one and it loads; None otherwise."""
    if not storage.is_local(path):
        return None
    candidate = Path(storage.local_path(path)).parent.parent / "config.yaml"
    if not candidate.is_file():
        return None
    try:
        return load_config(candidate)
    except ConfigError as e:
        log.warning("ignoring the run config %s: %s", candidate, e)
        return None


def model_args(path: str, state: dict, config: Config | None) -> ModelArgs:
    """The checkpoint's model arguments: as train_state.json records them, else the run config's."""
    if state.get("model"):
        known = {f.name for f in fields(ModelArgs)}
        return ModelArgs(**{k: v for k, v in state["model"].items() if k in known})
    if config is not None:
        log.info("%s/%s records no model arguments: using the run's config.yaml", path, TRAIN_STATE)
        return config.model
    raise IncompatibleCheckpointError(
        f"{path}/{TRAIN_STATE} records no model arguments (a checkpoint saved before they were kept) and there is "
        "no run config.yaml beside the checkpoint root: the Hugging Face config.json cannot be written")


def find_tokenizer(state: dict, config: Config | None) -> tuple[bytes, str, str]:
    """tokenizer.json of the dataset the checkpoint was trained on, where it was found and its document
    separator (the manifest's EOS token): the dataset
    whose manifest checksum train_state.json's data state records, looked for at the run config's
    data.path and among the prepared datasets of its data.cache_dir and the default cache (the built-in
    corpus). Raises TokenizerNotFoundError saying why not."""
    from data.corpus import default_cache_dir
    from data.shards import MANIFEST, ShardError, ShardSet

    want = (state.get("data") or {}).get("manifest_sha256")
    if not want:
        raise TokenizerNotFoundError("the checkpoint records no dataset (no data state in its train_state.json)")
    roots = [config.data.path] if config is not None and config.data.path else []
    caches = [Path(config.data.cache_dir)] if config is not None and config.data.cache_dir else []
    for cache in [*caches, default_cache_dir()]:
        if cache.is_dir():
            roots += [str(d) for d in sorted(cache.iterdir()) if (d / MANIFEST).is_file()]
    for root in dict.fromkeys(roots):
        try:
            shards = ShardSet(root)
            if shards.manifest.sha256() != want:
                continue
            data = shards.tokenizer_json()
        except (ShardError, OSError) as e:
            log.info("not the checkpoint's dataset: %s (%s)", root, e)
            continue
        if hashlib.sha256(data).hexdigest() == shards.manifest.tokenizer_sha256:
            return data, storage.join(root, hf.TOKENIZER), shards.manifest.eos_token
        log.warning("%s/%s does not match the checksum its manifest records: not used", root, hf.TOKENIZER)
    looked = f"the run config's data.path {config.data.path}, " if config is not None and config.data.path else ""
    raise TokenizerNotFoundError(f"no dataset with manifest sha256 {want[:12]}… (the checkpoint's) in "
                                 f"{looked}the dataset cache {default_cache_dir()}")


# ---------------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m trainer.export", add_help=False, allow_abbrev=False)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--format", choices=("safetensors", "hf", "dcp"), default="safetensors")
    parser.add_argument("--dtype", choices=tuple(DTYPES))
    parser.add_argument("--tokenizer")
    parser.add_argument("--eos-token", default=None)
    opts = parser.parse_args(argv)
    if opts.format != "hf" and (opts.dtype or opts.tokenizer or opts.eos_token):
        raise UsageError("--dtype, --tokenizer and --eos-token apply to --format hf only")
    if opts.eos_token and not opts.tokenizer:
        raise UsageError("--eos-token goes with --tokenizer (a found tokenizer's manifest names its EOS token)")
    return opts


def say(info: dict) -> str:
    """The summary line of an export."""
    head = f"exported step {info['step']} of {info['source']} -> {info['out']}"
    if info.get("format") == "dcp":
        return (f"{head} (DCP standard format: {info['items']} items, {info['tensors']} tensors, "
                f"{info['bytes'] / 1e6:.1f} MB; committed and checksummed)")
    if "files" not in info:
        tied = "".join(f"; {name} tied to {first} (stored once)" for name, first in info["tied"].items())
        return (f"{head}: {info['tensors']} tensors, {info['params']:,} parameters ({'/'.join(info['dtypes'])}), "
                f"{info['bytes'] / 1e6:.1f} MB{tied}")
    files = [f"{name} ({size / 1e6:.1f} MB)" if name == hf.WEIGHTS else name for name, size in info["files"].items()]
    tok = f"tokenizer from {info['tokenizer']}" if info["tokenizer"] else "NO tokenizer.json (see the warning)"
    return (f"{head} (Hugging Face LlamaForCausalLM, {info['params']:,} parameters, {info['dtype']}): "
            f"{', '.join(files)}; {tok}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logs.setup(stream=sys.stderr)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        opts = parse(argv)
    except UsageError as e:
        print(f"{USAGE}\nerror: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if opts.format == "hf":
            info = export_hf(opts.checkpoint, opts.out, opts.dtype or "fp32", opts.tokenizer, opts.eos_token or hf.EOS)
        elif opts.format == "dcp":
            info = export_dcp(opts.checkpoint, opts.out)
        else:
            info = export(opts.checkpoint, opts.out)
    except (UsageError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        bad_input = (CheckpointNotFoundError, IncompatibleCheckpointError)
        return EXIT_USAGE if isinstance(e, bad_input) else EXIT_FAILED
    print(say(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
