"""Exact resume: a TokenStream restored from its state at any point (mid-window, on a shard-window
boundary, across an epoch boundary, twice in a row, at another world size) yields exactly the tokens
of an uninterrupted run, and every training sample appears exactly once per epoch for world sizes
1..4. Each test runs with the shards on local disk and in the loopback S3 bucket."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_data_s3 import local_dataset, upload  # noqa: F401  (module fixture reused here)

from data.shards import ShardSet
from data.stream import TokenStream

WHERE = ["local", "s3"]


@pytest.fixture(params=WHERE)
def shards(request, local_dataset) -> ShardSet:  # noqa: F811
    if request.param == "local":
        return ShardSet(local_dataset.root)
    bucket = request.getfixturevalue("s3_bucket")
    return ShardSet(upload(local_dataset, f"{bucket}/ds"))


def make(shards, rank=0, world=1, batch=4, seed=3, window=2) -> TokenStream:  # seed 3: a window starts on a batch
    return TokenStream(shards, seq_len=16, global_batch=batch, seed=seed, rank=rank, world=world,
                       val_fraction=0.05, shuffle_window=window)


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def global_batches(streams: list[TokenStream], n: int) -> list[np.ndarray]:
    return [np.concatenate([s.next_batch().numpy() for s in streams]) for _ in range(n)]


def window_boundaries(s: TokenStream, epoch: int = 0) -> np.ndarray:
    """Stream positions where the order moves on to the next window of shards."""
    return s.window_starts(epoch)[1:]


def resume_points(s: TokenStream) -> dict[str, int]:
    """Batch numbers to resume at: mid-window, exactly on a window (shard) boundary, around the epoch end."""
    b = s.global_batch
    on_boundary = [int(p) // b for p in window_boundaries(s) if p % b == 0]
    assert on_boundary, "no window boundary falls on a batch boundary for this seed"
    epoch_end = s.n_train // b
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


@pytest.mark.parametrize("point", ["start", "mid", "boundary", "straddle", "after_epoch"])
def test_resume_anywhere_matches_uninterrupted(shards, point):
    ref = make(shards)
    k = resume_points(ref)[point]
    expected = global_batches([ref], k + 3)
    first = make(shards)
    global_batches([first], k)
    resumed = make(shards)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    got = global_batches([resumed], 3)
    for a, b in zip(got, expected[k:], strict=True):
        assert np.array_equal(a, b)


def test_resume_twice_in_a_row(shards):
    ref = make(shards)
    expected = global_batches([ref], 12)
    s = make(shards)
    got = global_batches([s], 4)
    for _ in range(2):
        state = roundtrip(s.state_dict())
        s = make(shards)
        s.load_state_dict(state)
        got += global_batches([s], 4)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_resume_at_another_world_size_keeps_global_batches(shards):
    ref = make(shards, batch=8)
    expected = global_batches([ref], 10)
    two = [make(shards, r, 2, batch=8) for r in range(2)]
    got = global_batches(two, 4)
    states = [roundtrip(s.state_dict()) for s in two]
    assert states[0] == states[1]  # the data state is identical on every rank
    four = [make(shards, r, 4, batch=8) for r in range(4)]
    for s in four:
        s.load_state_dict(states[0])
    got += global_batches(four, 3)
    back = [make(shards, r, 2, batch=8) for r in range(2)]  # and back down to 2
    for s in back:
        s.load_state_dict(roundtrip(four[0].state_dict()))
    got += global_batches(back, 3)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def rows(a: np.ndarray) -> list[tuple]:
    return sorted(map(tuple, a.tolist()))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_exactly_once_per_epoch(shards, world):
    streams = [make(shards, r, world, batch=12) for r in range(world)]
    s = streams[0]
    everything = np.stack([shards.read(i * 16, 17) for i in range(s.n_train)])
    for epoch in range(2):
        start = epoch * s.n_train
        first, last = start // 12, (start + s.n_train - 1) // 12
        for st in streams:
            st.load_state_dict({**st.state_dict(), "samples_consumed": first * 12})
        seen = np.concatenate(global_batches(streams, last - first + 1))
        lo = start - first * 12
        assert rows(seen[lo : lo + s.n_train]) == rows(everything)
