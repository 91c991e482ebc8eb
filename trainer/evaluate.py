"""The held-out loss and when to measure it: every `train.eval_every` steps and at the last step,
unless the run holds out no samples (`data.val_fraction=0`) or `train.eval_batches=0`."""

from __future__ import annotations

import torch

from data.stream import TokenStream
from trainer.config import Config
from trainer.distributed import parallel


class Evaluator:
    def __init__(self, stream: TokenStream, cfg: Config, info: parallel.DistInfo, micro_batch: int) -> None:
        self.stream, self.cfg, self.info, self.micro_batch = stream, cfg, info, micro_batch
        self.enabled = cfg.train.eval_batches > 0 and stream.n_val > 0
        self.why_not = "" if self.enabled else (
            "data.val_fraction=0 holds out no samples" if stream.n_val == 0 else "train.eval_batches=0")

    def due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return self.enabled and (bool(every and step % every == 0) or step == self.cfg.train.steps)

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> float:
        """Mean held-out loss over all targets (never masked, so runs with and without the mask compare);
        collective."""
        cfg, info, stream = self.cfg, self.info, self.stream
        model.eval()
        total = 0.0
        for j in range(cfg.train.eval_batches):
            batch = stream.val_batch(j).to(info.device)
            for micro in batch.split(self.micro_batch):
                positions = stream.positions(micro) if cfg.data.reset_positions else None
                with parallel.autocast(cfg.dist, info):
                    total += model(micro[:, :-1], positions, targets=micro[:, 1:]).item() * len(micro)
        model.train()
        n = cfg.train.eval_batches * stream.geometry.local_batch
        return parallel.all_reduce_mean([total / n], info)[0]
