"""The memory snapshots' life on a node (trainer.runtime.memory_sweep): a tier makes its directory at its
first snapshot, so that a run refused at start leaves none; a launcher's start removes the snapshot
directories of other runs whose run.dir is gone or that are too old, one line each, and nothing else:
not the current run's, not a fresh one, not what the tier did not write, not through a symlink."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import SMOKE, SOLO, train_here, trained
from trainer.checkpoint import IncompatibleCheckpointError, TrainState, memory_auto
from trainer.checkpoint.memory import MemoryTier, TierSetup
from trainer.config import CheckpointConfig, load
from trainer.runtime import memory_sweep
from trainer.runtime.memory_sweep import OWNER, RUN_ID_FILE, sweep

HOUR = 3600.0


def written(base: Path, run_id: str, run_dir: Path | str, hours_old: float = 0.0) -> Path:
    """A snapshot directory as the memory tier writes it (one step of a tiny model), its files `hours_old`."""
    memory = MemoryTier(CheckpointConfig(memory_dir=str(base)), replace(SOLO, world=1),
                        TierSetup(run_id=run_id, config_sha256="cfg", run_dir=str(run_dir)), every=1)
    memory.snapshot(TrainState(step=1), *trained(0))
    memory.close()
    if hours_old:
        aged(memory.dir, hours_old)
    return memory.dir


def aged(directory: Path, hours: float) -> None:
    then = time.time() - hours * HOUR
    for path in [*directory.iterdir(), directory]:
        os.utime(path, (then, then), follow_symlinks=False)


def test_a_tier_makes_its_directory_at_its_first_snapshot_and_removes_it_at_the_end(tmp_path, memory_tier_dir):
    base = memory_tier_dir / f"first-snapshot-{uuid.uuid4().hex[:8]}"  # in memory (as /dev/shm): auto measures
    assert memory_auto.choose("auto", str(base), 1000, 3, 1, None)[0] in (None, 0)
    memory = MemoryTier(CheckpointConfig(memory_dir=str(base)), SOLO,
                        TierSetup(run_id="0123456789abcdef", config_sha256="cfg", run_dir=str(tmp_path / "run")),
                        every=1)
    assert "GB free there" in memory.describe() and memory.scan() == {}
    assert not base.exists()  # built and scanned (a run refused after this point leaves nothing)
    memory.snapshot(TrainState(step=1), *trained(0))
    memory.wait()
    assert json.loads((memory.dir / OWNER).read_text()) == {"run_dir": str((tmp_path / "run").resolve())}
    memory.close(remove=True)
    assert not memory.dir.exists()


def test_a_run_refused_at_start_leaves_no_memory_directory(cache_dir, tmp_path):
    """A resume refused as bad input (another model than the checkpoint's: exit 2) comes after the tier is
    built: it made no directory."""
    run, base = tmp_path / "run", tmp_path / "shm"
    train_here(run, ["train.steps=1", "train.eval_every=0", "checkpoint.memory_every=0"])
    with pytest.raises(IncompatibleCheckpointError):
        train_here(run, ["train.steps=2", "model.dim=32", "checkpoint.memory_every=1", f"checkpoint.memory_dir={base}"])
    assert not base.exists()


def test_the_sweep_removes_other_runs_gone_or_old_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv(memory_sweep.MEMORY_DIR_ENV, str(tmp_path / "default"))  # not the session's, shared
    base, ours = tmp_path / "shm", tmp_path / "ours"
    gone = [tmp_path / f"gone-{i}" for i in range(6)]  # run.dirs deleted (one run.dir per tier: a tier's start
    alive = [tmp_path / f"alive-{i}" for i in range(5)]  # removes the earlier runs' of its own run.dir)
    for path in (ours, *alive):
        path.mkdir()
    (ours / RUN_ID_FILE).write_text(json.dumps({"run_id": "000000000000000c"}))
    removed_gone = written(base, "000000000000000a", gone[0], hours_old=1)
    removed_old = written(base, "000000000000000b", alive[0], hours_old=100)
    older_layout = written(base, "000000000000000d", alive[1])
    (older_layout / OWNER).unlink()  # no owner: removed by age only
    aged(older_layout, 100)
    kept = {
        "fresh": written(base, "0000000000000001", alive[2]),
        "run.dir out of view, written lately": written(base, "0000000000000008", gone[5]),
        "fresh, no owner": written(base, "0000000000000002", alive[3]),
        "ours": written(base, "0000000000000003", ours, hours_old=100),
        "ours by run id": written(base, "000000000000000c", gone[1], hours_old=100),
        "a URL": written(base, "0000000000000004", "s3://bucket/run"),
        "not a run id": written(base, "run-a", gone[2], hours_old=100),
        "a file not the tier's": written(base, "0000000000000005", gone[3], hours_old=100),
    }
    (kept["fresh, no owner"] / OWNER).unlink()
    (kept["a file not the tier's"] / "notes.txt").write_text("mine")
    outside = written(tmp_path / "elsewhere", "0000000000000006", gone[4], hours_old=100)
    (base / "0000000000000007").symlink_to(outside)  # a symlink: never followed
    seen = []
    removed = sweep(memory_sweep.bases(str(base)), str(ours), 72 * HOUR, on_removed=seen.append)
    assert [Path(r.path) for r in removed] == [removed_gone, removed_old, older_layout] and seen == removed
    assert removed[0].why == f"their run.dir {gone[0].resolve()} no longer exists" and removed[0].bytes > 0
    assert removed[1].why.startswith("not written for 100.0 h, more than checkpoint.memory_max_age_h=72 (run.dir")
    assert removed[2].why.endswith(f"(no {OWNER} (an older layout))")
    assert removed[0].line().startswith(f"removed the memory snapshots in {removed_gone} (0.")
    assert not any(Path(r.path).exists() for r in removed)
    assert all(path.exists() for path in kept.values()) and (base / "0000000000000007").is_symlink()
    assert len(list(outside.iterdir())) == 3  # owner, header, data
    old = written(base, "000000000000000e", alive[4], hours_old=100)
    assert sweep([str(base)], str(ours), 0.0) == [] and old.exists()  # 0: never by age


def test_the_launcher_sweeps_this_nodes_snapshots_at_start_one_line_each(tmp_path, capsys):
    from launch.__main__ import sweep_memory
    from trainer.observability import logs

    base = tmp_path / "shm"
    old = written(base, "00000000000000aa", tmp_path / "alive", hours_old=5)
    (tmp_path / "alive").mkdir()
    logs.setup(logs.LAUNCHER)
    cfg = load(SMOKE, [f"run.dir={tmp_path / 'run'}", f"checkpoint.memory_dir={base}", "checkpoint.memory_max_age_h=4"])
    assert [Path(r.path) for r in sweep_memory(cfg)] == [old] and not old.exists()
    out = capsys.readouterr().out
    assert f"[launch] removed the memory snapshots in {old} (0." in out and "MB): not written for 5.0 h" in out, out
