"""TokenStream: a stateless global sample order, sliced by rank, packed into training batches.

Sample i is tokens[i*L : i*L + L + 1] of the concatenated stream (inputs = first L, targets = last L).
The last `val_fraction` of samples are held out for evaluation; the rest form the training set.
The order of epoch e is a permutation that depends only on (seed, e) (and the dataset and L); the
infinite training stream is epoch 0's order, then epoch 1's, and so on.

The order is block-shuffled so that reads stay local: a training sample belongs to the block of the
shard its first token lies in; epoch e permutes the blocks, cuts the permuted list into windows of
`shuffle_window` blocks, and fully shuffles the samples inside each window. At any moment only the
shards of one window (about 2 x shuffle_window) are being read, which a small shard cache holds.
Only the window being read is ever materialised (its shuffle seeded by (seed, epoch, window)), so
the cost of starting or resuming at any point is that of one window, not of the epoch or the offset.

Global batch b is stream positions [b*B, (b+1)*B); rank r of W takes the contiguous slice
[r*B/W, (r+1)*B/W) of it. The whole state is one integer, samples consumed, so any world size with the
same global batch resumes the same global batches (the saved state also records the seed, sequence
length, order, manifest hash and number of training samples, and a resume checks them).
data.loader adds worker processes on top.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from data.shards import ShardSet

ORDER = "block-window-v2"  # name of the sample order scheme, recorded in the data state


class DataStateError(ValueError):
    """A saved data state that does not fit this dataset or batch layout."""


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids for (B, T) tokens: 0 at the start of each row and right after each EOS, else +1.
    Computed on the tokens' device (evaluation passes batches already on the GPU)."""
    if tokens.dim() != 2:
        raise ValueError(f"expected a (batch, time) tensor; got shape {tuple(tokens.shape)}")
    b, t = tokens.shape
    idx = torch.arange(t, dtype=torch.int64, device=tokens.device).expand(b, t)
    starts = torch.zeros((b, t), dtype=torch.bool, device=tokens.device)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos_id
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - last_start


@dataclass
class BatchWithPositions:
    """A training batch plus its document-boundary data, all aligned with the inputs tokens[:, :-1].

    positions: (B, L) int64, 0 at each row start and after each EOS (for RoPE / position embeddings).
    loss_mask: (B, L) bool, False where the input token is EOS, i.e. where the target is the first token of
               the next document, which nothing in the (document-masked) context predicts.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    loss_mask: torch.Tensor


@dataclass(frozen=True)
class BatchGeometry:
    """How the training stream is cut into this rank's batches: samples of `seq_len` + 1 tokens, global
    batches of `global_batch` samples, of which rank `rank` of `world` takes a contiguous slice of
    `local_batch` samples. Fixed for a stream's life."""

    seq_len: int
    global_batch: int
    rank: int = 0
    world: int = 1

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world


@dataclass
class StreamState:
    """Where the stream is: the global training samples consumed so far (the data state's position), and the
    stretches of the stream the run skipped (positions [first, end): a step's update not applied because its
    data made the loss spike, trainer.health)."""

    samples_consumed: int = 0
    skipped: list[list[int]] = field(default_factory=list)


