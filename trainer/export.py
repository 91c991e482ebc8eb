"""`python -m trainer.export CHECKPOINT OUT.safetensors`: consolidated model weights for inference.

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
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer import logs, storage
from trainer.checkpoint import COMMIT, STEP_DIR, CheckpointError, committed_steps, read_train_state, step_dir, verify
from trainer.checkpoint.format import CheckpointNotFoundError, load_metadata, load_state
from trainer.protocol import EXIT_FAILED, EXIT_USAGE

log = logs.get_logger("export")

USAGE = "usage: python -m trainer.export CHECKPOINT OUT.safetensors  (CHECKPOINT: a step directory or a root)"


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logs.setup(stream=sys.stderr)
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        info = export(argv[0], argv[1])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, CheckpointNotFoundError) else EXIT_FAILED
    tied = "".join(f"; {name} tied to {first} (stored once)" for name, first in info["tied"].items())
    print(f"exported step {info['step']} of {info['source']} -> {info['out']}: {info['tensors']} tensors, "
          f"{info['params']:,} parameters ({'/'.join(info['dtypes'])}), {info['bytes'] / 1e6:.1f} MB{tied}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
