"""Observability parts in this process: profile.steps validation, the nominal MFU peak of known GPUs,
the measured matmul peak and the cost arithmetic. (A real run's breakdown, summary, TensorBoard
scalars, profiler trace and plot: tests/integration/test_observed_run.py.)"""

from __future__ import annotations

import math
import time

import pytest
import torch

from tests.helpers import REPO
from trainer.config import ConfigError, load
from trainer.observability.cost import cost_report
from trainer.observability.metrics import measure_matmul_peak, nominal_gpu_peak


def test_profile_steps_are_validated():
    with pytest.raises(ConfigError, match="profile.steps"):
        load(REPO / "configs" / "smoke.yaml", ["profile.steps=[5,2]"])
    with pytest.raises(ConfigError, match="profile.steps"):
        load(REPO / "configs" / "smoke.yaml", ["profile.steps=[0,2]"])
    assert load(REPO / "configs" / "smoke.yaml", ["profile.steps=[2,2]"]).profile.steps == [2, 2]


@pytest.mark.parametrize("name, key, tflops", [
    ("NVIDIA H200", "H200", 989), ("NVIDIA H100 80GB HBM3", "H100", 989), ("NVIDIA H100 PCIe", "H100 PCIe", 756),
    ("NVIDIA H100 NVL", "H100 NVL", 835), ("NVIDIA H200 NVL", "H200 NVL", 835), ("NVIDIA L4", "L4", 121),
    ("NVIDIA L40S", "L40S", 362), ("NVIDIA A100-SXM4-80GB", "A100", 312), ("Tesla T4", "", 0)])
def test_mfu_peak_of_known_gpus_by_device_name(name, key, tflops):
    assert nominal_gpu_peak(name) == (key, tflops * 1e12)


def test_measured_matmul_peak_counts_the_flops_of_the_products_it_times():
    """The peak MFU is measured against: 2 n^3 FLOPs per n x n product, on the device asked for.
    Checked against a plain timing of the same products: rounds of one and the other interleaved, the
    best of each compared (a factor-3 band), so that a neighbour's burst (the other test worker) slows
    both sides alike). Up to three tries: a neighbour that kept one side slow through a whole try (seen
    once under CI load: 17x) does not outlast three, and a wrong FLOP count fails every try."""
    n, reps = 256, 40
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    tries = []
    for _ in range(3):
        plain = peak = 0.0
        for _ in range(4):
            for _ in range(2):
                start = time.perf_counter()
                for _ in range(reps):
                    a @ b
                plain = max(plain, 2 * n**3 * reps / (time.perf_counter() - start))
            peak = max(peak, measure_matmul_peak(seconds=0.05, n=n, windows=2, device="cpu"))
        tries.append((plain, peak))
        if plain / 3 < peak < plain * 3:
            break
    else:
        raise AssertionError(f"measured peak outside 3x of a plain timing in every try (plain, peak): {tries}")
    assert measure_matmul_peak(seconds=0.02, n=64, dtype=torch.bfloat16, windows=1) > 0


def test_cost_report_arithmetic():
    r = cost_report(devices=8, wall_s=3600, tokens=2_000_000, lost_s=900, price=2.0)
    assert r["device_hours"] == 8 and r["cost"] == 16.0 and r["cost_per_mtok"] == 8.0
    assert r["lost_share"] == 0.25 and r["lost_cost"] == 4.0
    free = cost_report(devices=1, wall_s=10, tokens=0)
    assert free["cost"] == 0 and math.isnan(free["cost_per_mtok"])
    with pytest.raises(ValueError):
        cost_report(devices=0, wall_s=1, tokens=1)
