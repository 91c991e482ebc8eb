"""A Llama-style decoder-only transformer in plain PyTorch: RMSNorm, RoPE, SwiGLU, causal attention
(SDPA; when compiled on CPU, a blocked matmul form for short sequences), optional grouped KV heads
and tied embeddings; given targets it returns its loss (the output layer fused with cross-entropy,
`trainer/model/loss.py`). Nothing about parallelism lives here (see parallel.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.args import ModelArgs
from trainer.model.loss import linear_cross_entropy


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """Rotary position embeddings: (cos, sin) of position x frequency, shape (seq_len, head_dim // 2, 2),
    float32; read as complex numbers e^(i * angle) by `apply_rope`."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotates interleaved pairs (x0, x1) by the position angle.
    rotation: (..., seq, head_dim // 2, 2) cos/sin, broadcast over batch and heads.

    Eager: one complex multiply per pair (rotating with four real multiplies, a stack and a flatten
    makes several element-wise passes where this makes one). Under torch.compile: the same product in real
    arithmetic, because inductor generates no code for complex numbers but fuses this into one loop."""
    rotation = rotation.float()  # a no-op for the model's float32 table
    if torch.compiler.is_compiling():
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = rotation.unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.view_as_complex(rotation)).flatten(-2).type_as(x)


# Under torch.compile on CPU, float32 models of sequences up to this length use
# `blocked_causal_attention` (on full-length sequences: the block loop is unrolled per length, so
# other lengths would each compile a graph); longer ones, eager mode, other dtypes and GPUs use the
# fused SDPA kernel, which is the faster one there or where this one was not measured.
BLOCKED_ATTENTION_MAX_SEQ = 256
ATTENTION_BLOCK = 32  # query rows per block


def causal_bias(seq_len: int) -> torch.Tensor:
    """(seq_len, seq_len) additive attention mask: 0 on and below the diagonal, -inf above."""
    return torch.full((seq_len, seq_len), float("-inf")).triu(1)


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                             block: int = ATTENTION_BLOCK) -> torch.Tensor:
    """Causal attention as batched matmuls over blocks of query rows, for short sequences on CPU.

    q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim) with heads a multiple of
    kv_heads (the query heads of a group share one key/value head, as `enable_gqa=True`); bias:
    `causal_bias(seq)`. Equal to `F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=...)`. Block i of query rows attends only to keys 0..end of block i, so the score
    matmuls skip most of the masked upper triangle; the query
    heads of a group are stacked into one matmul against their shared keys. Under torch.compile the
    scale, mask and softmax of a block fuse into one kernel. Why: at seq 128 and head_dim 32 the CPU
    flash kernel spends its time in thousands of tiny GEMM calls, where this path makes a few larger ones
    (docs/performance.md, "Design choices": blocked causal attention)."""
    b, h, t, d = q.shape
    kv_heads = k.shape[1]
    group = h // kv_heads
    outs = []
    for start in range(0, t, block):
        stop = min(start + block, t)
        rows = stop - start
        qi = q[:, :, start:stop].reshape(b * kv_heads, group * rows, d)
        ki = k[:, :, :stop].reshape(b * kv_heads, stop, d)
        vi = v[:, :, :stop].reshape(b * kv_heads, stop, d)
        # scores and soft-max in float32 whatever the input dtype (a no-op for float32 inputs)
        scores = torch.bmm(qi.float(), ki.float().transpose(1, 2)) * d**-0.5
        probs = torch.softmax(scores.view(b * kv_heads, group, rows, stop) + bias[start:stop, :stop], dim=-1)
        outs.append(torch.bmm(probs.view(b * kv_heads, group * rows, stop).to(v.dtype), vi).view(b, h, rows, d))
    return torch.cat(outs, dim=2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """bias: the model's `attn_bias` table (None where sequences are too long for the blocked path)."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rotation), apply_rope(k, rotation)
        blocked = bias is not None and t == bias.shape[0] and q.dtype == torch.float32
        if blocked and x.device.type == "cpu" and torch.compiler.is_compiling():
            out = blocked_causal_attention(q, k, v, bias)  # faster there, see BLOCKED_ATTENTION_MAX_SEQ
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotation, bias)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by index keeps parameter names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_tables(args.head_dim, args.seq_len, args.rope_theta), persistent=False)
        # The mask of blocked_causal_attention, as a table like `rope`: built inside the compiled graph
        # instead, inductor would recompute it per element in the soft-max kernels.
        short = args.seq_len <= BLOCKED_ATTENTION_MAX_SEQ
        self.register_buffer("attn_bias", causal_bias(args.seq_len) if short else None, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.args.init_std
        out_std = std / math.sqrt(2 * self.args.n_layers)  # residual projections (GPT-2 scheme)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (batch, seq) int64 -> logits (batch, seq, vocab) in float32; given `targets`
        (batch, seq), the mean next-token loss instead, computed without materialising the logits
        (`trainer.model.loss.linear_cross_entropy`; `mask` as in `cross_entropy`), as nanoGPT's model
        returns its loss.

        positions: optional (batch, seq) int64 position ids for RoPE, e.g. restarting at 0 after each
        end-of-document token; None means 0..seq-1 in every row (the plain, slightly cheaper path)."""
        t = tokens.shape[1]
        if t > self.args.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds model.seq_len={self.args.seq_len}")
        if positions is None:
            rotation = self.rope[:t]
        else:
            if positions.shape != tokens.shape:
                raise ValueError(f"positions {tuple(positions.shape)} must match tokens {tuple(tokens.shape)}")
            # (batch, 1, seq, head_dim/2): one rotation per row and position, shared by all heads
            rotation = self.rope[positions].unsqueeze(1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rotation, self.attn_bias)
        h = self.norm(h)
        if targets is None:
            return self.output(h).float()
        return linear_cross_entropy(h, self.output.weight, targets, mask)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): 6 x matmul parameters
        (the input embedding is a lookup; the output projection is a matmul even when tied)
        plus attention scores 12 x layers x dim x seq_len (PaLM appendix B)."""
        a = self.args
        matmul_params = sum(
            p.numel() for n, p in self.named_parameters() if p.dim() == 2 and "embeddings" not in n
        )
        if a.tie_embeddings:
            matmul_params += a.vocab_size * a.dim
        return 6.0 * matmul_params + 12.0 * a.n_layers * a.dim * a.seq_len


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token loss. With a (batch, seq) bool `mask`, targets where it is False add zero loss.

    The masked mean still divides by all targets (not by the kept ones), so the loss of a batch is
    exactly the mean of its micro-batches' losses and the same for any world size; with documents of
    n tokens and the boundary target masked, it reads about 1/n lower than a mean over kept targets."""
    if mask is None:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    kept = targets.masked_fill(~mask, -100).flatten(0, 1)  # -100: cross_entropy's default ignore_index
    return F.cross_entropy(logits.flatten(0, 1), kept, reduction="sum") / kept.numel()
