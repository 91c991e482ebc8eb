"""Speed options on real processes: on 2 gloo ranks under torchrun the communication wait is measured
and FSDP2 in bf16 trains close to the fp32 run; malloc tuning puts the heap on huge pages (in a fresh
process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, SHORT, read_metrics, run_trainer


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
        from trainer.runtime import host
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
