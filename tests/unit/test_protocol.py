"""The trainer<->launcher contract's files: JSON-lines records survive a writer killed mid-line, the
fault-injection spec names a step and optionally a rank, and heartbeats round-trip through their one
declaration (HeartbeatRecord)."""

from __future__ import annotations

import json

import pytest

from trainer.runtime.protocol import (
    GENERATION_ENV,
    HEARTBEAT_DIR_ENV,
    HEARTBEAT_KEYS,
    RESTART_COUNT_ENV,
    Heartbeat,
    HeartbeatRecord,
    RecoveryTimes,
    StartupTimes,
    TrainingProgress,
    append_jsonl,
    first_start,
    injected,
    read_heartbeats,
    read_jsonl,
)


def test_a_torn_line_costs_only_itself(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    append_jsonl(path, {"step": 3})
    assert read_jsonl(path) == [{"step": 1}, {"step": 3}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_injection_spec_names_a_step_and_optionally_a_rank():
    assert injected("5", 5, 0) and injected("5", 5, 3)
    assert injected("5:1", 5, 1) and not injected("5:1", 5, 0)
    assert not injected("5", 4, 0) and not injected("", 5, 0)


def test_only_the_launchs_first_ranks_are_a_first_start(monkeypatch):
    """What start-up may cost once (the heap's huge-page collapse, 0.3 s in a forked rank) is left out of a
    restarted rank and of a replacement joining a later generation: the other ranks would wait for it."""
    monkeypatch.delenv(RESTART_COUNT_ENV, raising=False)
    monkeypatch.delenv(GENERATION_ENV, raising=False)
    assert first_start()
    monkeypatch.setenv(GENERATION_ENV, "2")  # forked into generation 2 of the groups: in-process recovery
    assert not first_start()
    monkeypatch.setenv(GENERATION_ENV, "0")
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")  # the group's second attempt: a restart
    assert not first_start()


def test_heartbeat_records_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    beat = Heartbeat(rank=3)
    beat.beat("train", step=7, busy_s=1.5)
    record = read_heartbeats(tmp_path)[3]
    assert (record.phase, record.step, record.progress.busy_s) == ("train", 7, 1.5) and record.startup.t_first > 0
    beat.close()
    assert read_heartbeats(tmp_path)[3].phase == "done"


def test_every_heartbeat_field_round_trips_through_the_file_and_a_typo_cannot_write_a_key(tmp_path, monkeypatch):
    """What `Heartbeat` writes, `read_heartbeats` reads back field for field; the file is one flat JSON object
    keyed by the declared names; a name not declared raises (written or not)."""
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    beat = Heartbeat(rank=2)
    values = dict(
        attempt=3, group="r7", generation=4, signalled=True, t_proc=1.25, t_load=2.5, t_loaded=3.75,
        resumed_step=40, resumed_tier="memory-peer", tier_why="newer than the durable step 30", busy_s=6.5,
        steps_run=9, recovering=4, t_error=10.5, t_left=11.5, t_joined=12.5, t_reformed=13.5, t_restored=14.5,
        replaced=[1, 3], in_process=True, kept_pid=True)
    beat.beat("train", step=49, **values)
    read = read_heartbeats(tmp_path)[2]
    assert read == beat.record and read.pid == beat.record.pid and read.startup.t_first > 0
    on_disk = json.loads((tmp_path / "rank-2.json").read_bytes().decode().strip())
    assert tuple(on_disk) == HEARTBEAT_KEYS and len(set(HEARTBEAT_KEYS)) == len(HEARTBEAT_KEYS)
    assert {k: on_disk[k] for k in values} == values and (on_disk["phase"], on_disk["step"]) == ("train", 49)
    assert HeartbeatRecord.from_json(beat.record.to_json()) == beat.record
    with pytest.raises(TypeError, match="resumed_tire"):
        beat.beat("train", step=50, resumed_tire="durable")
    with pytest.raises(TypeError, match="t_frist"):
        beat.record.update(t_frist=0.0)
    assert "resumed_tire" not in json.loads((tmp_path / "rank-2.json").read_bytes().decode().strip())
    beat.close()
    monkeypatch.delenv(HEARTBEAT_DIR_ENV)
    with pytest.raises(TypeError, match="stepz"):
        Heartbeat(rank=0).beat("train", stepz=1)  # no heartbeat directory: still checked


def test_an_older_heartbeat_file_reads_with_defaults_and_a_newer_ones_extra_keys_are_ignored(tmp_path):
    """A record written before some keys existed (no section of the recovery, no tier) reads with each
    missing field's default; a key this code does not know is ignored, not an error."""
    older = {"pid": 11, "rank": 1, "attempt": 0, "phase": "train", "step": 7, "t": 5.0, "t_proc": 1.0,
             "t_load": 2.0, "t_loaded": 3.0, "t_first": 4.0, "resumed_step": 0, "busy_s": 0.5, "steps_run": 7,
             "from_the_future": {"x": 1}}
    (tmp_path / "rank-1.json").write_text(json.dumps(older))
    (tmp_path / "rank-2.json").write_text('{"pid": 12, "ra')  # torn: skipped
    read = read_heartbeats(tmp_path)
    assert list(read) == [1]
    assert read[1] == HeartbeatRecord(pid=11, rank=1, phase="train", step=7, t=5.0,
                                      startup=StartupTimes(1.0, 2.0, 3.0, 4.0),
                                      progress=TrainingProgress(busy_s=0.5, steps_run=7))
    assert read[1].recovery == RecoveryTimes() and read[1].group == "" and read[1].generation == 0
    assert not read[1].signalled and read[1].progress.resumed_tier == "" and read[1].recovery.replaced == []


def test_sigusr1_prints_every_threads_stack_and_the_rank_goes_on():
    """trainer.runtime.fault.stacks_on_sigusr1: where a stuck rank is, for the launcher's log."""
    import subprocess
    import sys

    code = ("import os, signal, time\nfrom trainer.runtime import fault\nfault.stacks_on_sigusr1()\n"
            "def waiting_here():\n    os.kill(os.getpid(), signal.SIGUSR1)\n    time.sleep(0.2)\n"
            "waiting_here()\nprint('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "still running" in done.stdout, done.stderr[-2000:]
    assert "Current thread" in done.stderr and "waiting_here" in done.stderr, done.stderr[-2000:]


def test_survivors_renumbered_in_a_smaller_world_each_keep_one_file_under_their_new_rank(tmp_path, monkeypatch):
    """Ranks 2 and 3 go on as 0 and 1 (trainer.recovery.inplace.rebuild_smaller), in either order, over a stale
    `rank-1.json`: each ends with one file under its new number, neither writes into the other's, and the
    old names are gone."""
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    for order in ((2, 3), (3, 2)):
        for f in tmp_path.iterdir():
            f.unlink()
        beats = {rank: Heartbeat(rank=rank) for rank in (1, 2, 3)}  # rank 1: a lost node's, stale
        beats[1].close("train")
        for rank in order:
            beats[rank].renumber(rank - 2)
            beats[rank].beat("train", step=10 + rank)
        found = read_heartbeats(tmp_path)
        assert {r: b.step for r, b in found.items()} == {0: 12, 1: 13}, (order, found)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"], order
        beats[2].beat("train", step=20)  # still writing where it should
        assert read_heartbeats(tmp_path)[0].step == 20 and read_heartbeats(tmp_path)[1].step == 13


def test_a_store_move_is_followed_only_by_ranks_of_the_store_it_left_and_forgotten_by_a_new_group(tmp_path):
    from trainer.runtime.protocol import forget_store_moves, read_store_moved, write_store_moved

    assert read_store_moved(tmp_path, "10.0.0.1:29400", "r3") is None  # it never moved
    write_store_moved(tmp_path, ("10.0.0.1:29400", "r3"), ("10.0.0.2:29401", "r3@1"))
    assert read_store_moved(tmp_path, "10.0.0.1:29400", "r3") == ("10.0.0.2:29401", "r3@1")
    assert read_store_moved(tmp_path, "10.0.0.1:29400", "r4") is None  # another group's ranks
    assert read_store_moved(tmp_path, "10.0.0.2:29401", "r3@1") is None  # there already
    (tmp_path / "store.json").write_text("{torn")
    assert read_store_moved(tmp_path, "10.0.0.1:29400", "r3") is None
    forget_store_moves(tmp_path)
    forget_store_moves(tmp_path)  # nothing to forget: no error
    assert not (tmp_path / "store.json").exists()
