"""Checkpoint bytes, in this process: bit-exact round trips on local disk, the raw shard format
(dtypes, views, partial reads, stock DCP refusing it), DCP's own format (checkpoint.format=dcp) read
by stock DCP tools, a flipped bit in raw tensor data caught before use, and checkpoints that try to
run code on load. (Round trips on the loopback S3 server: tests/integration/test_checkpoint_s3.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tests.helpers import (
    SOLO,
    assert_same,
    blank,
    check_raw_format_round_trip_is_bit_exact,
    check_round_trip_is_bit_exact,
    trained,
)
from trainer.checkpoint import COMMIT, Checkpointer, CheckpointError, TrainState, writing
from trainer.checkpoint import format as ckpt_format
from trainer.checkpoint.commit import seal, verify
from trainer.checkpoint.format import RAW_FORMAT, UnsafeCheckpointError, load_metadata
from trainer.config import CheckpointConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_round_trip_is_bit_exact(tmp_path):
    check_round_trip_is_bit_exact(str(tmp_path / "ck"))


def test_raw_format_round_trip_is_bit_exact(tmp_path):
    check_raw_format_round_trip_is_bit_exact(str(tmp_path / "ck"))


def test_raw_format_partial_reads(tmp_path):
    """Resharding reads part of a stored chunk: whole rows (read alone), or a box (the chunk, then
    narrowed); into a contiguous destination or a strided view; with a dtype cast."""
    x = torch.arange(48, dtype=torch.float32).view(6, 8)
    dcp.save({"x": x}, storage_writer=writing.writer(str(tmp_path)), no_dist=True)
    reader = ckpt_format.reader(str(tmp_path))
    reader.set_up_storage_reader(reader.read_metadata(), True)

    class Into:
        def __init__(self, dest):
            self.dest, self.committed = dest, 0

        def resolve_tensor(self, item):
            return self.dest

        def commit_tensor(self, item, tensor):
            self.committed += 1

    cases = [((2, 0), (3, 8), torch.empty(3, 8)), ((1, 2), (3, 4), torch.empty(3, 4)),
             ((0, 0), (6, 8), torch.empty(8, 6).t()), ((4, 3), (2, 5), torch.empty(2, 5, dtype=torch.float64))]
    for offsets, lengths, dest in cases:
        item = ReadItem(LoadItemType.TENSOR, MetadataIndex("x"), torch.Size([0, 0]), MetadataIndex("x", [0, 0], 0),
                        torch.Size(offsets), torch.Size(lengths))
        planner = Into(dest)
        reader.read_data(LoadPlan([item]), planner).wait()
        want = x[offsets[0]:offsets[0] + lengths[0], offsets[1]:offsets[1] + lengths[1]]
        assert planner.committed == 1 and torch.equal(dest, want.to(dest.dtype)), (offsets, lengths)


def test_checkpoint_of_dcps_own_format_loads(tmp_path):
    """Steps in DCP's own format (checkpoint.format=dcp, and every checkpoint written before the raw
    format) load through the same reader, verified by the same checksums."""
    saved = trained(0)
    Checkpointer(str(tmp_path), SOLO, CheckpointConfig(format="dcp")).save(TrainState(step=3), *saved)
    meta = load_metadata((tmp_path / "step-00000003" / ".metadata").read_bytes())
    assert all(info.transform_descriptors is None for info in meta.storage_data.values())  # DCP's format
    assert verify(str(tmp_path / "step-00000003")) == ""
    ckpt = Checkpointer(str(tmp_path), SOLO)
    assert ckpt.discover_latest() == 3
    fresh = trained(1)
    ckpt.load(3, *fresh)
    assert_same(saved, fresh)


def test_stock_dcp_tools_read_a_dcp_format_checkpoint(tmp_path):
    """checkpoint.format=dcp: stock `dcp.load` (its own reader and planner) and `dcp_to_torch_save`
    read the step directory as it is, COMMIT.json and train_state.json beside the DCP files."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = trained(0)
    Checkpointer(str(tmp_path), SOLO, CheckpointConfig(format="dcp")).save(TrainState(step=3), model, opt)
    step = str(tmp_path / "step-00000003")
    model_sd, optim_sd = get_state_dict(model, opt)
    into = {"model": blank(model_sd), "optim": {"state": blank(optim_sd["state"])}}
    dcp.load(into, checkpoint_id=step, no_dist=True)
    for name, t in model_sd.items():
        assert torch.equal(into["model"][name], t), name
    for name, moments in optim_sd["state"].items():
        for key, t in moments.items():
            assert torch.equal(into["optim"]["state"][name][key], t), (name, key)
    dcp_to_torch_save(step, str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full["model"]) == set(model_sd)
    for name, t in model_sd.items():
        assert torch.equal(full["model"][name], t), name
    assert full["optim"]["param_groups"][0]["lr"] == optim_sd["param_groups"][0]["lr"]


