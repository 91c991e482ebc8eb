"""The progress display on rank 0 (`log.progress`): a tqdm bar on a terminal, which shows the last logged
record beside it; elsewhere one printed line per logged record, with the time left at its pace."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def summary(record: dict) -> str:
    """`loss 3.2100 | eval 3.3000 | lr 3.00e-04 | 12,345 tok/s | mfu 41.0%` (eval where the record has it)."""
    parts = [f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s", f"mfu {100 * record['mfu']:.1f}%"]
    return " | ".join(parts)


class ProgressDisplay:
    """The steps of this attempt, `start_step` to `total_steps`; shows nothing without `progress`
    (log.progress), nor on a rank that is not `shown`."""

    def __init__(self, total_steps: int, start_step: int, progress: bool, shown: bool) -> None:
        self.progress, self.total_steps, self.start_step = progress, total_steps, start_step
        self.bar = None
        if shown and progress and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.started = time.perf_counter()

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def show(self, record: dict) -> None:
        """A logged record: beside the bar, or as a printed line with the time left."""
        line = summary(record)
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)
        elif self.progress:
            done = record["step"] - self.start_step
            elapsed = time.perf_counter() - self.started
            eta = elapsed / max(done, 1) * (self.total_steps - record["step"])
            print(f"step {record['step']:>6}/{self.total_steps} | {line} | eta {eta:5.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
