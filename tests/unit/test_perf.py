"""Speed options change speed, not results: activation checkpointing, compile and fused AdamW give
the losses of the plain run on CPU, in this process (one `import torch` for all of them). (On 2 gloo
ranks under torchrun, bf16 and the communication wait: tests/integration/test_perf_runs.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import SHORT, SMOKE, train_here
from trainer.config import load
from trainer.optim import build_optimizer

# compile is slow on 2 cores: a one-block model keeps it to one graph (forward + backward)
CPU = torch.device("cpu")
TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1"]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_gives_the_same_losses(plain, tmp_path, mode):
    assert train_here(tmp_path, [*SHORT, f"dist.activation_checkpointing={mode}"]) == pytest.approx(plain, abs=1e-5)


def test_fused_adamw_gives_the_same_losses(plain, tmp_path):
    """dist.fused_adamw=auto is the fused kernel on CPU too: the foreach implementation agrees."""
    foreach = train_here(tmp_path, [*SHORT, "dist.fused_adamw=foreach"])
    assert foreach == pytest.approx(plain, abs=1e-4)
    # step 1's loss comes before any optimizer step: identical; later ones moved by the optimizer
    assert foreach[0] == plain[0] and foreach[-1] < plain[0]
    def defaults(mode: str) -> dict:
        return build_optimizer(torch.nn.Linear(4, 4), load(SMOKE, [f"dist.fused_adamw={mode}"]), CPU).defaults

    assert defaults("auto")["fused"] and not defaults("foreach")["fused"]


@pytest.mark.slow  # compiles
def test_compile_gives_the_same_losses(cache_dir, tmp_path):
    # No final evaluation: under no_grad the compiled forward would be compiled a second time.
    eager = train_here(tmp_path / "eager", [*SHORT, *TINY, "train.eval_batches=0"])
    compiled = train_here(tmp_path / "compiled", [*SHORT, *TINY, "train.eval_batches=0", "dist.compile=true"])
    assert compiled == pytest.approx(eager, abs=1e-4)