def test_stock_dcp_reader_refuses_the_raw_format(tmp_path):
    """A reader that does not know the format (DCP's own) fails loudly instead of misreading bytes."""
    sd = {"x": torch.randn(4, 4), "step": 3}
    dcp.save(sd, storage_writer=writing.writer(str(tmp_path)), no_dist=True)
    with pytest.raises(CheckpointException, match=f"Unknown extension name='{RAW_FORMAT}'"):
        dcp.load(blank(sd), storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)


def test_flipped_bit_in_raw_tensor_data_is_caught_before_use(tmp_path, capsys):
    """Raw tensor bytes have no structure of their own to fail on: only the checksum catches a flip.
    The step is refused at discovery (and by export), before any of its bytes are loaded."""
    from trainer.export import resolve

    ckpt = Checkpointer(str(tmp_path), SOLO, CheckpointConfig(keep=3))
    first = trained(0)
    ckpt.save(TrainState(step=1), *first)
    ckpt.save(TrainState(step=2), *trained(1))
    step = tmp_path / "step-00000002"
    meta = load_metadata((step / ".metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "model.output.weight")
    assert info.transform_descriptors == (RAW_FORMAT,)
    shard = step / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    unverified = trained(2)
    ckpt.load(2, *unverified)  # loading without verification would use the flipped value silently
    assert not torch.equal(unverified[0].output.weight, trained(1)[0].output.weight)
    assert ckpt.discover_latest() == 1
    assert f"{step}/{info.relative_path} fails its checksum" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="fails its checksum"):
        resolve(str(step))
    restored = trained(3)
    ckpt.load(1, *restored)
    assert_same(first, restored)


def test_metadata_that_would_run_code_is_refused(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO)
    ckpt.save(TrainState(step=1), *trained(0))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = tmp_path / "step-00000001" / ".metadata"
    meta.write_bytes(pickle.dumps(Exploit()))
    commit = json.loads((tmp_path / "step-00000001" / COMMIT).read_text())  # a forger can fix the checksums
    digest = hashlib.sha256(meta.read_bytes()).hexdigest()
    commit["files"][".metadata"] = {"size": meta.stat().st_size, "sha256": digest}
    commit = seal({k: v for k, v in commit.items() if k != "sha256"})
    (tmp_path / "step-00000001" / COMMIT).write_text(json.dumps(commit))
    assert ckpt.discover_latest() is None  # refused at verification...
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system, which is not allowed"):
        ckpt.load(1, *trained(1))  # ...and at load
    assert not marker.exists()


def test_data_item_that_would_run_code_is_refused(tmp_path):
    """DCP's own planner unpickles non-tensor items (optimizer hyper-parameters) with
    weights_only=False: a forged item must be refused, not run."""
    ckpt = Checkpointer(str(tmp_path), SOLO)
    ckpt.save(TrainState(step=1), *trained(0))
    marker, step = tmp_path / "pwned", tmp_path / "step-00000001"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = load_metadata((step / ".metadata").read_bytes())
    item = next(k for k in meta.storage_data if k.fqn == "optim.param_groups.0.lr")
    shard = step / meta.storage_data[item].relative_path
    payload = bytearray()
    with __import__("io").BytesIO() as buf:
        torch.save(Exploit(), buf)
        payload = buf.getvalue()
    meta.storage_data[item].offset, meta.storage_data[item].length = shard.stat().st_size, len(payload)
    shard.write_bytes(shard.read_bytes() + payload)
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    commit = json.loads((step / COMMIT).read_text())  # a forger can fix every checksum
    for name in (shard.name, ".metadata"):
        data = (step / name).read_bytes()
        commit["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    commit = seal({k: v for k, v in commit.items() if k != "sha256"})
    (step / COMMIT).write_text(json.dumps(commit))
    assert ckpt.discover_latest() == 1  # the forgery verifies...
    with pytest.raises(UnsafeCheckpointError, match=r"optim\.param_groups\.0\.lr is not plain data"):
        ckpt.load(1, *trained(1))  # ...but is refused at load
    assert not marker.exists()
