"""TokenStream: a stateless global sample order, sliced by rank, packed into training batches.

Sample i is tokens[i*L : i*L + L + 1] of the concatenated stream (inputs = first L, targets = last L).
The last `val_fraction` of samples are held out for evaluation; the rest form the training set.
The order of epoch e is a permutation that depends only on (seed, e); the infinite training stream
is epoch 0's order, then epoch 1's, and so on. Global batch b is stream positions [b*B, (b+1)*B);
rank r of W takes the contiguous slice [r*B/W, (r+1)*B/W) of it. The whole state is one integer,
samples consumed, so any world size with the same global batch resumes the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.shards import ShardSet


class DataStateError(ValueError):
    """A saved data state that does not fit this dataset or batch layout."""


@dataclass
class StreamState:
    samples_consumed: int = 0


class TokenStream:
    def __init__(
        self,
        shards: ShardSet,
        seq_len: int,
        global_batch: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        val_fraction: float = 0.01,
    ) -> None:
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world}")
        self.shards, self.seq_len, self.global_batch = shards, seq_len, global_batch
        self.seed, self.rank, self.world = seed, rank, world
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
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world

    @property
    def epoch(self) -> int:
        return self.state.samples_consumed // self.n_train

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._order_epoch = rng.permutation(self.n_train), epoch
        return self._order

    def _samples(self, indices: np.ndarray) -> torch.Tensor:
        rows = [self.shards.read(int(i) * self.seq_len, self.seq_len + 1) for i in indices]
        return torch.from_numpy(np.stack(rows))

    def sample_indices(self, position: int, count: int) -> np.ndarray:
        """Sample ids at positions [position, position + count) of the infinite training stream."""
        positions = np.arange(position, position + count)
        indices = np.empty_like(positions)
        for epoch in np.unique(positions // self.n_train):
            mask = positions // self.n_train == epoch
            indices[mask] = self._epoch_order(int(epoch))[positions[mask] % self.n_train]
        return indices

    def next_batch(self) -> torch.Tensor:
        """This rank's slice of the next global batch: (global_batch / world, seq_len + 1) int64."""
        indices = self.sample_indices(self.state.samples_consumed + self.rank * self.local_batch, self.local_batch)
        self.state.samples_consumed += self.global_batch
        return self._samples(indices)

    def val_batch(self, j: int) -> torch.Tensor:
        """This rank's slice of held-out batch j (a fixed set, cycled if the split is small)."""
        if self.n_val == 0:
            raise ValueError("no held-out samples: data.val_fraction is 0")
        start = j * self.global_batch + self.rank * self.local_batch
        positions = np.arange(start, start + self.local_batch) % self.n_val
        return self._samples(self.n_train + positions)

    def state_dict(self) -> dict:
        return {
            "samples_consumed": self.state.samples_consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "manifest_sha256": self.shards.manifest.sha256(),
        }

    def load_state_dict(self, state: dict) -> None:
        expected = self.state_dict()
        for key in ("seed", "seq_len", "manifest_sha256"):
            if state.get(key) != expected[key]:
                raise DataStateError(
                    f"saved data state has {key}={state.get(key)!r}, this run has {expected[key]!r}: "
                    "the dataset or its order changed since the checkpoint"
                )
        consumed = int(state["samples_consumed"])
        if consumed % self.global_batch:
            raise DataStateError(
                f"saved data state consumed {consumed} samples, not a multiple of the global batch "
                f"{self.global_batch}: the global batch changed since the checkpoint"
            )
        self.state = StreamState(samples_consumed=consumed)
