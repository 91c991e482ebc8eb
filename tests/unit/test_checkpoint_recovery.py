"""Checkpoint commits and recovery, in this process: a damaged newest checkpoint (a file flipped,
truncated, deleted or unreadable, any byte of COMMIT.json altered) falls back to the previous commit;
which rank verifies which file; retention (milestones, after a fallback); a failed save keeps every
previous commit and is loud; async saves (a new buffer when the state changes shape, a write error
raised at the next poll). (With several processes or S3: tests/integration/test_checkpoint_*.py.)"""

from __future__ import annotations

import pytest
import torch

from common import storage
from tests.helpers import SOLO, assert_same, corrupt, trained
from trainer.checkpoint import (
    COMMIT,
    Checkpointer,
    CheckpointError,
    IncompatibleCheckpointError,
    TrainState,
    commit,
    committed_steps,
)
from trainer.checkpoint.commit import verifying_rank
from trainer.config import CheckpointConfig
from trainer.model.transformer import ModelArgs, Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "train_state.json", COMMIT])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, capsys, name, how):
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=3))
    first = trained(0)
    ckpt.save(TrainState(step=1), *first)
    ckpt.save(TrainState(step=2), *trained(1))
    corrupt(tmp_path / "step-00000002" / name, how)
    expected = 1
    assert ckpt.discover_latest() == expected
    out = capsys.readouterr().out
    if name != COMMIT or how != "delete":  # a deleted COMMIT.json means "never committed": silently skipped
        assert "step 2 is unusable" in out and "step-00000002/" in out
    restored = trained(2)
    ckpt.load(expected, *restored)
    assert_same(first, restored)


def test_each_rank_verifies_the_shard_file_it_will_load():
    names = [".metadata", "COMMIT.json", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "train_state.json"]
    assert [verifying_rank(n, i, 3) for i, n in enumerate(names)] == [0, 1, 0, 1, 2, 2]
    assert [verifying_rank(n, i, 2) for i, n in enumerate(names)][2:5] == [0, 1, 0]  # 3 -> 2 ranks
    assert {verifying_rank(n, i, 1) for i, n in enumerate(names)} == {0}


def test_retention_keeps_newest_and_milestones(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2, keep_every=3))
    model, opt = trained(0)
    (tmp_path / "step-00000000").mkdir(parents=True)  # an uncommitted leftover of a crashed save
    for step in range(1, 8):
        ckpt.save(TrainState(step=step), model, opt)
    assert committed_steps(ckpt.root) == [3, 6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000006", "step-00000007"]


def test_any_altered_byte_of_commit_json_is_detected(tmp_path):
    """COMMIT.json carries a checksum of its own content: a flipped bit that still parses (a size, a
    time, a name) is caught too."""
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=3))
    ckpt.save(TrainState(step=1), *trained(0))
    ckpt.save(TrainState(step=2), *trained(1))
    path = tmp_path / "step-00000002" / COMMIT
    good = path.read_bytes()
    for i in range(0, len(good), 7):
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bytes(bad))
        assert ckpt.discover_latest() == 1, (i, bytes(bad[max(0, i - 20):i + 20]))
    path.write_bytes(good)
    assert ckpt.discover_latest() == 2


def test_failed_save_keeps_every_previous_commit(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2))
    model, opt = trained(0)
    for step in (1, 2):
        ckpt.save(TrainState(step=step), model, opt)
    monkeypatch.setenv("REKINDLE_CRASH_AT", "write-error@3")
    with pytest.raises(CheckpointError, match="step 3 .* not committed: rank 0: .*No space left on device"):
        ckpt.save(TrainState(step=3), model, opt)
    assert committed_steps(ckpt.root) == [1, 2] and not (tmp_path / "step-00000003" / COMMIT).exists()
    monkeypatch.delenv("REKINDLE_CRASH_AT")
    ckpt.save(TrainState(step=3), model, opt)  # the leftover is cleared, the save succeeds, step 1 goes
    assert committed_steps(ckpt.root) == [2, 3]


def test_retention_after_a_fallback_keeps_the_steps_of_this_timeline(tmp_path):
    """Resumed from step 4 because step 6 is corrupt: retention counts only steps up to the one just
    committed (which it never deletes), and deletes step 6, the abandoned timeline, once 5 exists."""
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2))
    model, opt = trained(0)
    for step in (2, 4, 6):
        ckpt.save(TrainState(step=step), model, opt)
    corrupt(tmp_path / "step-00000006" / "__0_0.distcp", "flip")
    resumed = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2))
    assert resumed.discover_latest() == 4
    resumed.save(TrainState(step=5), model, opt)
    assert committed_steps(resumed.root) == [4, 5]  # was [5, 6]: the fallback gone, the corrupt step kept
    assert resumed.discover_latest() == 5


def test_all_newest_steps_unusable_then_fresh_saves_are_kept(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2))
    model, opt = trained(0)
    for step in (60, 80):
        ckpt.save(TrainState(step=step), model, opt)
    for step in (60, 80):
        corrupt(tmp_path / f"step-{step:08d}" / "__0_0.distcp", "flip")
    fresh = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2))
    assert fresh.discover_latest() is None
    for step in (10, 20, 30):
        fresh.save(TrainState(step=step), model, opt)
    assert committed_steps(fresh.root) == [20, 30] and fresh.discover_latest() == 30


