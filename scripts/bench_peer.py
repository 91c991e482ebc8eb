"""Peer reference for MFU: a GPT-2 model and training step in nanoGPT's style (the loop the issue's
CPU goal comes from), run on this machine so rekindle's MFU can be read against it side by side.

The model is GPT-2 as nanoGPT trains it from scratch: LayerNorm without bias, one fused q|k|v
projection, causal SDPA, a 4x GELU MLP, learned positions, the output layer tied to the token
embeddings and cross-entropy over the full logits; eager fp32, AdamW (foreach on CPU, as nanoGPT
uses fused only on CUDA), gradient clipping at 1.0, random tokens. FLOPs per token are nanoGPT's
`estimate_mfu` count: 6 x parameters (without the position embeddings) + 12 x layers x dim x seq.
Heads are dim // 64 (GPT-2's head size). The process keeps glibc's default malloc settings, as a
plain nanoGPT run does.

    .venv/bin/python scripts/bench_peer.py [--layers 4] [--dim 256] [--batch 8] [--seq 256] [--vocab 8192]

prints one JSON line: tokens_per_s (median over the steps after 3 warm-up steps), flops_per_token.
`scripts/bench.py` runs it (in a fresh process, 1 thread) next to the trainer's MFU row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, bias=False)
        self.attn = _Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.fc_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class PeerGPT(nn.Module):
    """GPT-2 in nanoGPT's form, for benchmarking only."""

    def __init__(self, layers: int, dim: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.layers, self.dim, self.seq = layers, dim, seq
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_Block(dim, max(1, dim // 64)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, bias=False)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def flops_per_token(self) -> float:
        params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6.0 * params + 12.0 * self.layers * self.dim * self.seq


def run(layers: int = 4, dim: int = 256, batch: int = 8, seq: int = 256, vocab: int = 8192,
        steps: int = 20) -> dict:
    """Trains the peer model for 3 + `steps` steps on random tokens; tokens/s is the median step's."""
    torch.manual_seed(0)
    model = PeerGPT(layers, dim, vocab, seq)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95))
    data = torch.randint(0, vocab, (steps + 3, batch, seq + 1))
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        loss = model(data[i, :, :-1], data[i, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return {"tokens_per_s": batch * seq / statistics.median(times[3:]), "flops_per_token": model.flops_per_token()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    print(json.dumps(run(a.layers, a.dim, a.batch, a.seq, a.vocab, a.steps)))


if __name__ == "__main__":
    main()
