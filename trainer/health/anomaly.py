"""The anomaly rule: whether a step's loss is far above its recent range, or its loss or gradient norm not
finite. A robust measure, so that one spike does not move the bar: the loss is anomalous when it is above
the median of the last `window` accepted steps by more than `threshold` times their spread (the median
absolute deviation, scaled to a standard deviation, and at least `RELATIVE_FLOOR` of the median: a loss
that barely moves has a spread near zero). Only upward: a loss that falls is no fault. Judged from a full
window on (the first `window` steps of a run are not, except for non-finite values). Its history is part
of the training state (`state_dict`), so a resumed run judges the same steps the same way."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal distribution, in standard deviations
RELATIVE_FLOOR = 0.01  # the spread is taken as at least this share of the median


@dataclass
class AnomalyRule:
    """The recent accepted steps' (global mean) losses and the bar they set."""

    window: int = 50  # 0: non-finite values only
    threshold: float = 10.0
    history: deque = field(default_factory=deque)

    def judge(self, loss: float, grad_norm: float) -> str:
        """Why the step is anomalous, or '' when it is not: a non-finite loss or gradient norm, or a loss far
        above the window's. (The gradient norm's own range is not judged: on clean runs it jumps far more
        often than the loss does, and a corruption that moves only the gradients is the spot checks'.)"""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"non-finite (loss {loss}, gradient norm {grad_norm})"
        if not self.window or len(self.history) < self.window:
            return ""
        recent = list(self.history)
        median = statistics.median(recent)
        mad = statistics.median(abs(x - median) for x in recent)
        spread = max(MAD_TO_SIGMA * mad, RELATIVE_FLOOR * abs(median))
        if loss > median + self.threshold * spread:
            return (f"loss {loss:.4g} is {(loss - median) / spread:.1f} spreads above the median {median:.4g} of the "
                    f"last {len(recent)} steps (spread {spread:.3g}, bar {self.threshold:g})")
        return ""

    def accept(self, loss: float) -> None:
        """A step taken: its loss joins the history (the oldest leaves a full window)."""
        if not self.window:
            return
        self.history.append(loss)
        while len(self.history) > self.window:
            self.history.popleft()

    def state_dict(self) -> dict:
        return {"window": self.window, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved history (the newest `window` of it: the window may have changed since)."""
        self.history = deque(float(h) for h in state.get("history", [])[-self.window:] if self.window)
