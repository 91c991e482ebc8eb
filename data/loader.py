"""BatchLoader: TokenStream batches produced by DataLoader worker processes, in the same order and with
the same exact state as calling `stream.next_batch()` in a loop.

Worker w of n produces this rank's batches number m (counted from where the loader started) with
m % n == w; torch's DataLoader hands the workers' outputs back round-robin, so the sequence is the same
for any number of workers (0 = no worker processes). Workers may prefetch ahead, but the state only
counts batches the caller has received: `state_dict()` after k batches equals the stream's state after
k calls of `next_batch()`, and a resume neither skips nor repeats a sample.

How workers start: local shards fork (fast, and nothing but memory-mapped files is used in the worker).
Remote shards use a fork server instead: s3fs/aiobotocore keep an event-loop thread, sockets and locks
that a fork would copy in whatever state they are in (a lock held by another thread at that moment stays
locked forever in the child). The fork server is a clean process started once, with data.loader and
torch already imported, so each worker still starts in milliseconds; it opens its own S3 connection.
"""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.shards import is_local
from data.stream import BatchWithPositions, TokenStream

START_METHODS = ("fork", "forkserver", "spawn")


def default_start_method(stream: TokenStream) -> str:
    """fork for local shards; forkserver for remote ones (fsspec clients are not fork-safe)."""
    return "fork" if is_local(stream.shards.fs) else "forkserver"


def _context(method: str, stream: TokenStream) -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Import torch, this module and the filesystem's client library (s3fs, botocore: seconds) once in
        # the server rather than in every worker; this only counts before the server first starts.
        # (Python 3.11's server never imports __main__, whatever it is told.)
        ctx.set_forkserver_preload(["data.loader", type(stream.shards.fs).__module__])
    return ctx


class _WorkerBatches(IterableDataset):
    """Batches start+w, start+w+n, ... of a private copy of the stream (w = this worker of n)."""

    def __init__(self, stream: TokenStream, start: int, with_positions: bool) -> None:
        self.stream, self.start, self.with_positions = stream, start, with_positions

    def __iter__(self) -> Iterator[torch.Tensor | BatchWithPositions]:
        info = get_worker_info()
        worker, n = (info.id, info.num_workers) if info else (0, 1)
        stream = copy.copy(self.stream)
        stream.shards = self.stream.shards.reopen()  # own file handles / S3 session in this process
        stream.state = copy.copy(self.stream.state)
        b = stream.global_batch
        m = worker
        while True:
            stream.state.samples_consumed = self.start + m * b
            batch = stream.next_batch()
            yield stream.with_positions(batch) if self.with_positions else batch
            m += n


@dataclass
class LoaderState:
    samples_consumed: int  # samples of the global stream the caller has received (all ranks)


class BatchLoader:
    """Iterate this rank's training batches with `num_workers` background processes (0 = in-process).

    `start_method`: how workers start (fork | forkserver | spawn); default fork for local shards and
    forkserver for remote ones (see the module docstring).

    Yields exactly what repeated `stream.next_batch()` would (or BatchWithPositions with with_positions=True),
    forever; keeps `stream.state` in step with what has been yielded, so `stream.state_dict()` and
    `loader.state_dict()` are the same thing and either can be checkpointed.
    """

    def __init__(self, stream: TokenStream, num_workers: int = 0, prefetch_factor: int = 2,
                 with_positions: bool = False, timeout_s: float = 300.0, start_method: str | None = None) -> None:
        self._it: Iterator | None = None  # first: __del__ runs even when a check below raises
        self._loader: DataLoader | None = None
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0; got {num_workers}")
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}; got {start_method!r}")
        self.stream, self.num_workers, self.prefetch_factor = stream, num_workers, prefetch_factor
        self.with_positions, self.timeout_s = with_positions, timeout_s
        self.start_method = start_method or default_start_method(stream)

    def _start(self) -> Iterator:
        if self.num_workers == 0:
            return iter(_WorkerBatches(self.stream, self.stream.state.samples_consumed, self.with_positions))
        self._loader = DataLoader(
            _WorkerBatches(self.stream, self.stream.state.samples_consumed, self.with_positions),
            batch_size=None, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
            persistent_workers=False, timeout=self.timeout_s,
            multiprocessing_context=_context(self.start_method, self.stream),
        )
        return iter(self._loader)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> torch.Tensor | BatchWithPositions:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self.stream.state.samples_consumed += self.stream.global_batch
        return batch

    def close(self) -> None:
        """Stop the worker processes (a later `next()` restarts them from the current state)."""
        it, self._it, self._loader = self._it, None, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the stream's position; prefetched batches are discarded and workers restart from it."""
        self.close()
        self.stream.load_state_dict(state)
