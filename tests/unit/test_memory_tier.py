"""The memory tier's files, in this process: a snapshot restores model, optimizer, RNG and train state
bit for bit; three slots rotate; a slot without its header (a rank killed mid-write), a flipped bit,
another run, config or world size is never used; a failed write is a warning, not an error."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import torch

from tests.helpers import SOLO, assert_same, trained
from trainer.checkpoint import TrainState, memory_auto
from trainer.checkpoint.memory import MemoryTier, TierSetup
from trainer.config import CheckpointConfig


def tier(tmp_path, run: str = "run-a", config: str = "cfg-1", world: int = 1, failures: list | None = None):
    setup = TierSetup(run_id=run, config_sha256=config, run_dir=str(tmp_path / "run"),
                      on_failure=(failures.append if failures is not None else None))
    return MemoryTier(CheckpointConfig(memory_dir=str(tmp_path / "shm")), replace(SOLO, world=world), setup, every=1)


def steps(memory: MemoryTier) -> list[int]:
    return sorted(step for _, step in memory.scan())


def test_a_snapshot_restores_the_state_bit_for_bit(tmp_path):
    saved = trained(0)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    memory = tier(tmp_path)
    memory.snapshot(TrainState(step=7, tokens_seen=70, data={"samples": 56}), *saved)
    memory.wait()
    found = memory.scan()
    assert sorted(found) == [(0, 7)] and memory.plan(found) == (7, {0: 0})
    fresh = trained(1)
    torch.manual_seed(999)
    state = memory.load(*memory.fetch(7, {0: 0}, found), *fresh)
    assert (state.step, state.tokens_seen, state.data) == (7, 70, {"samples": 56})
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same(saved, fresh)
    head = memory.scan()[(0, 7)][0].with_suffix(".json")
    (head.parent / f"{head.name}.tmp-host-1234-abcd").write_text("{")  # a header write a SIGKILL cut short
    memory.close(remove=True)
    assert not any((tmp_path / "shm").iterdir())


def test_each_snapshot_has_the_tensors_as_they_are_then(tmp_path):
    """The tensor list and its byte views are kept from one snapshot to the next: they must alias the
    live tensors (an optimizer step changes them in place), and be listed anew when the optimizer's
    state is replaced (a load), its dicts or only the tensors in them."""
    model, opt = trained(0)
    memory = tier(tmp_path)
    memory.snapshot(TrainState(step=1), model, opt)
    memory.wait()

    def step() -> None:
        x = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    for n in (2, 3, 4):
        if n == 3:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors; the step changes only those
        if n == 4:  # new tensors in the same state dicts (whose ids a key of ids took for the same state)
            for state in opt.state.values():
                state["exp_avg"] = state["exp_avg"].clone()
        step()
        memory.snapshot(TrainState(step=n), model, opt)
        memory.wait()
        fresh = trained(1)
        memory.load(*memory.fetch(n, {0: 0}, memory.scan()), *fresh)
        assert_same((model, opt), fresh)
    memory.close(remove=True)


def test_write_all_writes_more_buffers_than_one_system_call_takes(tmp_path):
    from trainer.checkpoint.memory_slots import IOV_MAX, _write_all

    chunks = [bytes([i % 251]) * (1 + i % 7) for i in range(IOV_MAX * 2 + 5)] + [b""]
    fd = os.open(tmp_path / "part.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _write_all(fd, [memoryview(c) for c in chunks])
    finally:
        os.close(fd)
    assert (tmp_path / "part.bin").read_bytes() == b"".join(chunks)


def test_a_header_whose_tensor_table_was_encoded_once_reads_back_the_same(tmp_path):
    import json

    from trainer.checkpoint.memory_slots import write_header

    header = {"step": 7, "state": {"tokens_seen": 3}, "tensors": [["w", "float32", [2, 3], 0, 24]], "records": []}
    write_header(tmp_path / "a.json", header, json.dumps(header["tensors"]))
    assert json.loads((tmp_path / "a.json").read_bytes()) == header


def test_slots_rotate_and_a_torn_or_flipped_one_is_skipped(tmp_path, caplog):
    model, opt = trained(0)
    memory = tier(tmp_path)
    for step in range(1, 6):
        memory.snapshot(TrainState(step=step), model, opt)
        memory.wait()
    assert steps(memory) == [3, 4, 5]  # three slots: the newest two complete ones and one more
    binary, head = memory._paths(memory._slot(5))
    head.unlink()  # what a rank killed in the middle of writing step 5 leaves
    data = bytearray(memory._paths(memory._slot(4))[0].read_bytes())
    data[-1] ^= 0x10
    memory._paths(memory._slot(4))[0].write_bytes(bytes(data))
    assert steps(memory) == [3]
    assert "fails its checksum" in caplog.text


def test_another_run_config_or_world_size_is_never_loaded(tmp_path, caplog):
    model, opt = trained(0)
    memory = tier(tmp_path)
    memory.snapshot(TrainState(step=3), model, opt)
    memory.close()
    assert steps(tier(tmp_path, config="cfg-2")) == []
    assert "written with another config" in caplog.text
    two = tier(tmp_path, world=2)
    assert steps(two) == [] and "world 1, this run's is 2" in two.restoring.skipped
    assert list(two.restoring.elsewhere) == [(1, 3)]  # kept apart, for a reshard
    # A new run id of the same run.dir: the earlier run's snapshots are removed, not loaded.
    other = tier(tmp_path, run="run-b")
    assert steps(other) == [] and not (tmp_path / "shm" / "run-a").exists()


def test_a_failed_write_is_said_once_and_training_goes_on(tmp_path):
    model, opt = trained(0)
    failures: list[str] = []
    memory = tier(tmp_path, failures=failures)
    for slot in (1, 2):
        memory._paths(slot)[0].mkdir(parents=True)  # the .bin cannot be opened for writing: every such write fails
    for step in (1, 2):
        memory.snapshot(TrainState(step=step), model, opt)
        memory.wait()
    assert len(failures) == 1 and "Is a directory" in failures[0], failures
    memory.snapshot(TrainState(step=3), model, opt)  # slot 0
    memory.wait()
    assert steps(memory) == [3] and memory.writes.failed_in_a_row == 0


def test_auto_is_off_on_a_disk_or_without_room_and_an_explicit_interval_is_used_as_it_is(tmp_path, memory_tier_dir):
    """memory_every=auto before training: off, saying why, when memory_dir is on a disk, or when the
    snapshots of the node's ranks would take more than a quarter of the free space; measured first when
    they fit; the interval an earlier attempt chose, at once; a number (or 0) as it is."""
    memory = memory_tier_dir / "unit-auto"  # in memory (/dev/shm) where the machine has one
    if memory_auto.filesystem_type(memory_tier_dir) in memory_auto.MEMORY_FILESYSTEMS:
        every, why = memory_auto.choose("auto", str(memory), shard_bytes=10**18, copies=3, local_world=2, kept=None)
        assert every == 0 and why.startswith(f"not enough room in {memory}: the snapshots of this node's 2 rank(s)")
        assert memory_auto.choose("auto", str(memory), 1000, 3, 2, kept=None) == (None, "")
        assert memory_auto.choose("auto", str(memory), 1000, 3, 2, kept=4) == (4, "")
    disk = tmp_path / "disk"
    if (kind := memory_auto.filesystem_type(tmp_path)) not in (*memory_auto.MEMORY_FILESYSTEMS, ""):
        every, why = memory_auto.choose("auto", str(disk), 1000, 3, 2, kept=4)
        assert every == 0 and f"memory_dir {disk} is on a disk ({kind}), not in memory" in why
    assert memory_auto.choose(0, str(disk), 10**18, 3, 2, kept=4) == (0, "")
    assert memory_auto.choose(5, str(disk), 10**18, 3, 2, kept=4) == (5, "")


def test_auto_settles_on_the_fewest_steps_that_keep_a_snapshot_near_one_percent():
    measure = memory_auto.Measure(on_cpu=True)
    for _ in range(memory_auto.MEASURED_STEPS):
        assert not measure.due()
        measure.note(step_s=0.1, call_s=0.0002, waited_total_s=0.0, write_s=0.0028)  # 3 ms of 100 ms steps
    assert measure.due() and measure.settle(world=1) == (3, 0.003, 0.1)
    gpu = memory_auto.Measure(on_cpu=False)  # on a GPU the background write does not count
    for n in range(memory_auto.MEASURED_STEPS):
        gpu.note(step_s=0.1, call_s=0.0002, waited_total_s=0.0001 * n, write_s=0.5)
    every, cost, _ = gpu.settle(world=1)
    assert every == 1 and abs(cost - 0.0003) < 1e-12
