"""Benchmark: causal attention on CPU under torch.compile, the fused SDPA (flash) kernel against
`trainer.model.transformer.blocked_causal_attention`, measured side by side in one process (1 thread):

  1. one layer's attention, forward + backward, at the config's head shapes and tokens per batch,
     for its sequence length and twice it (the blocked path is used up to
     BLOCKED_ATTENTION_MAX_SEQ);
  2. the config's whole compiled training step (world size 1: forward with the model's loss,
     backward, clipping, fused AdamW), once with the blocked path and once with SDPA (the same
     model class with its `attn_bias` table set to None), alternating blocks of steps.

    .venv/bin/python scripts/bench_attention.py [--config configs/default.yaml] [--rounds 8] [key=value ...]

Compiling takes a minute or two on 2 cores. Ratios are what to compare: this VM's clock moves
absolute times by 10-20% within minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainer import config as config_
from trainer.model.transformer import ModelArgs, Transformer, blocked_causal_attention, causal_bias
from trainer.runtime import host


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def layer_attention(args: ModelArgs, tokens: int, seq: int, rounds: int) -> tuple[float, float]:
    """(SDPA ms, blocked ms) for one layer's attention, forward + backward, both compiled."""
    g = torch.Generator().manual_seed(0)
    batch = max(1, tokens // seq)
    q = torch.randn(batch, args.n_heads, seq, args.head_dim, generator=g, requires_grad=True)
    k, v = (torch.randn(batch, args.kv_heads, seq, args.head_dim, generator=g, requires_grad=True)
            for _ in range(2))
    upstream = torch.randn_like(q)
    bias = causal_bias(seq)
    gqa = args.kv_heads != args.n_heads
    sdpa = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))
    blocked = torch.compile(lambda q, k, v: blocked_causal_attention(q, k, v, bias))
    torch.testing.assert_close(blocked(q, k, v), sdpa(q, k, v), rtol=1e-4, atol=1e-5)
    results = {"sdpa": [], "blocked": []}
    for r in range(rounds):
        for name, fn in (("sdpa", sdpa), ("blocked", blocked))[:: 1 if r % 2 == 0 else -1]:
            fn(q, k, v).backward(upstream)  # warm-up (and, the first time, compile)
            results[name].append(median_ms(lambda fn=fn: fn(q, k, v).backward(upstream), 5))
    return statistics.median(results["sdpa"]), statistics.median(results["blocked"])


def training_steps(cfg: config_.Config, rounds: int) -> tuple[float, float]:
    """(SDPA ms, blocked ms) per compiled training step of the config's model at world size 1."""
    t = cfg.train
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, cfg.model.seq_len + 1), generator=g)
    steps = {}
    for name in ("sdpa", "blocked"):
        torch.manual_seed(cfg.run.seed)
        model = Transformer(cfg.model)
        if name == "sdpa":
            model.attn_bias = None  # the model then takes SDPA everywhere
        model.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, fused=True)

        def step(model: Transformer = model, opt: torch.optim.Optimizer = opt) -> float:
            loss = model(batch[:, :-1], targets=batch[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for _ in range(3):
            step()  # compile and warm up
        steps[name] = step
    results = {"sdpa": [], "blocked": []}
    for r in range(rounds):
        for name in ("sdpa", "blocked")[:: 1 if r % 2 == 0 else -1]:
            results[name].append(median_ms(steps[name], 4))
    return statistics.median(results["sdpa"]), statistics.median(results["blocked"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds of each comparison")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = p.parse_args()
    cfg = config_.load(a.config, a.overrides)
    torch.set_num_threads(1)
    if cfg.dist.tune_malloc:
        host.tune_malloc()
    args = cfg.model
    tokens = cfg.train.micro_batch * args.seq_len
    print(f"# attention on CPU, compiled, 1 thread | {a.config} | heads {args.n_heads} (KV {args.kv_heads}), "
          f"head_dim {args.head_dim}, {tokens:,} tokens per batch | torch {torch.__version__}")
    print("\n## one layer's attention, forward + backward (median ms)")
    for seq in (args.seq_len, 2 * args.seq_len):
        sdpa, blocked = layer_attention(args, tokens, seq, a.rounds)
        print(f"seq {seq:5d}: SDPA {sdpa:7.2f} | blocked {blocked:7.2f} | blocked is x{sdpa / blocked:.2f}")
    if args.seq_len > 256:
        print("\n(the model's sequence is longer than BLOCKED_ATTENTION_MAX_SEQ: it uses SDPA; no step comparison)")
        return
    print(f"\n## compiled training step of the config's model (median ms, {a.rounds} alternating rounds)")
    sdpa, blocked = training_steps(cfg, a.rounds)
    print(f"step: SDPA {sdpa:7.1f} | blocked {blocked:7.1f} | blocked is x{sdpa / blocked:.3f}")


if __name__ == "__main__":
    main()
