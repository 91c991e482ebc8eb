"""The model: causal, shapes right with grouped KV heads, tied embeddings, FLOP estimate, RoPE at
given (per-document) positions, a loss mask that drops exactly the masked targets, and the blocked
CPU attention path equal to SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.model.transformer import (
    ModelArgs,
    Transformer,
    apply_rope,
    blocked_causal_attention,
    causal_bias,
    cross_entropy,
    rope_tables,
)


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, seq_len=32)
    args.update(kw)
    return Transformer(ModelArgs(**args))


@pytest.mark.parametrize("n_kv_heads", [0, 2, 1])
def test_future_tokens_never_change_earlier_logits(n_kv_heads):
    model = tiny(n_kv_heads=n_kv_heads).eval()
    tokens = torch.randint(0, 97, (2, 32))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # the test can fail: later logits do change


def test_logits_shape_and_too_long_sequence():
    model = tiny()
    assert model(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 97)
    with pytest.raises(ValueError, match="exceeds model.seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_tied_embeddings_share_one_tensor():
    tied, untied = tiny(tie_embeddings=True), tiny(tie_embeddings=False)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.num_params() - tied.num_params() == 97 * 64


def test_grouped_kv_heads_shrink_kv_projections():
    full, grouped = tiny(n_kv_heads=0), tiny(n_kv_heads=1)
    assert grouped.layers["0"].attention.wk.weight.shape == (16, 64)
    assert full.num_params() > grouped.num_params()


def test_flops_per_token_matches_formula():
    model = tiny()
    a = model.args
    per_layer = a.dim * a.dim * 2 + 2 * a.dim * a.kv_heads * a.head_dim + 3 * a.dim * a.ffn_hidden
    expected = 6 * (a.n_layers * per_layer + a.vocab_size * a.dim) + 12 * a.n_layers * a.dim * a.seq_len
    assert model.flops_per_token() == expected


def test_loss_decreases_when_overfitting_one_batch():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 97, (4, 33))
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_explicit_positions_equal_the_plain_path_on_one_document():
    model = tiny().eval()
    tokens = torch.randint(1, 97, (3, 32))
    plain_positions = torch.arange(32).expand(3, 32)
    with torch.no_grad():
        assert torch.allclose(model(tokens, plain_positions), model(tokens), atol=1e-6, rtol=0)


def test_position_reset_after_eos_changes_only_later_logits():
    """Restarting positions after an EOS (id 0 here) at index 12 changes the logits from index 13 on."""
    model = tiny().eval()
    tokens = torch.randint(1, 97, (2, 32))
    tokens[:, 12] = 0
    positions = torch.arange(32).expand(2, 32).clone()
    positions[:, 13:] -= 13
    with torch.no_grad():
        plain, reset = model(tokens), model(tokens, positions)
    assert torch.equal(plain[:, :13], reset[:, :13])
    assert not torch.allclose(plain[:, 13:], reset[:, 13:], atol=1e-4)
    with pytest.raises(ValueError, match="positions"):
        model(tokens, positions[:, :5])


def test_loss_mask_drops_exactly_the_masked_targets():
    torch.manual_seed(1)
    logits, targets = torch.randn(2, 8, 97), torch.randint(0, 97, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    assert torch.allclose(cross_entropy(logits, targets, mask), cross_entropy(logits, targets))
    mask[0, 3] = mask[1, 7] = False
    per_target = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    expected = (per_target.sum() - per_target[3] - per_target[15]) / 16
    assert torch.allclose(cross_entropy(logits, targets, mask), expected)
    # the boundary target gets no gradient at all
    logits.requires_grad_(True)
    cross_entropy(logits, targets, mask).backward()
    assert torch.count_nonzero(logits.grad[0, 3]) == 0 and torch.count_nonzero(logits.grad[0, 2]) > 0
    # the masked loss splits exactly into micro-batches: mean of the halves' losses == the whole
    parts = zip(logits.split(1), targets.split(1), mask.split(1), strict=True)
    halves = [cross_entropy(lo, t, m) for lo, t, m in parts]
    assert torch.allclose(sum(halves) / 2, cross_entropy(logits, targets, mask))


def test_rope_scores_depend_only_on_relative_position():
    """RoPE: rotating q at position m and k at position n gives q.k that depends on m - n only, and
    the real-arithmetic form used under torch.compile equals the complex multiply used in eager."""
    torch.manual_seed(0)
    rotation = rope_tables(head_dim=8, seq_len=16, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> torch.Tensor:
        # a batch of two one-token sequences: q at position m, k at position n
        rotated = apply_rope(torch.stack((q, k)).view(2, 1, 1, 8), rotation[[m, n]].view(2, 1, 1, 4, 2))
        return rotated[0, 0, 0] @ rotated[1, 0, 0]

    assert torch.allclose(score(5, 2), score(12, 9), atol=1e-5) and not torch.allclose(score(5, 2), score(5, 3))
    assert torch.equal(apply_rope(q.view(1, 1, 1, 8), rotation[:1]), q.view(1, 1, 1, 8))  # position 0: identity
    x = torch.randn(2, 3, 16, 8)
    compiled = torch.compile(apply_rope, backend="aot_eager")(x, rotation)  # traced: the real-arithmetic branch
    assert torch.allclose(compiled, apply_rope(x, rotation), atol=1e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "block"), [(4, 4, 40, 16), (4, 2, 40, 16), (4, 1, 32, 32), (2, 1, 7, 32)]
)
def test_blocked_attention_equals_sdpa_with_its_gradients(heads, kv_heads, seq, block):
    """Blocks that do and do not divide the sequence, one block, grouped and plain heads."""
    g = torch.Generator().manual_seed(seq + heads + kv_heads)
    q = torch.randn(3, heads, seq, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, seq, 8, generator=g, requires_grad=True) for _ in range(2))
    upstream = torch.randn(3, heads, seq, 8, generator=g)
    got = blocked_causal_attention(q, k, v, causal_bias(seq), block=block)
    got_grads = torch.autograd.grad(got, (q, k, v), upstream)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_blocked_attention_in_bf16_scores_in_float32():
    """bf16 inputs with large scores: scores and soft-max are computed in float32 (bf16-rounded scores
    were off by 0.07 here), so the result is as close to float32 attention as bf16 output allows."""
    g = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(2, 4, 40, 8, generator=g)).bfloat16()
    k, v = (torch.randn(2, 2, 40, 8, generator=g).bfloat16() for _ in range(2))
    got = blocked_causal_attention(q, k, v, causal_bias(40), block=16)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.01, atol=0.02)


@pytest.mark.slow  # compiles (about 12 s on 2 cores)
def test_compiled_model_takes_the_blocked_path_and_matches_eager():
    """Traced (aot_eager: no C++ compile), the model runs blocked attention on full-length sequences
    (three blocks, the last one partial; GQA) with the logits and gradients of eager SDPA; a shorter
    sequence takes SDPA (no graph per length)."""
    model = tiny(seq_len=80)
    tokens = torch.randint(0, 97, (2, 80))
    traced = torch.compile(model, backend="aot_eager", fullgraph=True)
    for t in (80, 50):
        got = traced(tokens[:, :t])
        got_grads = torch.autograd.grad(got.square().mean(), list(model.parameters()))
        want = model(tokens[:, :t])
        want_grads = torch.autograd.grad(want.square().mean(), list(model.parameters()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
