"""Performance report of this machine and the trainer, in one run:

  1. matmul peak measured here (fp32 and bf16 on CPU per thread count; bf16 on GPU) next to the
     nominal peak of known GPUs;
  2. the trainer's tokens/s against a bare PyTorch loop on the same model and batch (goal >= 0.95);
  3. MFU of the config's model at its sequence length against the measured peak (CPU goal >= 70%);
  4. 1 rank vs 2 ranks (real torchrun, gloo, 1 thread each) and 1 rank x 2 threads on the same cores;
  5. the effect of the speed options: compile, activation checkpointing (selective,
     full) and the malloc tuning (dist.tune_malloc), each against the plain run;
  6. where the step time goes (data wait / forward+backward / optimizer / comm wait);
  6b. the memory tier's cost: 2 ranks with checkpoint.memory_every=1 (every step snapshotted to
     memory) against the same runs without it, alternating (goal >= 0.97 of the tokens/s);
  6c. the step checks' cost (trainer.health): 2 ranks with fault.verify_every=0 and 1 (every step
     replayed), alternating, which prices one replay; the check's own work on a step it does not replay,
     timed in this process; the default's share of the step time (goal <= 1%);
  7. on CPU, the peer the MFU goal comes from: a nanoGPT-style GPT-2 loop (`scripts/bench_peer.py`)
     at the sizes of the goal (4 layers x 256 and 6 x 384, batch 8, seq 256, vocab 8192), 1 thread,
     MFU by its own FLOP count against the peak measured around it;
  8. the goals, each met or not in this run.

    python scripts/bench.py [--quick] [--config configs/default.yaml] [--skip compile,ranks,...] [key=value ...]

Every trainer run is a fresh process (`python -m trainer`, or torchrun for 2 ranks) with eval and
checkpoints pushed to the last window, which is left out with the first (warm-up, compile) one;
tokens/s is the median over the remaining logging windows. MFU here is recomputed against the
matmul peak this script measures (best of several windows, same thread count) right before and
right after each run, the higher of the two: on a VM the clock, and with it the peak, drifts by
10-20% within minutes, so a peak measured once at the start can be far from the one the run saw.
On a shared machine, compare numbers from one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures is not installed

import bench_step  # a sibling script: scripts/ is on sys.path when run as `python scripts/bench.py`
import torch

from tests.fixtures import free_port
from trainer import config as config_
from trainer.checkpoint import memory as memory_tier
from trainer.model.transformer import Transformer
from trainer.observability.metrics import (
    BREAKDOWN,
    GPU_PEAK_BF16,
    format_breakdown,
    measure_matmul_peak,
    nominal_gpu_peak,
)
from trainer.runtime import host

REPO = Path(__file__).resolve().parents[1]


def cpu_peak(threads: int, dtype: torch.dtype = torch.float32, seconds: float = 1.0) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return max(measure_matmul_peak(seconds / 2, n, dtype) for n in (1024, 2048))
    finally:
        torch.set_num_threads(before)


def run_trainer(config: str, overrides: list[str], steps: int, window: int, nproc: int = 1, threads: int = 1,
                timeout: float = 900) -> dict:
    """One trainer run in fresh processes; median tokens/s over the windows between the first and last."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [config, f"run.dir={tmp}", f"train.steps={steps}", f"train.log_every={window}",
                "train.eval_every=0", "train.eval_batches=1", "checkpoint.every=0", "checkpoint.resume=never",
                "log.progress=false", *overrides]
        if nproc == 1:
            cmd = [sys.executable, "-m", "trainer", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", "-m", "trainer", *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"trainer failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:-1] or records
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady), "windows": len(steady)}
    for key in (*BREAKDOWN, "step_time_s"):
        values = [r[key] for r in steady if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (about 3-5 minutes on 2 cores)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads for the in-process trainer/bare comparison (default: all cores)")
    ap.add_argument("--skip", default="",
                    help="comma-separated parts to skip: ratio,ranks,compile,ac,malloc,memory,health,peer")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. model.n_layers=6")
    return ap.parse_args()


class Bench:
    """One benchmark session: the config, the run lengths, the peaks; each section prints its part."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.skip = args, set(filter(None, args.skip.split(",")))
        self.steps, self.window, self.rounds = (20, 5, 2) if args.quick else (50, 10, 3)
        self.cfg = config_.load(REPO / args.config, args.overrides)
        self.config = str(REPO / args.config)
        self.flops_per_token = Transformer(self.cfg.model).flops_per_token()
        self.cores = os.cpu_count() or 1
        self.cuda = torch.cuda.is_available()
        self.gpu_peak = 0.0
        self.results: dict[str, dict] = {}

    def header(self) -> None:
        cfg, args = self.cfg, self.args
        print(f"# rekindle bench ({'quick' if args.quick else 'full'}) | {args.config} {' '.join(args.overrides)}")
        print(f"model: dim {cfg.model.dim} x {cfg.model.n_layers} layers, seq {cfg.model.seq_len}, vocab "
              f"{cfg.model.vocab_size}, {self.flops_per_token / 1e6:.1f} MFLOPs/token | global batch "
              f"{cfg.train.global_batch} (micro {cfg.train.micro_batch}) | torch {torch.__version__} | "
              f"{self.cores} CPU(s)" + (f" | GPU {torch.cuda.get_device_name(0)}" if self.cuda else ""))

    def peaks(self) -> None:
        """1. matmul peaks, CPU per thread count and the GPU's, next to the nominal GPU peaks."""
        print("\n## matmul peak (best of several windows)")
        for threads in sorted({1, self.cores, self.args.threads or self.cores}):
            fp32, bf16 = cpu_peak(threads), cpu_peak(threads, torch.bfloat16, 0.6)
            print(f"CPU {threads} thread(s): fp32 {fp32 / 1e9:8,.1f} GFLOP/s | bf16 {bf16 / 1e9:8,.1f} GFLOP/s")
        if self.cuda:
            self.gpu_peak = measure_matmul_peak(1.0, 8192, torch.bfloat16, device="cuda")
            name = torch.cuda.get_device_name(0)
            nominal = nominal_gpu_peak(name)[1]
            print(f"GPU bf16 8192^3: {self.gpu_peak / 1e12:,.1f} TFLOP/s measured | nominal dense bf16 "
                  f"{nominal / 1e12:,.0f} TFLOP/s ({100 * self.gpu_peak / nominal:.0f}% of nominal)" if nominal else
                  f"GPU bf16 8192^3: {self.gpu_peak / 1e12:,.1f} TFLOP/s measured (no nominal peak known for {name})")
        print("nominal dense bf16 peaks (MFU on a GPU is reported against these): "
              + ", ".join(f"{k} {v / 1e12:.0f}" for k, v in GPU_PEAK_BF16.items()) + " TFLOP/s")

    def peak_around(self, run, threads: int):
        """run() with the peak measured right before and right after it (CPU; on a GPU the measured
        bf16 peak): returns (run's result, the higher of the two peaks)."""
        if self.gpu_peak:
            return run(), self.gpu_peak
        before = cpu_peak(threads)
        result = run()
        return result, max(before, cpu_peak(threads))

    def mfu(self, tps: float, peak: float, ranks: int = 1) -> float:
        return self.flops_per_token * tps / (peak * ranks)

    def trainer_row(self, label: str, overrides: list[str], threads: int = 1, nproc: int = 1,
                    base: float | None = None) -> dict:
        r, peak = self.peak_around(lambda: run_trainer(self.config, overrides, self.steps, self.window, nproc=nproc,
                                                       threads=threads), threads)
        r["bench_mfu"] = self.mfu(r["tokens_per_s"], peak, nproc)
        r["bench_peak"] = peak
        rel = f" | x{r['tokens_per_s'] / base:.2f}" if base else ""
        what = "GPU bf16 peak" if self.gpu_peak else f"{threads}-thread fp32 peak {peak / 1e9:,.0f} GFLOP/s"
        print(f"{label:<34} {r['tokens_per_s']:9,.0f} tok/s | MFU {100 * r['bench_mfu']:5.1f}% "
              f"(vs {what}{' x ' + str(nproc) if nproc > 1 else ''}){rel}")
        return r

    def trainer_vs_bare(self) -> float | None:
        """2. in this process, same threads; the bare loop gets the same allocator settings."""
        if "ratio" in self.skip:
            return None
        torch.set_num_threads(self.args.threads or self.cores)
        print(f"\n## trainer vs bare PyTorch loop (1 process, {torch.get_num_threads()} thread(s), "
              f"{self.steps * 2} steps x {self.rounds} round(s))")
        host.tune_malloc()
        bench_step.WINDOW = self.window
        bare, ours = [], []

        def rounds_of_both() -> None:
            for r in range(self.rounds):
                b = bench_step.bare_loop(self.cfg, self.steps * 2)
                o = bench_step.trainer_loop(self.cfg, self.steps * 2)
                print(f"round {r + 1}: bare {statistics.median(b):8,.0f} tok/s | "
                      f"trainer {statistics.median(o):8,.0f} tok/s")
                bare.extend(b)
                ours.extend(o)

        _, peak = self.peak_around(rounds_of_both, torch.get_num_threads())
        ratio = statistics.median(ours) / statistics.median(bare)
        print(f"ratio trainer/bare {ratio:.3f} (goal >= 0.95) | bare-loop MFU "
              f"{100 * self.mfu(statistics.median(bare), peak):.1f}%")
        return ratio

    def ranks(self) -> None:
        """3-4. MFU of 1 rank, 1 rank on every core, 2 ranks."""
        print(f"\n## trainer runs ({self.steps} steps, median over windows of {self.window}; MFU vs the peak "
              "measured around each run)")
        base1 = self.results["1x1"] = self.trainer_row("1 rank x 1 thread", self.args.overrides)
        if self.cuda and torch.cuda.device_count() < 2:
            self.skip.add("ranks")  # one GPU: no second rank to compare with
        if self.cores > 1 and not self.cuda:
            self.results["1xN"] = self.trainer_row(f"1 rank x {self.cores} threads", self.args.overrides,
                                                   threads=self.cores, base=base1["tokens_per_s"])
        if (self.cores > 1 or self.cuda) and "ranks" not in self.skip:
            r2 = self.results["2x1"] = self.trainer_row(
                f"2 ranks x 1 thread (FSDP2, {'nccl' if self.cuda else 'gloo'})", self.args.overrides, nproc=2,
                base=base1["tokens_per_s"])
            print(f"2-rank scaling efficiency {100 * r2['tokens_per_s'] / (2 * base1['tokens_per_s']):.0f}% "
                  f"(tokens/s of 2 ranks / twice 1 rank)")

    def options(self) -> None:
        """5-6. the speed options, each against the plain 1 x 1 run; then where the step time goes."""
        options = []
        if "malloc" not in self.skip:
            options.append(("dist.tune_malloc=false", ["dist.tune_malloc=false"]))
        if "ac" not in self.skip:
            options += [(f"activation_checkpointing={m}", [f"dist.activation_checkpointing={m}"])
                        for m in ("selective", "full")]
        if "compile" not in self.skip:
            options.append(("dist.compile=true", ["dist.compile=true"]))
        if options:
            print("\n## speed options (1 rank x 1 thread; x = tokens/s relative to the plain run above)")
        for label, extra in options:
            self.results[label] = self.trainer_row(label, [*self.args.overrides, *extra],
                                                   base=self.results["1x1"]["tokens_per_s"])
        print("\n## where the step time goes (median per step)")
        for key, r in self.results.items():
            if "fwd_bwd_s" in r:
                print(f"{key:<34} {format_breakdown(r)}")

    def memory_tier(self) -> None:
        """6b. 2 ranks, memory tier on (every step) and off, alternating; tokens/s ratio."""
        if "memory" in self.skip or (self.cores < 2 and not self.cuda):
            return
        print(f"\n## memory tier (2 ranks x 1 thread, checkpoint.memory_every=1 vs off, {self.rounds} round(s) "
              "alternating; the snapshots go where they go by default, a temporary directory under "
              f"{os.path.dirname(memory_tier.default_dir())})")
        on, off, parent = [], [], os.path.dirname(memory_tier.default_dir())
        for i in range(self.rounds):
            with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=parent) as shm:
                modes = (("off", ["checkpoint.memory_every=0"], off),
                         ("on", ["checkpoint.memory_every=1", f"checkpoint.memory_dir={shm}"], on))
                for label, extra, into in modes:
                    r = run_trainer(self.config, [*self.args.overrides, *extra], self.steps, self.window, nproc=2)
                    into.append(r["tokens_per_s"])
                    print(f"round {i + 1} memory tier {label:<3} {r['tokens_per_s']:9,.0f} tok/s")
        ratio = statistics.median(on) / statistics.median(off)
        self.results["memory"] = {"ratio": ratio}
        print(f"memory tier on/off: x{ratio:.3f} tokens/s (goal >= 0.97)")

    def health(self) -> None:
        """6c. 2 ranks, no spot checks and one on every step, alternating: what a replay costs; the check's own
        work on a step it does not replay (the anomaly rule, the RNG state kept), timed here. A run shorter than
        the default interval would replay nothing, and the default's cost (a replay per interval) is below
        this machine's run-to-run noise: it is computed from the two."""
        if "health" in self.skip or (self.cores < 2 and not self.cuda):
            return
        default = self.cfg.fault.verify_every
        print(f"\n## step checks (2 ranks x 1 thread, fault.verify_every=0 vs 1, {self.rounds} round(s) alternating)")
        got: dict[int, list[float]] = {0: [], 1: []}
        steps = {0: [], 1: []}
        for i in range(self.rounds):
            for every in (0, 1):
                r = run_trainer(self.config, [*self.args.overrides, f"fault.verify_every={every}"], self.steps,
                                self.window, nproc=2)
                got[every].append(r["tokens_per_s"])
                steps[every].append(r["step_time_s"])
                print(f"round {i + 1} verify_every={every} {r['tokens_per_s']:9,.0f} tok/s")
        off, every = statistics.median(got[0]), statistics.median(got[1])
        replay = off / every - 1  # one replay, as a share of a step
        own = check_overhead_s() / statistics.median(steps[0])
        share = own + (replay / default if default else 0.0)
        self.results["health"] = {"share": share}
        print(f"one replay costs {100 * replay:.0f}% of a step; the check's own work on a step it does not replay "
              f"{100 * own:.3f}% of a step; at verify_every={default}: {100 * share:.2f}% of the step time "
              "(goal <= 1%)")

    def peer(self) -> dict:
        """7. the peer of the CPU goal, in a fresh process with glibc's default malloc (as nanoGPT runs)."""
        peers: dict = {}
        if self.cuda or "peer" in self.skip:
            return peers
        print("\n## peer: nanoGPT-style GPT-2 loop (scripts/bench_peer.py: eager fp32, batch 8, seq 256, vocab "
              "8192, 1 thread; where the goal was set, nanoGPT's loop read 67% at 4 x 256 and 78% at 6 x 384)")
        for layers, dim in ((4, 256), (6, 384)):
            cmd = [sys.executable, str(REPO / "scripts" / "bench_peer.py"), f"--layers={layers}", f"--dim={dim}",
                   f"--steps={self.steps // 2}"]
            proc, peak = self.peak_around(functools.partial(subprocess.run, cmd, capture_output=True, text=True,
                                                            timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1")),
                                          1)
            if proc.returncode != 0:
                raise RuntimeError(f"peer benchmark failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            peers[(layers, dim)] = r["flops_per_token"] * r["tokens_per_s"] / peak
            print(f"{f'{layers} layers x {dim}':<34} {r['tokens_per_s']:9,.0f} tok/s | MFU "
                  f"{100 * peers[(layers, dim)]:5.1f}% (vs 1-thread fp32 peak {peak / 1e9:,.0f} GFLOP/s)")
        return peers


def check_overhead_s(calls: int = 20000) -> float:
    """Seconds per step of a step check that replays nothing (trainer.health: the anomaly rule over a full
    window, the RNG state kept for a replay, the test hooks asked), timed in this process."""
    from trainer.health.anomaly import AnomalyRule
    from trainer.health.check import Computed, StepHealth
    from trainer.health.inject import corrupt_gradients

    health = StepHealth(AnomalyRule(50, 10.0), verify_every=10 * calls)
    for i in range(50):
        health.rule.accept(3.0 + 0.01 * (i % 7))
    loss = torch.zeros(())
    started = time.perf_counter()
    for step in range(1, calls + 1):
        torch.get_rng_state()
        corrupt_gradients(None, 0, step, 0)  # (its hooks unset: two environment lookups)
        health.check(step, None, Computed(loss, 1.0, 3.0 + 0.01 * (step % 7)), None)
    return (time.perf_counter() - started) / calls


def main() -> None:
    bench = Bench(parse_args())
    bench.header()
    bench.peaks()
    ratio = bench.trainer_vs_bare()
    bench.ranks()
    bench.options()
    bench.memory_tier()
    bench.health()
    peers = bench.peer()
    print_goals(bench.args.config, ratio, bench.results, peers, bench.cuda)


def print_goals(config: str, ratio: float | None, results: dict, peers: dict, cuda: bool) -> None:
    """The issue's goals against this run's numbers, one line each (a part that was skipped is left out)."""
    print("\n## goals")
    if ratio is not None:
        print(f"trainer/bare tokens/s {ratio:.3f} (goal >= 0.95): {'met' if ratio >= 0.95 else 'NOT met'}")
    if "memory" in results:
        got = results["memory"]["ratio"]
        print(f"memory tier on/off tokens/s {got:.3f} (goal >= 0.97): {'met' if got >= 0.97 else 'NOT met'}")
    if "health" in results:
        got = results["health"]["share"]
        print(f"step checks at their default: {100 * got:.2f}% of the step time (goal <= 1%): "
              f"{'met' if got <= 0.01 else 'NOT met'}")
    if cuda:
        print("GPU MFU goal (>= 45%, configs/llama-1b.yaml, bf16 + compile): run scripts/gpu_check.sh")
        return
    runs = [(label, results[key]) for label, key in (("compiled", "dist.compile=true"), ("eager", "1x1"))
            if key in results]
    if not runs:
        return
    best = max(r["bench_mfu"] for _, r in runs)
    line = ", ".join(f"{100 * r['bench_mfu']:.1f}% {label} (peak {r['bench_peak'] / 1e9:,.0f} GFLOP/s)"
                     for label, r in runs)
    scope = "" if Path(config).name == "default.yaml" else f" [the goal is set for configs/default.yaml, not {config}]"
    print(f"CPU MFU, 1 rank x 1 thread: {line}; goal >= 70%: {'met' if best >= 0.70 else 'NOT met'} at this "
          f"clock{scope}")
    if (4, 256) in peers:
        print(f"the goal's peer, a nanoGPT-style loop at 4 x 256: {100 * peers[(4, 256)]:.1f}% here "
              f"(67% on the AVX2 machine the goal was set on); rekindle's best: "
              f"{100 * (best - peers[(4, 256)]):+.1f} points against it")


if __name__ == "__main__":
    main()
