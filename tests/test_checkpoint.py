"""Checkpoints: bit-exact round trips (local and a real loopback S3), the raw shard format (dtypes,
views, partial reads, old-format checkpoints, stock DCP refusing it), corruption detection with
fallback, retention, crash-during-save recovery (real SIGKILL, also with the checkpoint on S3), async
vs sync, an async write error stopping every rank, resharding 2->1 and 1->2 with equal parameters,
and checkpoints that try to run code on load.

Run as a script under torchrun (`tests/test_checkpoint.py reshard-worker ROOT`) it is the 2-rank
worker of the resharding test."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, SMOKE, child_env, free_port, read_metrics, run_trainer, trainer_cmd
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from trainer import ckpt_storage as storage
from trainer.checkpoint import COMMIT, Checkpointer, CheckpointError, TrainState, _commit_digest, load_state, step_dir
from trainer.ckpt_storage import RAW_FORMAT, UnsafeCheckpointError, load_metadata
from trainer.model import ModelArgs, Transformer
from trainer.parallel import DistInfo

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SOLO = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def trained(seed: int = 0) -> tuple[Transformer, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def smoke_model() -> tuple[Transformer, torch.optim.AdamW]:
    from trainer.config import load
    from trainer.loop import build_optimizer

    cfg = load(SMOKE)
    model = Transformer(ModelArgs(**{k: getattr(cfg.model, k) for k in ModelArgs.__dataclass_fields__}))
    return model, build_optimizer(model, cfg, torch.device("cpu"))


def assert_same(a: tuple, b: tuple) -> None:
    for (n, p), q in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(p, q), n
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_round_trip_is_bit_exact(tmp_path, where, request):
    root = str(tmp_path / "ck") if where == "local" else request.getfixturevalue("s3_bucket") + "/run/ck"
    saved = trained(0)
    ckpt = Checkpointer(root, SOLO)
    ckpt.save(TrainState(step=7, tokens_seen=70, data={"samples_consumed": 14}), *saved)
    fresh = trained(1)
    assert ckpt.discover_latest() == 7
    state = ckpt.load(7, *fresh)
    assert (state.step, state.tokens_seen, state.data) == (7, 70, {"samples_consumed": 14})
    assert_same(saved, fresh)


def odd_tensors() -> dict:
    """Every dtype a checkpoint may hold, and tensors that are views: a slice with a storage offset, a
    non-contiguous column slice and transpose, a scalar, an empty tensor; plus a non-tensor item."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(5, 3, generator=g), "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, generator=g).half(), "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.randint(-2**62, 2**62, (9,), generator=g), "i32": torch.randint(-9, 9, (3, 3), generator=g).int(),
        "u8": torch.randint(0, 255, (11,), generator=g, dtype=torch.uint8), "bool": torch.rand(13, generator=g) > 0.5,
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "rows": base[2:5], "cols": base[:, 1:4], "t": base.t(), "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
        "step": 12, "note": {"lr": 0.1, "betas": (0.9, 0.95)},
    }