class TokenStream:
    """This rank's view of the global training order (see the module docstring): fixed, its `geometry` (how
    the stream is cut into this rank's batches), the seed of its order and the held-out split (`n_val`
    samples of every `val_fraction`, the rest `n_train`); changing, its position (`state`).

    `shuffle_window` blocks (shards) are mixed at a time; keep the ShardSet's `cache_shards` at least
    2 x shuffle_window for remote data so each shard is fetched about once per epoch.
    """

    def __init__(self, shards: ShardSet, geometry: BatchGeometry, seed: int, val_fraction: float = 0.01,
                 shuffle_window: int = 4) -> None:
        seq_len, global_batch = geometry.seq_len, geometry.global_batch
        if shuffle_window < 1:
            raise ValueError(f"shuffle_window must be at least 1 block; got {shuffle_window}")
        if global_batch % geometry.world:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {geometry.world}")
        self.shards, self.geometry, self.seed = shards, geometry, seed
        self.manifest_sha256 = shards.manifest.sha256()  # in every state_dict (each memory snapshot's)
        n_samples = (len(shards) - 1) // seq_len
        self.n_val = int(n_samples * val_fraction) if val_fraction > 0 else 0
        if val_fraction > 0:
            self.n_val = max(self.n_val, 1)
        self.n_train = n_samples - self.n_val
        if self.n_train < global_batch:
            raise ValueError(
                f"dataset {shards.root} has {self.n_train} training samples of {seq_len + 1} tokens, "
                f"fewer than one global batch ({global_batch}); use more data or a smaller batch"
            )
        self.state = StreamState()
        self.shuffle_window = shuffle_window
        # Block b (shard b) holds the training samples [first[b], first[b+1]): those whose first token
        # i * seq_len lies in shard b, i.e. i >= ceil(start of shard b / seq_len).
        self._block_first = np.minimum(-(-shards.starts // seq_len), self.n_train)
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # epoch -> (blocks, window starts)
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()  # a few recent windows

    @property
    def epoch(self) -> int:
        return self.state.samples_consumed // self.n_train

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks in epoch order, first stream offset of each window plus the end): O(number of shards)."""
        layout = self._layouts.get(epoch)
        if layout is None:
            blocks = np.random.default_rng([self.seed, epoch]).permutation(len(self._block_first) - 1)
            sizes = np.diff(self._block_first)[blocks]
            window_sizes = np.add.reduceat(sizes, np.arange(0, len(blocks), self.shuffle_window))
            layout = blocks, np.concatenate([[0], np.cumsum(window_sizes)])
            self._layouts = {e: v for e, v in self._layouts.items() if abs(e - epoch) == 1}  # a batch may straddle
            self._layouts[epoch] = layout
        return layout

    def _window(self, epoch: int, window: int) -> np.ndarray:
        """Sample ids of one window in their shuffled order: a pure function of (seed, epoch, window)."""
        order = self._windows.get((epoch, window))
        if order is None:
            blocks, _ = self._layout(epoch)
            mine = np.sort(blocks[window * self.shuffle_window : (window + 1) * self.shuffle_window])
            ids = np.concatenate([np.arange(self._block_first[b], self._block_first[b + 1]) for b in mine])
            order = ids[np.random.default_rng([self.seed, epoch, window]).permutation(len(ids))]
            self._windows[(epoch, window)] = order
            while len(self._windows) > 4:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end((epoch, window))
        return order

    def window_starts(self, epoch: int) -> np.ndarray:
        """Offsets inside epoch `epoch` where each window of shards begins (ascending; the first is 0)."""
        return self._layout(epoch)[1][:-1]

    def block_of(self, sample_ids: np.ndarray) -> np.ndarray:
        """The block (shard) each training sample belongs to: the shard of its first token."""
        return np.asarray(self.shards.shard_of(np.asarray(sample_ids, dtype=np.int64) * self.geometry.seq_len))

    def _samples(self, indices: np.ndarray) -> torch.Tensor:
        seq_len = self.geometry.seq_len
        rows = [self.shards.read(int(i) * seq_len, seq_len + 1) for i in indices]
        return torch.from_numpy(np.stack(rows))

    def sample_indices(self, position: int, count: int) -> np.ndarray:
        """Sample ids at positions [position, position + count) of the infinite training stream."""
        positions = np.arange(position, position + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n_train)
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):
            in_epoch = np.flatnonzero(epochs == epoch)
            starts = self._layout(int(epoch))[1]
            windows = np.searchsorted(starts, offsets[in_epoch], side="right") - 1
            for window in np.unique(windows):
                at = in_epoch[windows == window]
                indices[at] = self._window(int(epoch), int(window))[offsets[at] - starts[window]]
        return indices

    def next_batch(self) -> torch.Tensor:
        """This rank's slice of the next global batch: (global_batch / world, seq_len + 1) int64."""
        g = self.geometry
        position = self.state.samples_consumed + g.rank * g.local_batch
        indices = self.sample_indices(position, g.local_batch)
        self.state.samples_consumed += g.global_batch
        return poisoned(self._samples(indices), position, self.shards.manifest.vocab_size)

    def last_batch(self) -> tuple[int, int]:
        """The stream positions [first, end) of the global batch handed out last."""
        end = self.state.samples_consumed
        return end - self.geometry.global_batch, end

    def skip(self, first: int, end: int) -> None:
        """Record that the run skipped the stream's positions [first, end) (kept in the data state)."""
        if [first, end] not in self.state.skipped:
            self.state.skipped.append([first, end])

    def was_skipped(self, first: int, end: int) -> bool:
        """Whether the run skipped the positions [first, end) before (a step replayed after a resume)."""
        return [first, end] in self.state.skipped

    def positions(self, batch: torch.Tensor) -> torch.Tensor:
        """Position ids (B, seq_len) for the inputs batch[:, :-1]: reset to 0 after every EOS."""
        return document_positions(batch[:, :-1], self.shards.manifest.eos_id)

    def loss_mask(self, batch: torch.Tensor) -> torch.Tensor:
        """(B, seq_len) bool: False for targets that start a new document (the input token is EOS)."""
        return batch[:, :-1] != self.shards.manifest.eos_id

    def with_positions(self, batch: torch.Tensor) -> BatchWithPositions:
        return BatchWithPositions(batch, self.positions(batch), self.loss_mask(batch))

    def next_batch_with_positions(self) -> BatchWithPositions:
        """next_batch() plus position ids and loss mask (advances the stream exactly like next_batch)."""
        return self.with_positions(self.next_batch())

    def val_batch(self, j: int) -> torch.Tensor:
        """This rank's slice of held-out batch j (a fixed set, cycled if the split is small)."""
        if self.n_val == 0:
            raise ValueError("no held-out samples: data.val_fraction is 0")
        g = self.geometry
        start = j * g.global_batch + g.rank * g.local_batch
        positions = np.arange(start, start + g.local_batch) % self.n_val
        return self._samples(self.n_train + positions)

    def state_dict(self) -> dict:
        return {
            "samples_consumed": self.state.samples_consumed,
            "seed": self.seed,
            "global_batch": self.geometry.global_batch,
            "seq_len": self.geometry.seq_len,
            "order": f"{ORDER}/{self.shuffle_window}",
            "manifest_sha256": self.manifest_sha256,
            "n_train": self.n_train,  # set by data.val_fraction: the epoch length and the held-out samples
            "epoch": self.epoch,
            "skipped": [list(r) for r in self.state.skipped],
        }

    def load_state_dict(self, state: dict) -> None:
        expected = self.state_dict()
        for key in ("seed", "seq_len", "order", "manifest_sha256"):
            if state.get(key) != expected[key]:
                raise DataStateError(
                    f"saved data state has {key}={state.get(key)!r}, this run has {expected[key]!r}: "
                    "the dataset or its order changed since the checkpoint"
                )
        if "n_train" in state and state["n_train"] != self.n_train:  # (states saved before it was recorded: unchecked)
            raise DataStateError(
                f"saved data state has {state['n_train']} training samples, this run {self.n_train}: "
                "data.val_fraction changed since the checkpoint (the sample order would change, and samples "
                "already trained on would be held out for evaluation)"
            )
        consumed = int(state["samples_consumed"])
        if consumed % self.geometry.global_batch:
            raise DataStateError(
                f"saved data state consumed {consumed} samples, not a multiple of the global batch "
                f"{self.geometry.global_batch}: the global batch changed since the checkpoint"
            )
        self.state = StreamState(samples_consumed=consumed, skipped=[list(r) for r in state.get("skipped", [])])


POISON_ENV = "REKINDLE_POISON"  # test-only: "first-last", stream positions whose samples are random tokens


def poisoned(rows: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """`rows` (samples at stream positions position, position + 1, ...) with those REKINDLE_POISON names
    replaced by random tokens, seeded by their position (the same in every run, on any number of ranks): a
    poisoned stretch of data for the tests. A no-op without the variable."""
    value = os.environ.get(POISON_ENV, "")
    if not value:
        return rows
    first, _, last = value.partition("-")
    for i in range(rows.shape[0]):
        if int(first) <= position + i <= int(last or first):
            rng = np.random.default_rng([position + i, 7])
            rows[i] = torch.from_numpy(rng.integers(0, vocab_size, size=rows.shape[1])).to(rows.dtype)
    return rows
