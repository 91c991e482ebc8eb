"""The fused, chunked output projection + cross-entropy equals projecting then `cross_entropy`: the
loss and both gradients, with and without a loss mask, for chunk sizes that do and do not divide
the rows, under gradient accumulation, without autograd, under bf16 autocast, and as the model's
own loss (eager and compiled)."""

from __future__ import annotations

import pytest
import torch

from trainer.model.loss import chunk_rows, linear_cross_entropy
from trainer.model.transformer import ModelArgs, Transformer, cross_entropy


def inputs(n: int = 3, t: int = 50, dim: int = 32, vocab: int = 301, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, dim, generator=g).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (n, t), generator=g)
    mask = torch.rand(n, t, generator=g) > 0.2
    return hidden, weight, targets, mask


def reference(hidden, weight, targets, mask=None):
    """Loss and gradients the plain way: full logits, then cross_entropy."""
    loss = cross_entropy(hidden @ weight.t(), targets, mask)
    grads = torch.autograd.grad(loss, (hidden, weight))
    return loss.detach(), grads


@pytest.mark.parametrize("rows", [64, 37, 150, 4096])  # divides 150 rows or not; one chunk; more rows than exist
@pytest.mark.parametrize("masked", [False, True])
def test_equals_projection_then_cross_entropy(rows, masked):
    hidden, weight, targets, mask = inputs()
    mask = mask if masked else None
    loss = linear_cross_entropy(hidden, weight, targets, mask, rows=rows)
    grads = torch.autograd.grad(loss, (hidden, weight))
    want_loss, want_grads = reference(hidden, weight, targets, mask)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    if masked:  # a masked target adds nothing, not even gradient
        dropped = (~mask).nonzero()[0]
        assert torch.count_nonzero(grads[0][tuple(dropped)]) == 0


def test_a_target_probability_that_underflows_still_gives_the_exact_loss():
    """One row's target sits 200 nats below the rest (its float32 probability is 0): the CPU path
    recomputes that row's loss from the log-sum-exp instead of returning inf."""
    hidden, weight, targets, _ = inputs(seed=3)
    with torch.no_grad():
        hidden[0, 5] = 0.0
        hidden[0, 5, 0] = 1.0
        weight[:, 0] = 0.0
        weight[targets[0, 5], 0] = -200.0
    loss = linear_cross_entropy(hidden, weight, targets, rows=64)
    grads = torch.autograd.grad(loss, (hidden, weight))
    want_loss, want_grads = reference(hidden, weight, targets)
    assert torch.isfinite(loss) and want_loss > 200 / targets.numel()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_upstream_gradient_scales_both_gradients_as_in_accumulation():
    hidden, weight, targets, mask = inputs(seed=1)
    (linear_cross_entropy(hidden, weight, targets, mask, rows=64) / 4).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (cross_entropy(hidden @ weight.t(), targets, mask) / 4).backward()
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)


def test_without_autograd_only_the_loss_is_computed():
    hidden, weight, targets, mask = inputs(seed=2)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, mask, rows=64)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, targets, mask)[0], rtol=1e-5, atol=1e-6)


def test_bf16_autocast_projects_in_bf16_and_stays_close():
    hidden, weight, targets, _ = inputs(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, rows=64)
        want = cross_entropy((hidden @ weight.t()).float(), targets)  # what output(h).float() computes
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=2e-3, atol=2e-3)
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    fp32_grad = torch.autograd.grad(cross_entropy(hidden @ weight.t(), targets), weight)[0]
    assert torch.nn.functional.cosine_similarity(weight.grad.flatten(), fp32_grad.flatten(), dim=0) > 0.99


def test_bad_shapes_are_refused():
    hidden, weight, targets, mask = inputs()
    with pytest.raises(ValueError, match="must match"):
        linear_cross_entropy(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="must match"):
        linear_cross_entropy(hidden, weight, targets, mask[:, :-1])


def test_chunks_are_cache_sized_on_cpu():
    assert chunk_rows(4096, torch.device("cpu")) == 512  # 8 MiB of float32 logits
    assert chunk_rows(200_000, torch.device("cpu")) == 64  # never fewer than 64 rows
    assert chunk_rows(32_000, torch.device("cuda")) == 4160  # 512 MiB, rounded down to a multiple of 64


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # tracing is slow
def test_the_model_returns_the_same_loss_and_gradients_as_its_logits_give(compiled):
    """Eager, and traced by torch.compile (aot_eager: the fused loss stays eager inside the traced model;
    inductor's code for the same model is tests/unit/test_perf.py's compile test, on the trainer)."""
    # one block (fewer ops to trace), two query heads sharing one key/value head
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=97, seq_len=32))
    tokens = torch.randint(0, 97, (3, 33))
    mask = torch.rand(3, 32) > 0.1
    fused = torch.compile(model, backend="aot_eager") if compiled else model
    loss = fused(tokens[:, :-1], targets=tokens[:, 1:], mask=mask)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    want = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], mask)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
