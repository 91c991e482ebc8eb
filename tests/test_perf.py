"""Speed options change speed, not results: activation checkpointing, compile and fused AdamW
give the losses of the plain run on CPU; on 2 gloo ranks the communication wait is measured.

The single-process runs call the real trainer in this process (one `import torch` for all of them);
the 2-rank run is a real torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMOKE, read_metrics, run_trainer

from trainer.config import load
from trainer.loop import build_optimizer, train

SHORT = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "train.warmup_steps=2"]
# compile is slow on 2 cores: a one-block model keeps it to one graph (forward + backward)
CPU = torch.device("cpu")
TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1"]


def train_here(run_dir: Path, overrides: list[str]) -> list[float]:
    """Run the trainer in this process; returns the loss of every step."""
    train(load(SMOKE, [f"run.dir={run_dir}", "log.progress=false", *overrides]))
    return [r["loss"] for _, r in sorted(read_metrics(run_dir).items())]


@pytest.fixture(scope="module")
def plain(cache_dir, tmp_path_factory) -> list[float]:
    return train_here(tmp_path_factory.mktemp("plain"), SHORT)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_gives_the_same_losses(plain, tmp_path, mode):
    assert train_here(tmp_path, [*SHORT, f"dist.activation_checkpointing={mode}"]) == pytest.approx(plain, abs=1e-5)


def test_fused_adamw_gives_the_same_losses(plain, tmp_path):
    """dist.fused_adamw=auto is the fused kernel on CPU too: the foreach implementation agrees."""
    foreach = train_here(tmp_path, [*SHORT, "dist.fused_adamw=foreach"])
    assert foreach == pytest.approx(plain, abs=1e-4)
    # step 1's loss comes before any optimizer step: identical; later ones moved by the optimizer
    assert foreach[0] == plain[0] and foreach[-1] < plain[0]
    def defaults(mode: str) -> dict:
        return build_optimizer(torch.nn.Linear(4, 4), load(SMOKE, [f"dist.fused_adamw={mode}"]), CPU).defaults

    assert defaults("auto")["fused"] and not defaults("foreach")["fused"]


def test_compile_gives_the_same_losses(cache_dir, tmp_path):
    eager = train_here(tmp_path / "eager", [*SHORT, *TINY])
    compiled = train_here(tmp_path / "compiled", [*SHORT, *TINY, "dist.compile=true"])
    assert compiled == pytest.approx(eager, abs=1e-4)


def test_two_ranks_report_communication_wait(cache_dir, tmp_path):
    proc = run_trainer(tmp_path, [*SHORT, "train.steps=6", "train.log_every=3"], nproc=2)
    metrics = read_metrics(tmp_path)
    for r in metrics.values():
        # FSDP2 all-gathers and reduce-scatters every step: some wait, less than the whole step
        assert 0 < r["comm_wait_s"] < r["step_time_s"]
        parts = sum(r[k] for k in ("data_wait_s", "fwd_bwd_s", "optim_s", "comm_wait_s"))
        assert parts <= r["step_time_s"] * 1.01
    assert "+ comm " in next(s for s in proc.stdout.splitlines() if "time per step:" in s)


def test_two_ranks_in_bf16_train_close_to_fp32(plain, tmp_path):
    """FSDP2 with bf16 parameters (the GPU configuration), here on 2 gloo ranks: it runs (the fp32 RoPE
    table reaches every block uncast) and its losses follow the fp32 run's."""
    run_trainer(tmp_path, [*SHORT, "dist.mixed_precision=bf16"], nproc=2)
    bf16 = [r["loss"] for _, r in sorted(read_metrics(tmp_path).items())]
    assert bf16 == pytest.approx(plain, abs=0.05) and bf16 != plain

def test_heap_on_huge_pages_after_malloc_tuning():
    """dist.tune_malloc: large freed blocks stay in the heap, and huge_pages_for_heap() backs the heap
    with 2 MiB pages (checked in a fresh process: AnonHugePages of its own mappings)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    code = """if True:
        import torch
        from trainer import host
        assert host.tune_malloc()
        buffers = [torch.ones(64 << 20, dtype=torch.uint8) for _ in range(4)]  # 256 MiB through malloc
        del buffers  # kept in the heap, not unmapped
        def huge_kb():
            line = next(l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:"))
            return int(line.split()[1])
        before = huge_kb()
        advised = host.huge_pages_for_heap()
        print(advised >> 20, before >> 10, huge_kb() >> 10)
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    advised_mb, before_mb, after_mb = map(int, out.stdout.split())
    assert advised_mb >= 250
    kernel = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    if kernel >= (6, 1):  # MADV_COLLAPSE converts pages already mapped
        assert after_mb >= 200 and after_mb > before_mb, (before_mb, after_mb)
