"""Benchmark: the trainer's tokens/s against a bare PyTorch loop (nanoGPT style) on the same model,
the same global batch and the same process count (one process), measured side by side in one run.

    .venv/bin/python scripts/bench_step.py [--config configs/default.yaml] [--steps 60] [--rounds 2] [key=value ...]

The bare loop has no data loading (pre-made random tokens), no metrics, no checkpoint; the trainer
runs its real loop (data from the built-in corpus, logging, guard) with eval and checkpoints only at
the end, whose window is left out. Both report the median tokens/s over windows of 10 steps after
a warm-up window. Rounds alternate bare/trainer so machine noise hits both alike. The trainer tunes
glibc malloc in its process and puts its heap on huge pages (dist.tune_malloc); this script does the
same in the bare loop, so the ratio measures the loop, not the allocator. `scripts/bench.py` runs this comparison
together with the rest of the performance report.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer import config as config_
from trainer.loop import train
from trainer.model.transformer import Transformer
from trainer.optim import lr_at
from trainer.runtime import host

WINDOW = 10


def bare_loop(cfg: config_.Config, steps: int) -> list[float]:
    """nanoGPT-style loop: forward (the model returns its loss), backward, clip, AdamW step. Returns
    tokens/s per window.
    Fused AdamW and, on a GPU, bf16 autocast, like the trainer's world-size-1 path; on CPU the heap on
    huge pages after the first step, as in the trainer (dist.tune_malloc)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model).to(device)
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=True)  # as the trainer's auto
    batch = torch.randint(0, cfg.model.vocab_size, (t.global_batch, cfg.model.seq_len + 1), device=device)
    accum = t.global_batch // t.micro_batch
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    rates, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        for micro in batch.split(t.micro_batch):
            with autocast:
                loss = model(micro[:, :-1], targets=micro[:, 1:]) / accum  # the model returns its loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer syncs on the loss/grad norm each step too
        if step == 1 and cfg.dist.tune_malloc and device.type == "cpu":
            host.huge_pages_for_heap()  # as the trainer does after its first step
        if step % WINDOW == 0:
            now = time.perf_counter()
            rates.append(t.global_batch * cfg.model.seq_len * WINDOW / (now - start))
            start = now
    return rates[1:]  # the first window is warm-up


def trainer_loop(cfg: config_.Config, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_cfg = copy.deepcopy(cfg)
        run_cfg.run.dir = tmp
        run_cfg.checkpoint.dir = ""
        run_cfg.train.steps = steps
        run_cfg.train.log_every = WINDOW
        run_cfg.train.eval_every = 0
        run_cfg.checkpoint.every = 0
        run_cfg.checkpoint.resume = "never"
        run_cfg.log.progress = False
        train(run_cfg)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in records[1:-1]]  # drop warm-up and the final (eval) window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps < 3 * WINDOW:
        ap.error(f"--steps must be at least {3 * WINDOW}: the first (warm-up) and last (eval) windows of "
                 f"{WINDOW} steps are left out")
    cfg = config_.load(args.config, args.overrides)
    if cfg.dist.tune_malloc:
        host.tune_malloc()
    print(f"model dim {cfg.model.dim} x {cfg.model.n_layers} layers, seq {cfg.model.seq_len}, global batch "
          f"{cfg.train.global_batch} (micro {cfg.train.micro_batch}), {torch.get_num_threads()} threads, 1 process")
    bare, ours = [], []
    for r in range(args.rounds):
        b = bare_loop(cfg, args.steps)
        o = trainer_loop(cfg, args.steps)
        print(f"round {r + 1}: bare {statistics.median(b):8,.0f} tok/s | trainer {statistics.median(o):8,.0f} tok/s")
        bare += b
        ours += o
    ratio = statistics.median(ours) / statistics.median(bare)
    print(f"median tokens/s: bare loop {statistics.median(bare):,.0f}, trainer {statistics.median(ours):,.0f} "
          f"-> ratio {ratio:.3f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
