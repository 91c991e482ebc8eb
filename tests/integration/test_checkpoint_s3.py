"""Checkpoints on a real S3 endpoint (the loopback moto server): bit-exact round trips (also of the
raw shard format), a damaged shard falling back to the previous commit, local spools (the bytes
verified are the bytes loaded; spools of dead processes swept; no usable temp dir), and unreachable
checkpoint storage as one clear line from the trainer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    SMOKE,
    SOLO,
    assert_same,
    check_raw_format_round_trip_is_bit_exact,
    check_round_trip_is_bit_exact,
    corrupt_on_s3,
    trained,
    trainer_cmd,
)
from trainer.checkpoint import Checkpointer, TrainState, step_dir
from trainer.config import CheckpointConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_round_trip_is_bit_exact(s3_bucket):
    check_round_trip_is_bit_exact(s3_bucket + "/run/ck")


def test_raw_format_round_trip_is_bit_exact(s3_bucket):
    check_raw_format_round_trip_is_bit_exact(s3_bucket + "/raw/ck")


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_shard_on_s3_falls_back_to_previous(s3_bucket, capsys, how):
    root = f"{s3_bucket}/run/ck"
    ckpt = Checkpointer(root, SOLO, CheckpointConfig(keep=3))
    first = trained(0)
    ckpt.save(TrainState(step=1), *first)
    ckpt.save(TrainState(step=2), *trained(1))
    corrupt_on_s3(f"{step_dir(root, 2)}/__0_0.distcp", how)
    assert ckpt.discover_latest() == 1
    assert "step 2 is unusable" in capsys.readouterr().out
    restored = trained(2)
    ckpt.load(1, *restored)
    assert_same(first, restored)


def spools() -> set[str]:
    from trainer.checkpoint.spool import spool_prefix

    return {p.name for p in Path(tempfile.gettempdir()).glob(f"{spool_prefix()}*")}


def test_spools_of_dead_processes_are_swept_and_live_ones_kept(s3_bucket):
    from trainer.checkpoint.spool import spool_prefix

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=spool_prefix(dead.pid)))
    (stale / "__0_0.distcp").write_bytes(b"partial")
    live = Path(tempfile.mkdtemp(prefix=spool_prefix(os.getppid())))
    try:
        ckpt = Checkpointer(f"{s3_bucket}/run/ck", SOLO)
        ckpt.save(TrainState(step=1), *trained(0))
        assert ckpt.discover_latest() == 1
        assert not stale.exists() and live.exists()
        ckpt.close()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_s3_load_reads_the_bytes_it_verified_and_cleans_up(s3_bucket):
    """A remote shard is downloaded once, by verification, into a local spool; the load reads that
    copy, so a change to the remote object after verification cannot reach the model. The spool
    is gone after the load, and the next verification sees the changed object."""
    root = f"{s3_bucket}/run/ck"
    ckpt = Checkpointer(root, SOLO, CheckpointConfig(keep=3))
    first = trained(0)
    ckpt.save(TrainState(step=1), *first)
    saved = trained(1)
    ckpt.save(TrainState(step=2), *saved)
    before = spools()
    assert ckpt.discover_latest() == 2
    assert len(spools() - before) == 1
    corrupt_on_s3(f"{step_dir(root, 2)}/__0_0.distcp", "flip")  # altered after verification
    restored = trained(2)
    ckpt.load(2, *restored)
    assert_same(saved, restored)
    assert spools() == before
    assert ckpt.discover_latest() == 1
    ckpt.close()
    assert spools() == before


def test_s3_checkpoint_loads_without_a_usable_temp_dir(s3_bucket, tmp_path, monkeypatch):
    """No room for the local copies (here: no temp directory at all): verified and loaded remotely."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    ckpt = Checkpointer(f"{s3_bucket}/run/ck", SOLO)
    saved = trained(0)
    ckpt.save(TrainState(step=3), *saved)
    assert ckpt.discover_latest() == 3
    restored = trained(1)
    ckpt.load(3, *restored)
    assert_same(saved, restored)


def test_unreachable_checkpoint_storage_is_one_clear_line(cache_dir, tmp_path):
    from tests.helpers import SECRET, unreachable_env

    env = unreachable_env()
    proc = subprocess.run(trainer_cmd(1, SMOKE, [f"run.dir={tmp_path}", "train.steps=2", "log.progress=false",
                                                 "checkpoint.dir=s3://rekindle-unreachable/ckpt"]),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr[-2000:]  # storage: may come back
    assert "error: cannot reach checkpoint storage s3://rekindle-unreachable/ckpt" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
