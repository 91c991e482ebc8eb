"""BatchLoader (data.loader): worker processes give exactly the batches of repeated next_batch(), for
any number of workers, and its state after k batches resumes without skipping or repeating samples
even though workers had prefetched further. Document boundaries: the loss mask drops targets that
start a new document, read in-process and by workers (position ids alone:
tests/unit/test_data_positions.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data.loader import BatchLoader
from data.shards import ShardSet
from data.stream import BatchGeometry, TokenStream
from tests.helpers import upload


def make(shards, rank=0, world=1, batch=4) -> TokenStream:
    geometry = BatchGeometry(seq_len=16, global_batch=batch, rank=rank, world=world)
    return TokenStream(shards, geometry, seed=5, val_fraction=0.05)


def take(it, n: int) -> list[np.ndarray]:
    return [next(it).numpy() for _ in range(n)]


@pytest.mark.parametrize("world, rank", [(1, 0), (2, 1)])
def test_workers_yield_the_same_batches_as_next_batch(local_dataset, world, rank):
    ref = make(local_dataset, rank, world)
    expected = [ref.next_batch().numpy() for _ in range(9)]
    for workers in (0, 2):
        with BatchLoader(make(local_dataset, rank, world), num_workers=workers) as loader:
            got = take(loader, 9)
            assert loader.state_dict() == ref.state_dict()
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), workers


def test_resume_after_prefetch_neither_skips_nor_repeats(local_dataset):
    ref = make(local_dataset)
    expected = [ref.next_batch().numpy() for _ in range(12)]
    loader = BatchLoader(make(local_dataset), num_workers=2, prefetch_factor=4)
    got = take(loader, 5)  # the workers have prefetched well past batch 5 by now
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert state["samples_consumed"] == 5 * 4
    resumed = BatchLoader(make(local_dataset), num_workers=2)
    resumed.load_state_dict(state)
    got += take(resumed, 4)
    plain = make(local_dataset)  # the loader's state also resumes plain next_batch()
    plain.load_state_dict(resumed.state_dict())
    got += [plain.next_batch().numpy() for _ in range(3)]
    # a load_state_dict on a running loader rewinds it, discarding its prefetched batches
    resumed.load_state_dict(state)
    assert np.array_equal(next(resumed).numpy(), expected[5])
    resumed.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_workers_read_s3_shards(local_dataset, s3_bucket):
    """Remote shards: workers come from a fork server (not a fork of this process, whose s3fs client has an
    event-loop thread and open connections), open their own S3 client and read the loopback bucket."""
    remote = ShardSet(upload(local_dataset, f"{s3_bucket}/ds"))
    remote.read(0, 5000)  # this process's S3 client is live (loop thread, connection pool) when workers start
    ref = make(local_dataset)
    expected = [ref.next_batch().numpy() for _ in range(8)]
    with BatchLoader(make(remote), num_workers=2, timeout_s=60) as loader:
        assert loader.start_method == "forkserver"
        got = take(loader, 6)
        state = loader.state_dict()
    with BatchLoader(make(remote), num_workers=2, timeout_s=60) as resumed:  # and resumes from S3 too
        resumed.load_state_dict(state)
        got += take(resumed, 2)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert BatchLoader(make(local_dataset), num_workers=2).start_method == "fork"  # local shards: plain fork
    with pytest.raises(ValueError, match="start_method"):
        BatchLoader(make(remote), num_workers=2, start_method="threads")


def test_workers_read_in_memory_shards(local_dataset):
    """memory:// lives in this process: workers must be forks of it to see the files."""
    url = upload(local_dataset, f"memory://loader-test-{id(local_dataset)}/ds")
    ref = make(local_dataset)
    expected = [ref.next_batch().numpy() for _ in range(5)]
    with BatchLoader(make(ShardSet(url)), num_workers=2, timeout_s=60) as loader:
        assert loader.start_method == "fork"
        got = take(loader, 5)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_stream_positions_and_loss_mask_follow_documents(local_dataset):
    s = make(local_dataset, batch=8)
    eos = local_dataset.manifest.eos_id
    ref = make(local_dataset, batch=8).next_batch()
    b = s.next_batch_with_positions()
    assert torch.equal(b.tokens, ref) and s.state.samples_consumed == 8  # same batch, same advance
    x = b.tokens[:, :-1]
    assert b.positions.shape == b.loss_mask.shape == x.shape == (8, 16)
    assert (x == eos).any(), "the fixture's documents are short: every batch has boundaries"
    for row, pos, mask in zip(x.tolist(), b.positions.tolist(), b.loss_mask.tolist(), strict=True):
        expect, p = [], 0
        for t, tok in enumerate(row):
            expect.append(p)
            p = 0 if tok == eos else p + 1
            assert mask[t] == (tok != eos)
        assert pos == expect
    ref = make(local_dataset, batch=8)
    with BatchLoader(make(local_dataset, batch=8), num_workers=2, with_positions=True) as loader:
        assert loader.group > 1  # several batches per message from a worker: cross a few groups below
        for _ in range(3 * loader.group):
            got, want = next(loader), ref.next_batch_with_positions()
            for name in ("tokens", "positions", "loss_mask"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_a_corrupt_shard_read_by_a_worker_is_named(local_dataset, tmp_path):
    import shutil

    from data.shards import ShardError

    shutil.copytree(local_dataset.root, tmp_path / "copy")
    shard = tmp_path / "copy" / "shard-00003.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x10
    shard.write_bytes(bytes(data))
    loader = BatchLoader(make(ShardSet(str(tmp_path / "copy"))), num_workers=2, timeout_s=60)
    with pytest.raises(ShardError, match=r"shard-00003\.bin fails its checksum"):
        for _ in range(400):  # the first epoch reads every shard
            next(loader)
    loader.close()


def test_workers_die_with_a_killed_rank(local_dataset):
    """A SIGKILLed rank never stops its workers; they must not outlive it (a worker blocked sending into
    a pipe nobody reads would otherwise hang forever, holding memory and the job's stderr)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO

    code = (
        "import sys, time\n"
        "from data.loader import BatchLoader\nfrom data.shards import ShardSet\n"
        "from data.stream import BatchGeometry, TokenStream\n"
        f"s = TokenStream(ShardSet({local_dataset.root!r}), BatchGeometry(seq_len=16, global_batch=4), seed=5, "
        "val_fraction=0.05)\n"
        "loader = BatchLoader(s, num_workers=2)\nnext(loader)\n"
        "print(*[w.pid for w in loader._it._workers], flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 3  # torch's own parent check alone takes 5 s or never ends
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in workers if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
        assert not alive, f"workers {alive} outlived their killed parent"
    finally:
        proc.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