def blank(sd: dict) -> dict:
    """The same structure: tensors zeroed, other values None."""
    return {k: blank(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else None
            for k, v in sd.items()}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_raw_format_round_trip_is_bit_exact(tmp_path, where, request):
    path = str(tmp_path / "ck") if where == "local" else request.getfixturevalue("s3_bucket") + "/raw/ck"
    sd = odd_tensors()
    w = storage.writer(path)
    dcp.save(sd, storage_writer=w, no_dist=True)
    fs, p = storage.filesystem(path)
    meta = load_metadata(fs.cat_file(f"{p}/.metadata"))
    formats = {k.fqn: v.transform_descriptors for k, v in meta.storage_data.items()}
    assert {k for k, f in formats.items() if f == (RAW_FORMAT,)} == {k for k, v in sd.items() if torch.is_tensor(v)}
    assert formats["step"] is None and formats["note.lr"] is None  # objects: torch.save'd, as DCP does
    assert set(w.digests) == {"__0_0.distcp", ".metadata"}
    for name, info in w.digests.items():  # hashed as written == hashed as stored
        assert info[storage.CHECKSUM] == storage.checksum_file(fs, f"{p}/{name}"), name
    got = blank(sd)
    load_state(got, path)
    for k, v in sd.items():
        if torch.is_tensor(v):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_raw_format_partial_reads(tmp_path):
    """Resharding reads part of a stored chunk: whole rows (read alone), or a box (the chunk, then
    narrowed); into a contiguous destination or a strided view; with a dtype cast."""
    x = torch.arange(48, dtype=torch.float32).view(6, 8)
    dcp.save({"x": x}, storage_writer=storage.writer(str(tmp_path)), no_dist=True)
    reader = storage.reader(str(tmp_path))
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


def test_checkpoint_of_dcps_own_format_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before the raw format (DCP's torch.save per tensor) load as before."""
    monkeypatch.setattr(storage._LocalWriter, "write_data", dcp.FileSystemWriter.write_data)
    saved = trained(0)
    Checkpointer(str(tmp_path), SOLO).save(TrainState(step=3), *saved)
    monkeypatch.undo()
    meta = load_metadata((tmp_path / "step-00000003" / ".metadata").read_bytes())
    assert all(info.transform_descriptors is None for info in meta.storage_data.values())  # the old format
    ckpt = Checkpointer(str(tmp_path), SOLO)
    assert ckpt.discover_latest() == 3
    fresh = trained(1)
    ckpt.load(3, *fresh)
    assert_same(saved, fresh)


def test_stock_dcp_reader_refuses_the_raw_format(tmp_path):
    """A reader that does not know the format (DCP's own) fails loudly instead of misreading bytes."""
    sd = {"x": torch.randn(4, 4), "step": 3}
    dcp.save(sd, storage_writer=storage.writer(str(tmp_path)), no_dist=True)
    with pytest.raises(CheckpointException, match=f"Unknown extension name='{RAW_FORMAT}'"):
        dcp.load(blank(sd), storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)


def test_flipped_bit_in_raw_tensor_data_is_caught_before_use(tmp_path, capsys):
    """Raw tensor bytes have no structure of their own to fail on: only the checksum catches a flip.
    The step is refused at discovery (and by export), before any of its bytes are loaded."""
    from trainer.export import resolve

    ckpt = Checkpointer(str(tmp_path), SOLO, keep=3)
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


def corrupted(data: bytes, how: str) -> bytes:
    """`data` with one bit flipped in the middle ("flip") or its last 5 bytes cut off ("truncate")."""
    if how == "flip":
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x10
        return bytes(flipped)
    if how == "truncate":
        return data[:-5]
    raise ValueError(f"unknown corruption {how!r}")


def corrupt(path: Path, how: str) -> None:
    """Flip a bit in or truncate the local file (see `corrupted`); any other `how` deletes it."""
    if how in ("flip", "truncate"):
        path.write_bytes(corrupted(path.read_bytes(), how))
    else:
        path.unlink()


def corrupt_on_s3(url: str, how: str) -> None:
    """`corrupt` for an object on the loopback S3 server (flip or truncate)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.pipe_file(url, corrupted(fs.cat_file(url), how))


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "train_state.json", COMMIT])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, capsys, name, how):
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=3)
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


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_shard_on_s3_falls_back_to_previous(s3_bucket, capsys, how):
    root = f"{s3_bucket}/run/ck"
    ckpt = Checkpointer(root, SOLO, keep=3)
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
    from trainer.checkpoint import _spool_prefix

    return {p.name for p in Path(tempfile.gettempdir()).glob(f"{_spool_prefix()}*")}


def test_spools_of_dead_processes_are_swept_and_live_ones_kept(s3_bucket):
    from trainer.checkpoint import _spool_prefix

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=_spool_prefix(dead.pid)))
    (stale / "__0_0.distcp").write_bytes(b"partial")
    live = Path(tempfile.mkdtemp(prefix=_spool_prefix(os.getppid())))
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
    ckpt = Checkpointer(root, SOLO, keep=3)
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


def test_each_rank_verifies_the_shard_file_it_will_load():
    from trainer.checkpoint import _verifier

    names = [".metadata", "COMMIT.json", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "train_state.json"]
    assert [_verifier(n, i, 3) for i, n in enumerate(names)] == [0, 1, 0, 1, 2, 2]
    assert [_verifier(n, i, 2) for i, n in enumerate(names)][2:5] == [0, 1, 0]  # 3 -> 2 ranks
    assert {_verifier(n, i, 1) for i, n in enumerate(names)} == {0}


def test_no_usable_checkpoint_starts_fresh_or_fails_when_required(cache_dir, tmp_path):
    proc = run_trainer(tmp_path, ["train.steps=2", "checkpoint.resume=required"], check=False)
    assert proc.returncode == 1
    assert "checkpoint.resume=required but no usable committed checkpoint" in proc.stderr
    proc = run_trainer(tmp_path, ["train.steps=2"])
    assert "starting fresh" in proc.stdout


def test_resume_never_refuses_a_directory_with_committed_steps(cache_dir, tmp_path):
    """resume=never over committed checkpoints would, at the next resume, mix two runs: refused, and
    nothing is deleted."""
    run_trainer(tmp_path, ["train.steps=2", "checkpoint.every=2"])
    proc = run_trainer(tmp_path, ["train.steps=2", "checkpoint.resume=never"], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "checkpoint.resume=never, but" in proc.stderr and "holds committed step(s) [2]" in proc.stderr
    assert (tmp_path / "checkpoints" / "step-00000002" / COMMIT).exists()


def test_unreachable_checkpoint_storage_is_one_clear_line(cache_dir, tmp_path):
    from s3 import SECRET, unreachable_env

    env = unreachable_env()
    proc = subprocess.run(trainer_cmd(1, SMOKE, [f"run.dir={tmp_path}", "train.steps=2", "log.progress=false",
                                                 "checkpoint.dir=s3://rekindle-unreachable/ckpt"]),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: cannot reach checkpoint storage s3://rekindle-unreachable/ckpt" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr


def test_retention_keeps_newest_and_milestones(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2, keep_every=3)
    model, opt = trained(0)
    (tmp_path / "step-00000000").mkdir(parents=True)  # an uncommitted leftover of a crashed save
    for step in range(1, 8):
        ckpt.save(TrainState(step=step), model, opt)
    assert ckpt.committed_steps() == [3, 6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000006", "step-00000007"]


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
    commit["sha256"] = _commit_digest(commit)
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
    commit["sha256"] = _commit_digest(commit)
    (step / COMMIT).write_text(json.dumps(commit))
    assert ckpt.discover_latest() == 1  # the forgery verifies...
    with pytest.raises(UnsafeCheckpointError, match=r"optim\.param_groups\.0\.lr is not plain data"):
        ckpt.load(1, *trained(1))  # ...but is refused at load
    assert not marker.exists()


def test_any_altered_byte_of_commit_json_is_detected(tmp_path):
    """COMMIT.json carries a checksum of its own content: a flipped bit that still parses (a size, a
    time, a name) is caught too."""
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=3)
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
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2)
    model, opt = trained(0)
    for step in (1, 2):
        ckpt.save(TrainState(step=step), model, opt)
    monkeypatch.setenv("REKINDLE_CRASH_AT", "write-error@3")
    with pytest.raises(CheckpointError, match="step 3 .* not committed: rank 0: .*No space left on device"):
        ckpt.save(TrainState(step=3), model, opt)
    assert ckpt.committed_steps() == [1, 2] and not (tmp_path / "step-00000003" / COMMIT).exists()
    monkeypatch.delenv("REKINDLE_CRASH_AT")
    ckpt.save(TrainState(step=3), model, opt)  # the leftover is cleared, the save succeeds, step 1 goes
    assert ckpt.committed_steps() == [2, 3]


def test_retention_after_a_fallback_keeps_the_steps_of_this_timeline(tmp_path):
    """Resumed from step 4 because step 6 is corrupt: retention counts only steps up to the one just
    committed (which it never deletes), and deletes step 6, the abandoned timeline, once 5 exists."""
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2)
    model, opt = trained(0)
    for step in (2, 4, 6):
        ckpt.save(TrainState(step=step), model, opt)
    corrupt(tmp_path / "step-00000006" / "__0_0.distcp", "flip")
    resumed = Checkpointer(str(tmp_path), SOLO, keep=2)
    assert resumed.discover_latest() == 4
    resumed.save(TrainState(step=5), model, opt)
    assert resumed.committed_steps() == [4, 5]  # was [5, 6]: the fallback gone, the corrupt step kept
    assert resumed.discover_latest() == 5


def test_all_newest_steps_unusable_then_fresh_saves_are_kept(tmp_path):
    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2)
    model, opt = trained(0)
    for step in (60, 80):
        ckpt.save(TrainState(step=step), model, opt)
    for step in (60, 80):
        corrupt(tmp_path / f"step-{step:08d}" / "__0_0.distcp", "flip")
    fresh = Checkpointer(str(tmp_path), SOLO, keep=2)
    assert fresh.discover_latest() is None
    for step in (10, 20, 30):
        fresh.save(TrainState(step=step), model, opt)
    assert fresh.committed_steps() == [20, 30] and fresh.discover_latest() == 30


def test_a_failure_after_the_commit_is_a_warning_not_a_failed_save(tmp_path, capsys):
    """Deleting old steps or recording the commit can fail (a bucket that forbids deletes): the step is
    committed all the same, and the save says so instead of 'not committed'."""
    def fail(*_):
        raise PermissionError("deletes are forbidden here")

    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2, on_commit=fail)
    ckpt.prune = fail
    model, opt = trained(0)
    for step in (1, 2, 3):
        ckpt.save(TrainState(step=step), model, opt)
    assert ckpt.committed_steps() == [1, 2, 3] and ckpt.discover_latest() == 3
    out = capsys.readouterr().out
    assert "step 3 is committed, but deleting old steps failed: PermissionError" in out
    assert "step 3 is committed, but recording the commit failed" in out


def test_a_file_that_cannot_be_read_falls_back_like_a_corrupt_one(tmp_path, monkeypatch, capsys):
    """An I/O error reading one shard (EIO, a bad sector: injected, as no real disk fails on demand) makes
    that step unusable; the run falls back to the previous step instead of crashing on every restart."""
    import errno

    ckpt = Checkpointer(str(tmp_path), SOLO, keep=2)
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
    ckpt = Checkpointer(str(tmp_path), SOLO, async_=True)
    model, opt = trained(0)
    ckpt.save(TrainState(step=1), model, opt, blocking=False)
    ckpt.wait()
    first = next(iter(opt.state.values()))
    first["max_exp_avg_sq"] = torch.zeros_like(first["exp_avg_sq"])  # as amsgrad=True would add
    ckpt.save(TrainState(step=2), model, opt, blocking=False)
    ckpt.wait()
    assert ckpt.committed_steps() == [1, 2]
    ckpt.close()


def test_async_write_error_is_raised_at_the_next_poll(tmp_path, monkeypatch):
    """In one process: once the background write has failed, the very next poll() (one per training
    step) raises; optimizer.step() is not left waiting for the copy."""
    monkeypatch.setenv("REKINDLE_CRASH_AT", "write-error@1")
    ckpt = Checkpointer(str(tmp_path), SOLO, async_=True)
    model, opt = trained(0)
    ckpt.save(TrainState(step=1), model, opt, blocking=False)
    assert "No space left" in str(ckpt._pending.future.exception(timeout=60))  # the write has failed
    opt.step()  # returns: the copy is done (the pre-step hook does not block)
    with pytest.raises(CheckpointError, match="step 1 .* background save failed: rank 0: OSError: .*No space left"):
        ckpt.poll()
    assert ckpt.committed_steps() == []
    ckpt.close()


STEPS = ["train.steps=12", "train.log_every=1", "train.eval_every=0", "checkpoint.every=4", "checkpoint.keep=5"]


@pytest.fixture(scope="module")
def two_rank_reference(cache_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref2")
    run_trainer(run_dir, STEPS, nproc=2)
    return run_dir


@pytest.mark.parametrize("point", ["shards@8:1", "commit@8:0"])
def test_rank_killed_during_save_resumes_from_previous_commit(two_rank_reference, tmp_path, point):
    """shards: rank 1 dies as the step-8 save starts while rank 0 writes; commit: rank 0 dies after
    every shard of step 8 is written but before COMMIT.json."""
    crashed = subprocess.run(trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *STEPS]), cwd=REPO,
                             env=child_env(REKINDLE_CRASH_AT=point), capture_output=True, text=True, timeout=180)
    assert crashed.returncode != 0 and "Signal 9 (SIGKILL)" in crashed.stderr + crashed.stdout
    assert not (tmp_path / "checkpoints" / "step-00000008" / COMMIT).exists()
    resumed = run_trainer(tmp_path, STEPS, nproc=2)
    assert "resumed from step 4 " in resumed.stdout
    ref, after = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [after[s]["loss"] for s in range(1, 13)] == [ref[s]["loss"] for s in range(1, 13)]


def test_async_saves_match_sync(two_rank_reference, tmp_path):
    run_trainer(tmp_path, [*STEPS, "checkpoint.async=true"], nproc=2)
    ref, got = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [got[s]["loss"] for s in got] == [ref[s]["loss"] for s in ref]
    names = lambda run: sorted(  # noqa: E731
        (p.parent.name, p.name) for p in (run / "checkpoints").rglob("*") if p.is_file() and p.name != COMMIT)
    assert names(tmp_path) == names(two_rank_reference)
    sync_state = json.loads((two_rank_reference / "checkpoints/step-00000008/train_state.json").read_text())
    async_state = json.loads((tmp_path / "checkpoints/step-00000008/train_state.json").read_text())
    sync_state.pop("config_sha256"), async_state.pop("config_sha256")  # the configs differ in checkpoint.async
    assert sync_state == async_state
    # the same tensors: load both step-8 checkpoints into one process (2 -> 1 resharding)
    models = []
    for run in (two_rank_reference, tmp_path):
        model, opt = smoke_model()
        Checkpointer(str(run / "checkpoints"), SOLO).load(8, model, opt)
        models.append((model, opt))
    assert_same(*models)


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resharded_resume_continues_the_same_run(two_rank_reference, cache_dir, tmp_path, first, second):
    """Save with `first` ranks, resume the step-4 checkpoint on `second` ranks: same samples, same
    losses within reduction-order tolerance. Step 12 has a bit flipped in the last rank's shard (on 2
    ranks, rank 1 verifies that file): every rank must agree to skip it."""
    run_trainer(tmp_path, STEPS, nproc=first)
    subprocess.run(["rm", "-rf", step_dir(str(tmp_path / "checkpoints"), 8)], check=True)
    corrupt(Path(step_dir(str(tmp_path / "checkpoints"), 12)) / f"__{first - 1}_0.distcp", "flip")
    proc = run_trainer(tmp_path, STEPS, nproc=second)
    assert f"step 12 is unusable, falling back: {tmp_path}/checkpoints/step-00000012/__{first - 1}_0.distcp fails" \
        in proc.stdout
    assert "resumed from step 4 " in proc.stdout and f"saved by {first} rank(s)" in proc.stdout
    ref, got = read_metrics(two_rank_reference), read_metrics(tmp_path)
    for step in range(5, 13):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=5e-4), step


def test_async_write_error_on_one_rank_stops_every_rank(two_rank_reference, tmp_path):
    """Rank 1's background write of step 8 fails (disk full): both ranks report it and the run exits
    nonzero right away, without committing step 8 and long before its next save (step 12)."""
    proc = subprocess.run(
        trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *STEPS, "checkpoint.async=true"]),
        cwd=REPO, env=child_env(REKINDLE_CRASH_AT="write-error@8:1"), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"[checkpoint] rank {rank}: error: checkpoint step 8 at {tmp_path}/checkpoints/step-00000008 was not "
                f"committed: background save failed: rank 1: OSError: [Errno 28] No space left on device") in out
    assert "error: checkpoint step 8" in proc.stderr  # the trainer's own last word
    assert not (tmp_path / "checkpoints" / "step-00000008" / COMMIT).exists()
    assert (tmp_path / "checkpoints" / "step-00000004" / COMMIT).exists()
    steps = read_metrics(tmp_path)
    assert 8 in steps and max(steps) < 12, sorted(steps)


def test_s3_run_killed_during_save_resumes_from_s3(two_rank_reference, s3_bucket, tmp_path):
    """checkpoint.dir on the loopback S3 server: rank 0 is SIGKILLed after every shard of step 8 is
    uploaded but before COMMIT.json; the restarted 2-rank run resumes from step 4 on S3 and reproduces
    the uninterrupted run's losses exactly; retention (keep=2) then leaves exactly steps 8 and 12."""
    import s3fs

    root = f"{s3_bucket}/run/ckpt"
    steps = [*STEPS, f"checkpoint.dir={root}", "checkpoint.keep=2"]
    crashed = subprocess.run(trainer_cmd(2, SMOKE, [f"run.dir={tmp_path}", "log.progress=false", *steps]), cwd=REPO,
                             env=child_env(REKINDLE_CRASH_AT="commit@8:0"), capture_output=True, text=True,
                             timeout=180)
    assert crashed.returncode != 0 and "Signal 9 (SIGKILL)" in crashed.stderr + crashed.stdout
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    assert fs.exists(f"{root}/step-00000008/__1_0.distcp") and not fs.exists(f"{root}/step-00000008/{COMMIT}")
    resumed = run_trainer(tmp_path, steps, nproc=2)
    assert f"resumed from step 4 ({root}/step-00000004, saved by 2 rank(s))" in resumed.stdout
    ref, after = read_metrics(two_rank_reference), read_metrics(tmp_path)
    assert [after[s]["loss"] for s in range(1, 13)] == [ref[s]["loss"] for s in range(1, 13)]
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["step-00000008", "step-00000012"]
    assert Checkpointer(root, SOLO).discover_latest() == 12


def test_reshard_gives_equal_parameters(tmp_path):
    """2 ranks (FSDP2) save; 1 process loads (2->1); that process saves; 2 ranks load it (1->2). Every
    parameter and AdamW moment equals the 2-rank original bit for bit (the worker asserts it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", str(Path(__file__)), "reshard-worker",
         str(tmp_path)],
        cwd=REPO, env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("2->1 equal") == 1 and proc.stdout.count("1->2 equal") == 2, proc.stdout


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, unsharded, by parameter name."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()  # noqa: E731
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param {n}": full(p) for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"{key} {names[id(p)]}": full(v) for key, v in st.items()})
    return out


def reshard_worker(root: Path) -> None:
    from trainer.config import DistConfig
    from trainer.parallel import init_distributed, parallelize

    info = init_distributed(DistConfig())
    model, opt = trained(0)  # identical on both ranks; then sharded and trained a little more
    model = parallelize(model, DistConfig(), info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    Checkpointer(str(root / "two"), info).save(TrainState(step=1), model, opt)
    want = full_state(model, opt)
    assert len(want) == 4 * len(list(model.parameters())) and want["step layers.0.attention.wq.weight"] == 2
    if info.rank == 0:  # 2 -> 1: a plain process (no process group needed by the checkpointer)
        single, single_opt = trained(5)
        Checkpointer(str(root / "two"), SOLO).load(1, single, single_opt)
        got = full_state(single, single_opt)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "2->1 differs"
        print("2->1 equal", flush=True)
        Checkpointer(str(root / "one"), SOLO).save(TrainState(step=1), single, single_opt)
    torch.distributed.barrier()
    fresh, _ = trained(7)  # 1 -> 2: different weights until loaded
    fresh = parallelize(fresh, DistConfig(), info)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    Checkpointer(str(root / "one"), info).load(1, fresh, fresh_opt)
    got = full_state(fresh, fresh_opt)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "1->2 differs"
    print(f"1->2 equal on rank {info.rank}", flush=True)


def test_save_failure_is_loud(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "file-not-dir"), SOLO)
    (tmp_path / "file-not-dir").write_text("in the way")
    with pytest.raises(CheckpointError, match="not committed"):
        ckpt.save(TrainState(step=1), *trained(0))


if __name__ == "__main__" and sys.argv[1:2] == ["reshard-worker"]:
    from trainer.parallel import shutdown

    reshard_worker(Path(sys.argv[2]))
    shutdown()  # after the FSDP modules are out of scope: see parallel.shutdown
