"""`model.init_from=DIR`: training starts from a Hugging Face Llama saved in the test (transformers'
LlamaForCausalLM, random weights, no hub): rekindle's first-step loss is the HF model's loss on the same
batch; a run started this way resumes from its checkpoint like any other; another shape is refused."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import SMOKE, read_metrics, train_here

transformers = pytest.importorskip("transformers")


def saved_llama(tmp_path, **changes):
    """A LlamaForCausalLM of the smoke config's shape (or changed), saved with save_pretrained."""
    from trainer.config import load
    from trainer.model import hf

    args = load(SMOKE).model
    config = transformers.LlamaConfig(**{**hf.hf_config(args), **changes})
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "llama")
    return model, tmp_path / "llama"


def first_batch(overrides: list[str]) -> torch.Tensor:
    """The batch the trainer's first step sees (one rank): the same loader, built the same way."""
    from data.corpus import ensure_builtin
    from data.loader import BatchLoader
    from data.shards import ShardSet
    from data.stream import BatchGeometry, TokenStream
    from trainer.config import load

    cfg = load(SMOKE, overrides)
    shards = ShardSet(str(ensure_builtin(cfg.model.vocab_size, cfg.data.builtin_mb, None)))
    geometry = BatchGeometry(seq_len=cfg.model.seq_len, global_batch=cfg.train.global_batch)
    stream = TokenStream(shards, geometry, seed=cfg.data.seed, val_fraction=cfg.data.val_fraction)
    with BatchLoader(stream, 0, with_positions=False) as loader:
        return next(iter(loader))


def test_training_starts_from_a_hugging_face_llama_and_resumes(cache_dir, tmp_path):
    hf_model, directory = saved_llama(tmp_path)
    overrides = [f"model.init_from={directory}", "data.reset_positions=false", "train.log_every=1",
                 "train.eval_every=0", "checkpoint.every=2"]
    losses = train_here(tmp_path / "run", [*overrides, "train.steps=2"])
    batch = first_batch(overrides)
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()
    assert math.isclose(losses[0], expected, rel_tol=1e-5), (losses[0], expected)
    assert losses[0] < math.log(512) + 0.5  # (a random model's loss: near log(vocab))

    # A resume loads its checkpoint (the HF weights are only the start), like any other run.
    train_here(tmp_path / "run", [*overrides, "train.steps=4"])
    assert sorted(read_metrics(tmp_path / "run")) == [1, 2, 3, 4]


def test_a_hugging_face_model_of_another_shape_is_refused_naming_the_fields(cache_dir, tmp_path):
    from trainer.model.hf import HFModelError

    _, directory = saved_llama(tmp_path, hidden_size=128, intermediate_size=352)
    with pytest.raises(HFModelError, match=r"model.dim=64 vs hidden_size=128"):
        train_here(tmp_path / "run", [f"model.init_from={directory}", "train.steps=1"])
