"""Step metrics: tokens/s, MFU, memory; `metrics.jsonl` in the run directory; the progress display
and the end-of-run summary on rank 0."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

# Dense bf16 tensor-core peaks (FLOP/s) for GPUs we know; MFU is reported against these.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def measure_cpu_peak(seconds: float = 0.3, n: int = 1024) -> float:
    """fp32 matmul FLOP/s of this process with its current thread count (the practical CPU ceiling)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> tuple[float, str]:
    """Per-device peak FLOP/s for MFU and where the number comes from."""
    if configured_tflops > 0:
        return configured_tflops * 1e12, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak, f"{key} bf16 dense"
        return 0.0, f"unknown GPU {name!r}: set log.peak_tflops"
    return measure_cpu_peak(), f"measured fp32 matmul, {torch.get_num_threads()} thread(s)"


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricsLog:
    """Rank 0's view of the run: appends to metrics.jsonl and drives the progress display."""

    def __init__(self, run_dir: str, total_steps: int, start_step: int, enabled: bool, progress: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.interactive = progress and sys.stderr.isatty()
        self.bar = None
        if enabled and self.interactive:
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.progress = progress
        self.total_steps = total_steps
        self.started = time.perf_counter()
        self.start_step = start_step

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        summary = self._format(record)
        if self.bar is not None:
            self.bar.set_postfix_str(summary, refresh=False)
        elif self.progress:
            done = record["step"] - self.start_step
            elapsed = time.perf_counter() - self.started
            eta = elapsed / max(done, 1) * (self.total_steps - record["step"])
            print(f"step {record['step']:>6}/{self.total_steps} | {summary} | eta {eta:5.0f}s", flush=True)

    @staticmethod
    def _format(r: dict) -> str:
        parts = [f"loss {r['loss']:.4f}"]
        if "eval_loss" in r:
            parts.append(f"eval {r['eval_loss']:.4f}")
        parts += [f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:,.0f} tok/s", f"mfu {100 * r['mfu']:.1f}%"]
        return " | ".join(parts)

    def event(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
