"""Step metrics: tokens/s, MFU, memory, where the step time goes (StepTimer, LogWindow); `metrics.jsonl`
and TensorBoard scalars in the run directory, the same scalars to W&B (trainer.observability.wandb_log); the progress
display on rank 0 (trainer.observability.display)."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.observability.display import ProgressDisplay
from trainer.observability.startup import remembered
from trainer.runtime.protocol import open_jsonl

if TYPE_CHECKING:
    from trainer.config import LogConfig, TrainConfig
    from trainer.observability.wandb_log import WandbLog

# Dense bf16 tensor-core peaks (FLOP/s) for GPUs we know; MFU is reported against these. Matched as
# substrings of the device name in this order, so the PCIe/NVL variants (lower clocks and power) come
# before the SXM parts, and L40S before L4.
GPU_PEAK_BF16 = {"H200 NVL": 835e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H200": 989e12, "H100": 989e12,
                 "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def nominal_gpu_peak(name: str) -> tuple[str, float]:
    """(table key, dense bf16 FLOP/s) for a device name such as 'NVIDIA H100 PCIe'; ('', 0.0) if unknown."""
    return next(((key, peak) for key, peak in GPU_PEAK_BF16.items() if key in name), ("", 0.0))


def measure_matmul_peak(seconds: float = 0.5, n: int = 1024, dtype: torch.dtype = torch.float32,
                        windows: int = 5, device: torch.device | str = "cpu") -> float:
    """Matmul FLOP/s of an n x n x n product on `device` (on a CPU with this process's current thread
    count): the practical ceiling that MFU is measured against (`scripts/bench.py`, and
    `scripts/gpu_check.sh` in bf16 on a GPU).

    The best of `windows` short windows: on a shared machine a neighbour's burst only ever slows a
    window down, so the fastest one is the closest to what the hardware does. On a GPU each window
    times whole batches of 10 products, synchronised, so the time is that of finished work."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    batch = 10 if cuda else 1

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):  # warm up (library initialisation, kernel selection, clocks)
        a @ b
    sync()
    best = 0.0
    for _ in range(windows):
        reps, start = 0, time.perf_counter()
        while reps == 0 or time.perf_counter() - start < seconds / windows:
            for _ in range(batch):
                a @ b
            sync()
            reps += batch
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> tuple[float, str]:
    """Per-device peak FLOP/s for MFU and where the number comes from."""
    if configured_tflops > 0:
        return configured_tflops * 1e12, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key, peak = nominal_gpu_peak(name)
        return (peak, f"{key} bf16 dense") if peak else (0.0, f"unknown GPU {name!r}: set log.peak_tflops")
    threads = torch.get_num_threads()  # measured at this launcher's first start, by each local rank
    key = f"peak-cpu-fp32-{threads}-threads-rank-{os.environ.get('LOCAL_RANK', '0')}"
    return remembered(key, measure_matmul_peak), f"measured fp32 matmul, {threads} thread(s)"


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class StepTimer:
    """Where the steps of a logging window spend their time, in seconds per step:
    `fwd_bwd_s` (forward + backward of all micro-batches), `optim_s` (clip + optimizer step + zero_grad, and
    the replays of a step that trainer.health checks)
    and, where a CommTimer measures it, `comm_wait_s` (blocking collectives, taken out of the two
    phases they happened in, so the parts do not overlap). Data wait is measured by the loop (LogWindow).

    CPU: the wall clock at phase boundaries. CUDA: events recorded at the boundaries (no
    synchronization); they are read in `window()` at a log step, after the loop has synchronized
    on the loss anyway, so timing adds no stall.
    """

    def __init__(self, device: torch.device, comm=None) -> None:
        self.cuda = device.type == "cuda"
        self.comm = comm
        self._marks: list = []  # per step: (start, after fwd_bwd, after optim) times or CUDA events
        self._comm: list[tuple[float, float]] = []  # per step: comm seconds in fwd_bwd, in optim
        self._comm_mark = 0.0
        self.totals = {"fwd_bwd_s": 0.0, "optim_s": 0.0, "comm_wait_s": 0.0, "steps": 0}

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks.append([self._now()])
        self._comm_mark = self.comm.total_s if self.comm else 0.0

    def mark(self) -> None:
        """End of a phase: the first call after start() ends fwd_bwd, the second ends optim."""
        self._marks[-1].append(self._now())
        if self.comm:
            now = self.comm.total_s
            if len(self._marks[-1]) == 2:
                self._comm.append((now - self._comm_mark, 0.0))
            else:
                self._comm[-1] = (self._comm[-1][0], now - self._comm_mark)
            self._comm_mark = now

    def window(self) -> dict[str, float]:
        """Per-step means over the steps since the last call (then forgotten)."""
        steps = [m for m in self._marks if len(m) == 3]
        n = max(len(steps), 1)
        if self.cuda and steps:
            steps[-1][2].synchronize()  # already complete: the loop synchronized on the loss
            fwd = sum(a.elapsed_time(b) for a, b, _ in steps) / 1e3
            opt = sum(b.elapsed_time(c) for _, b, c in steps) / 1e3
        else:
            fwd = sum(b - a for a, b, _ in steps)
            opt = sum(c - b for _, b, c in steps)
        comm_fwd, comm_opt = sum(c[0] for c in self._comm), sum(c[1] for c in self._comm)
        out = {"fwd_bwd_s": (fwd - comm_fwd) / n, "optim_s": (opt - comm_opt) / n}
        if self.comm:
            out["comm_wait_s"] = (comm_fwd + comm_opt) / n
        self.totals["fwd_bwd_s"] += fwd - comm_fwd
        self.totals["optim_s"] += opt - comm_opt
        self.totals["comm_wait_s"] += comm_fwd + comm_opt
        self.totals["steps"] += len(steps)
        self._marks, self._comm = [], []
        return out


