"""`profile.steps=[first, last]`: a torch.profiler trace of those training steps (inclusive), written
by every rank as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing) to
`run.dir/profile/rank{R}-steps{first}-{last}.json`.

The profiler records CPU ops (and CUDA kernels on GPU) with their shapes; it slows the profiled
steps down, so their tokens/s and MFU are not representative. Steps outside the range run as usual.
"""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    """Starts the profiler before step `first` (data fetch included) and exports it after step `last`.

    Call `maybe_start(next_step)` once before the loop, and `after_step(step)` at the end of each
    step. A run resumed inside the range profiles the steps it still runs; one resumed past it does
    nothing."""

    def __init__(self, steps: list[int], run_dir: str, rank: int, device: torch.device) -> None:
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir = Path(run_dir) / "profile"
        self.rank = rank
        self.device = device
        self.prof: torch.profiler.profile | None = None
        self.started_at = 0
        self.path: Path | None = None

    def maybe_start(self, next_step: int) -> None:
        if self.prof is not None or not self.first <= next_step <= self.last:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=False)
        self.prof.__enter__()
        self.started_at = next_step

    def after_step(self, step: int) -> Path | None:
        """Returns the trace path when this step ended the profiled range."""
        if self.prof is not None and step >= self.last:
            return self.stop()
        self.maybe_start(step + 1)
        return None

    def stop(self) -> Path | None:
        if self.prof is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank{self.rank}-steps{self.started_at}-{self.last}.json"
        self.prof.export_chrome_trace(str(self.path))
        self.prof = None
        return self.path
