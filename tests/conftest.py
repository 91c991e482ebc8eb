"""Shared fixtures: a per-session cache for the built-in corpus, and helpers that run the real
trainer as separate processes (plain python, or torchrun with several gloo ranks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["s3"]  # the loopback S3 server fixtures (tests/s3.py)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One built-in corpus cache for the whole session, shared with child processes."""
    path = tmp_path_factory.mktemp("rekindle-cache")
    os.environ["REKINDLE_CACHE"] = str(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_cmd(nproc: int, config: Path, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "trainer", str(config), *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
        "-m", "trainer", str(config), *overrides,
    ]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.update(extra)
    return env


def run_trainer(
    run_dir: Path, overrides: list[str] = (), nproc: int = 1, timeout: float = 180, config: Path = SMOKE,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run the trainer to completion in fresh processes (bounded by `timeout`)."""
    args = [f"run.dir={run_dir}", "log.progress=false", *overrides]
    proc = subprocess.run(
        trainer_cmd(nproc, config, args), cwd=REPO, env=child_env(), capture_output=True, text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (before a crash and after resume) keeps the last."""
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        records[r["step"]] = r
    return records