BREAKDOWN = ("data_wait_s", "fwd_bwd_s", "optim_s", "comm_wait_s", "other_s")


def with_other(parts: dict[str, float]) -> dict[str, float]:
    """`parts` (per-step seconds with `step_time_s`) plus `other_s`: what the measured phases leave of
    the step (eval, checkpoint saves, logging, Python between the phases)."""
    measured = sum(parts.get(k) or 0.0 for k in BREAKDOWN if k != "other_s")
    return {**parts, "other_s": max(parts["step_time_s"] - measured, 0.0)}


@dataclass
class ClosedWindow:
    """A log window as this rank saw it; `row` is what the ranks exchange: [loss, data wait per step,
    *phases per step]."""

    phases: list[str]  # the StepTimer's phases in `row`, after loss and data wait
    row: list[float]
    steps: int
    elapsed_s: float  # this rank's wall time of the window

    def means(self, rows: list[list[float]]) -> dict:
        """With every rank's row: {loss, step_time_s, data_wait_s, fwd_bwd_s, optim_s[, comm_wait_s],
        other_s} per step, averaged over ranks (step_time_s is this rank's), and `rank_work_s`: each
        rank's own work per step (data wait + forward/backward + optimizer, without waiting in
        collectives where comm_wait_s is measured), by rank."""
        loss, wait, *means = (sum(column) / len(rows) for column in zip(*rows, strict=True))
        out = {"loss": loss, "step_time_s": self.elapsed_s / self.steps, "data_wait_s": wait,
               **dict(zip(self.phases, means, strict=True))}
        own = [i for i, key in enumerate(self.phases, start=2) if key in ("fwd_bwd_s", "optim_s")]
        work = [row[1] + sum(row[i] for i in own) for row in rows]
        return {**with_other(out), "rank_work_s": [round(w, 6) for w in work]}


class LogWindow:
    """The steps one metrics.jsonl record summarizes (those since the previous record): loss, data
    wait and wall time, with the StepTimer's phases."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self.data_wait_total = 0.0  # this rank's, over the whole run
        self.restart()

    def restart(self) -> None:
        """A new window starts now."""
        self.loss_sum, self.steps, self.data_wait, self.started = 0.0, 0, 0.0, time.perf_counter()

    def add(self, loss: float, data_wait: float) -> None:
        self.loss_sum += loss
        self.data_wait += data_wait
        self.steps += 1

    def close(self) -> ClosedWindow:
        """This rank's numbers of the window (it goes on until `restart()`)."""
        elapsed = time.perf_counter() - self.started
        parts = self.timer.window()  # per-step seconds of this rank
        self.data_wait_total += self.data_wait
        return ClosedWindow(list(parts), [self.loss_sum / self.steps, self.data_wait / self.steps, *parts.values()],
                            self.steps, elapsed)


@dataclass
class RecordDraft:
    """A closed log window and the rest of its metrics.jsonl record (lr, grad norm, ..., wall time),
    waiting for the other ranks' numbers. Plain data: a memory snapshot carries the drafts whose records
    were not written yet, so that a resume from it writes them (`restored`: came from a snapshot)."""

    step: int
    window: ClosedWindow
    fields: dict
    first: bool  # the attempt's first window (its one-off costs differ between ranks)
    restored: bool = False

    def to_json(self) -> dict:
        w = self.window
        return {"step": self.step, "phases": w.phases, "row": w.row, "steps": w.steps, "elapsed_s": w.elapsed_s,
                "fields": self.fields, "first": self.first}

    @classmethod
    def from_json(cls, d: dict) -> RecordDraft:
        return cls(d["step"], ClosedWindow(d["phases"], d["row"], d["steps"], d["elapsed_s"]), d["fields"],
                   d["first"], restored=True)


