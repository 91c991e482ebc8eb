"""The optimizer and its schedule: AdamW with weight decay on matrices only, linear warmup then cosine
decay of the learning rate."""

from __future__ import annotations

import math

import torch

from trainer.config import Config
from trainer.distributed import parallel


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr over warmup_steps, then cosine decay to train.min_lr at train.steps."""
    t = cfg.train
    if step <= t.warmup_steps:
        return t.lr * step / max(t.warmup_steps, 1)
    progress = (step - t.warmup_steps) / max(t.steps - t.warmup_steps, 1)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms); the fused kernel per dist.fused_adamw."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": True} if parallel.use_fused_adamw(cfg.dist, device) else (
        {"foreach": True} if cfg.dist.fused_adamw == "foreach" else {})
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), **impl)