def test_a_failure_after_the_commit_is_a_warning_not_a_failed_save(tmp_path, capsys, monkeypatch):
    """Deleting old steps or recording the commit can fail (a bucket that forbids deletes): the step is
    committed all the same, and the save says so instead of 'not committed'."""
    def fail(*_, **__):
        raise PermissionError("deletes are forbidden here")

    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2), on_event=fail)
    monkeypatch.setattr(commit, "prune", fail)
    model, opt = trained(0)
    for step in (1, 2, 3):
        ckpt.save(TrainState(step=step), model, opt)
    assert committed_steps(ckpt.root) == [1, 2, 3] and ckpt.discover_latest() == 3
    out = capsys.readouterr().out
    assert "step 3 is committed, but deleting old steps failed: PermissionError" in out
    assert "step 3 is committed, but recording the commit failed" in out


def test_a_file_that_cannot_be_read_falls_back_like_a_corrupt_one(tmp_path, monkeypatch, capsys):
    """An I/O error reading one shard (EIO, a bad sector: injected, as no real disk fails on demand) makes
    that step unusable; the run falls back to the previous step instead of crashing on every restart."""
    import errno

    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=2))
    model, opt = trained(0)
    for step in (1, 2):
        ckpt.save(TrainState(step=step), model, opt)
    checksum_file = storage.checksum_file

    def failing(fs, path, *args, **kwargs):
        if "step-00000002" in str(path):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return checksum_file(fs, path, *args, **kwargs)

    monkeypatch.setattr(storage, "checksum_file", failing)
    assert ckpt.discover_latest() == 1
    assert "step 2 is unusable, falling back" in capsys.readouterr().out


def test_async_save_after_the_optimizer_state_changed_shape(tmp_path):
    """The reused CPU buffer of async saves no longer fits once the optimizer state has a new entry:
    the save makes a new buffer instead of failing."""
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(async_=True))
    model, opt = trained(0)
    ckpt.save(TrainState(step=1), model, opt, blocking=False)
    ckpt.wait()
    first = next(iter(opt.state.values()))
    first["max_exp_avg_sq"] = torch.zeros_like(first["exp_avg_sq"])  # as amsgrad=True would add
    ckpt.save(TrainState(step=2), model, opt, blocking=False)
    ckpt.wait()
    assert committed_steps(ckpt.root) == [1, 2]
    ckpt.close()


def test_async_write_error_is_raised_at_the_next_poll(tmp_path, monkeypatch):
    """In one process: once the background write has failed, the very next poll() (one per training
    step) raises; optimizer.step() is not left waiting for the copy."""
    monkeypatch.setenv("REKINDLE_CRASH_AT", "write-error@1")
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(async_=True))
    model, opt = trained(0)
    ckpt.save(TrainState(step=1), model, opt, blocking=False)
    assert "No space left" in str(ckpt._pending.future.exception(timeout=60))  # the write has failed
    opt.step()  # returns: the copy is done (the pre-step hook does not block)
    with pytest.raises(CheckpointError, match="step 1 .* background save failed: rank 0: OSError: .*No space left"):
        ckpt.poll()
    assert committed_steps(ckpt.root) == []
    ckpt.close()


def test_save_failure_is_loud(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "file-not-dir"), SOLO)
    (tmp_path / "file-not-dir").write_text("in the way")
    with pytest.raises(CheckpointError, match="not committed"):
        ckpt.save(TrainState(step=1), *trained(0))


def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_tensors(tmp_path):
    """A changed model config (here model.dim) against a checkpoint that does not record the model's
    arguments (as before they were kept): refused by tensor shapes, naming them, before DCP reads a byte."""
    ckpt = Checkpointer(str(tmp_path), SOLO)
    ckpt.save(TrainState(step=1), *trained(0))
    wider = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16))
    with pytest.raises(IncompatibleCheckpointError, match=r"holds another model \(tok_embeddings.weight is "
                                                          r"\[64, 32\] there, \[64, 64\] here"):
        ckpt.load(1, wider, torch.optim.AdamW(wider.parameters()))


def test_failed_periodic_saves_are_warnings_up_to_a_limit(tmp_path, monkeypatch, capsys):
    """A save that is not required (a periodic one) fails without ending the run: a warning, a
    `checkpoint_failed` event, its partial step deleted (a full disk must not stay full); a success
    resets the count; one failure more than max_failed_saves in a row, or a required save, raises."""
    events = []
    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=3, max_failed_saves=1),
                        on_event=lambda name, **fields: events.append((name, fields["step"])))
    model, opt = trained(0)
    assert ckpt.save(TrainState(step=1), model, opt, required=False) is not None
    monkeypatch.setenv("REKINDLE_CRASH_AT", "write-error@2")
    assert ckpt.save(TrainState(step=2), model, opt, required=False) is None
    assert "warning: checkpoint step 2" in capsys.readouterr().out
    assert events == [("commit", 1), ("checkpoint_failed", 2)]
    assert not (tmp_path / "step-00000002").exists() and committed_steps(ckpt.root) == [1]
    ckpt.save(TrainState(step=3), model, opt, required=False)  # succeeds: the count starts again
    assert ckpt.failed_in_a_row == 0 and committed_steps(ckpt.root) == [1, 3]
    monkeypatch.setenv("REKINDLE_CRASH_AT", "write-error@4")
    assert ckpt.save(TrainState(step=4), model, opt, required=False) is None  # 1 of 1 allowed
    with pytest.raises(CheckpointError, match="step 4 .* not committed"):
        ckpt.save(TrainState(step=4), model, opt, required=False)  # the second in a row
    with pytest.raises(CheckpointError, match="step 4 .* not committed"):
        Checkpointer(str(tmp_path), SOLO, CheckpointConfig(max_failed_saves=5)).save(  # a required save
            TrainState(step=4), model, opt)
    assert committed_steps(ckpt.root) == [1, 3]