class PendingRecords:
    """Closed log windows whose records wait for the other ranks' numbers. `send()` (collective) starts
    one asynchronous gather of every window queued since the previous one; `receive()` waits for the
    gather in flight and writes each window's record (`write(draft, means)`, in step order). The loop
    decides when, at the same steps on every rank: a gather per log step cost more than the rest of a
    small step's bookkeeping."""

    def __init__(self, gather: Callable[[list[float]], Callable[[], list[list[float]]]],
                 write: Callable[[RecordDraft, dict], None], restored: list[RecordDraft] = ()) -> None:
        self.gather, self.write = gather, write
        self.queued: list[RecordDraft] = list(restored)
        self.in_flight: tuple[list[RecordDraft], Callable] | None = None

    def add(self, draft: RecordDraft) -> None:
        self.queued.append(draft)

    def unwritten(self) -> list[RecordDraft]:
        """Every draft whose record is not written yet, in step order (those in flight first)."""
        return [*(self.in_flight[0] if self.in_flight else []), *self.queued]

    def send(self) -> None:
        if self.queued:
            batch, self.queued = self.queued, []
            self.in_flight = (batch, self.gather([value for draft in batch for value in draft.window.row]))

    def receive(self) -> None:
        if self.in_flight is None:
            return
        (batch, wait), self.in_flight = self.in_flight, None
        rows, start = wait(), 0
        for draft in batch:
            end = start + len(draft.window.row)
            self.write(draft, draft.window.means([row[start:end] for row in rows]))
            start = end


def last_logged_step(path: Path) -> int:
    """The step of the last complete record in a metrics.jsonl (0 without one)."""
    try:
        with open(path, "rb") as f:
            start = max(f.seek(0, os.SEEK_END) - 65536, 0)
            f.seek(start)
            lines = f.read().split(b"\n")
    except OSError:
        return 0
    for line in reversed(lines[1:] if start else lines):  # (a line cut by the seek is not one)
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


# metrics.jsonl key -> TensorBoard tag (and W&B key)
TB_TAGS = {
    "loss": "loss/train", "eval_loss": "loss/eval", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "mem_mb": "perf/mem_mb",
    "step_time_s": "time/step_s", **{k: f"time/{k}" for k in BREAKDOWN},
}


def format_breakdown(parts: dict[str, float]) -> str:
    """`step 0.512s = data 0.001 + fwd/bwd 0.420 + optim 0.051 + comm 0.030 + other 0.010`."""
    names = {"data_wait_s": "data", "fwd_bwd_s": "fwd/bwd", "optim_s": "optim", "comm_wait_s": "comm",
             "other_s": "other"}
    total = parts.get("step_time_s", sum(parts.get(k, 0.0) for k in BREAKDOWN))
    shown = [f"{names[k]} {parts[k]:.3f} ({100 * parts[k] / total:.0f}%)" if total else f"{names[k]} {parts[k]:.3f}"
             for k in BREAKDOWN if parts.get(k) is not None]
    return f"step {total:.3f}s = " + " + ".join(shown)


class MetricsLog:
    """Rank 0's view of the run: appends to metrics.jsonl (and TensorBoard with log.tensorboard, W&B with
    log.wandb) and drives the progress display (trainer.observability.display)."""

    def __init__(self, run_dir: str, train: TrainConfig, settings: LogConfig, start_step: int, enabled: bool,
                 wandb: WandbLog | None = None) -> None:
        self.enabled = enabled
        self.wandb = wandb
        self.log_every, self.eval_every, self.total_steps = train.log_every, train.eval_every, train.steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None  # opened at the first record, kept open (one write per record)
        self.tb = None
        if enabled and settings.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            # A resumed run redoes the steps after its checkpoint: TensorBoard hides what an earlier attempt
            # logged from that step on (purge_step; from step 1 when it starts over), so each curve has each
            # step once.
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1)
        self.display = ProgressDisplay(total_steps=train.steps, start_step=start_step, progress=settings.progress,
                                       shown=enabled)
        # What an earlier attempt wrote last: records restored from a memory snapshot up to it are on disk.
        self.logged_through = last_logged_step(self.path) if enabled else 0

    def should_log(self, step: int) -> bool:
        """Every `log_every` steps, at every eval step and at the last step (every rank: collective)."""
        return (step % self.log_every == 0 or step == self.total_steps
                or bool(self.eval_every and step % self.eval_every == 0))

    def step(self, step: int) -> None:
        self.display.step(step)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open_jsonl(self.path)
        self._file.write(json.dumps(record).encode() + b"\n")
        scalars = {tag: record[key] for key, tag in TB_TAGS.items() if isinstance(record.get(key), (int, float))}
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, record["step"], walltime=record.get("time"))
        if self.wandb is not None:
            self.wandb.log(scalars, record["step"])
        self.display.show(record)

    def close(self, clean: bool = True) -> None:
        """`clean`: the run ended without an error (W&B marks the run finished, else failed)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.display.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close(clean)
