"""Exact resume: the loader restored from its state at any point (mid-window, on a shard-window
boundary, across an epoch boundary, twice in a row, at another world size) yields exactly the tokens
of an uninterrupted run, and every training sample appears exactly once per epoch for world sizes
1..4. Each test runs with the shards on local disk and in the loopback S3 bucket, and reads through
data.loader.BatchLoader in-process (num_workers=0) and with 2 worker processes per rank."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.loader import BatchLoader
from data.shards import ShardSet
from data.stream import BatchGeometry, TokenStream
from tests.helpers import upload

WHERE = ["local", "s3"]
WORKERS = [0, 2]


@pytest.fixture(params=WHERE)
def shards(request, local_dataset) -> ShardSet:
    if request.param == "local":
        return ShardSet(local_dataset.root)
    bucket = request.getfixturevalue("s3_bucket")
    return ShardSet(upload(local_dataset, f"{bucket}/ds"))


def make(shards, rank=0, world=1, batch=4, seed=3, window=2) -> TokenStream:  # seed 3: a window starts on a batch
    geometry = BatchGeometry(seq_len=16, global_batch=batch, rank=rank, world=world)
    return TokenStream(shards, geometry, seed=seed, val_fraction=0.05, shuffle_window=window)


@pytest.fixture
def loaders():
    """loaders(shards, world, workers, batch, state=None): one BatchLoader per rank, all closed at teardown."""
    opened: list[BatchLoader] = []

    def open_(shards, world: int, workers: int, batch: int = 4, state: dict | None = None) -> list[BatchLoader]:
        group = [BatchLoader(make(shards, r, world, batch), num_workers=workers, timeout_s=60) for r in range(world)]
        for loader in group:
            if state is not None:
                loader.load_state_dict(state)
        opened.extend(group)
        return group

    yield open_
    for loader in opened:
        loader.close()


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def global_batches(sources: list, n: int) -> list[np.ndarray]:
    """The next n global batches: each rank's slice, concatenated in rank order."""
    take = lambda s: s.next_batch() if isinstance(s, TokenStream) else next(s)  # noqa: E731
    return [np.concatenate([take(s).numpy() for s in sources]) for _ in range(n)]


def window_boundaries(s: TokenStream, epoch: int = 0) -> np.ndarray:
    """Stream positions where the order moves on to the next window of shards."""
    return s.window_starts(epoch)[1:]


def resume_points(s: TokenStream) -> dict[str, int]:
    """Batch numbers to resume at: mid-window, exactly on a window (shard) boundary, around the epoch end."""
    b = s.geometry.global_batch
    on_boundary = [int(p) // b for p in window_boundaries(s) if p % b == 0]
    assert on_boundary, "no window boundary falls on a batch boundary for this seed"
    epoch_end = s.n_train // b
    assert s.n_train % b, "the epoch should end inside a batch (a batch that straddles two epochs)"
    return {"start": 0, "mid": 3, "boundary": on_boundary[0], "straddle": epoch_end, "after_epoch": epoch_end + 1}


def test_windows_group_shards(shards):
    s = make(shards, window=2)
    order = s.sample_indices(0, s.n_train)
    assert sorted(order.tolist()) == list(range(s.n_train))
    cuts = [0, *window_boundaries(s).tolist(), s.n_train]
    assert len(cuts) > 3
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        # each window draws its samples from at most 2 shards (blocks), and reads no others
        assert len(np.unique(s.block_of(order[lo:hi]))) <= 2


POINTS = ["start", "mid", "boundary", "straddle", "after_epoch"]
# Every point with local shards in-process and with workers, and with S3 shards in-process; S3 shards with
# workers at the two points where a worker starts on a new window or in a new epoch (each S3 worker opens
# its own client and fetches its own shards: about a second per point against moto).
RESUME_CASES = [("local", p, w) for p in POINTS for w in WORKERS] + [("s3", p, 0) for p in POINTS] + [
    ("s3", "boundary", 2), ("s3", "straddle", 2)]


@pytest.mark.parametrize("shards, point, workers", RESUME_CASES, indirect=["shards"])
def test_resume_anywhere_matches_uninterrupted(shards, loaders, point, workers):
    ref = make(shards)
    k = resume_points(ref)[point]
    expected = global_batches([ref], k + 3)
    first = loaders(shards, 1, workers)
    global_batches(first, k)
    state = roundtrip(first[0].state_dict())
    first[0].close()
    got = global_batches(loaders(shards, 1, workers, state=state), 3)
    for a, b in zip(got, expected[k:], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("workers", WORKERS)
def test_resume_twice_in_a_row(shards, loaders, workers):
    ref = make(shards)
    expected = global_batches([ref], 12)
    current = loaders(shards, 1, workers)
    got = global_batches(current, 4)
    for _ in range(2):
        state = roundtrip(current[0].state_dict())
        current[0].close()
        current = loaders(shards, 1, workers, state=state)
        got += global_batches(current, 4)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("workers", WORKERS)
def test_resume_at_another_world_size_keeps_global_batches(shards, loaders, workers):
    ref = make(shards, batch=8)
    expected = global_batches([ref], 10)
    two = loaders(shards, 2, workers, batch=8)
    got = global_batches(two, 4)
    states = [roundtrip(s.state_dict()) for s in two]
    assert states[0] == states[1]  # the data state is identical on every rank
    four = loaders(shards, 4, workers, batch=8, state=states[0])
    got += global_batches(four, 3)
    back = loaders(shards, 2, workers, batch=8, state=roundtrip(four[0].state_dict()))  # and back down to 2
    got += global_batches(back, 3)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def rows(a: np.ndarray) -> list[tuple]:
    return sorted(map(tuple, a.tolist()))


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_exactly_once_per_epoch(shards, loaders, world, workers):
    s = make(shards, batch=12)
    everything = rows(np.stack([shards.read(i * 16, 17) for i in range(s.n_train)]))
    assert s.n_train % 12, "an epoch should end inside a batch"
    # two epochs in one go: batch n_train // 12 straddles them
    seen = np.concatenate(global_batches(loaders(shards, world, workers, batch=12), 2 * s.n_train // 12 + 1))
    for epoch in range(2):
        assert rows(seen[epoch * s.n_train : (epoch + 1) * s.n_train]) == everything
