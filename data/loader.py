"""BatchLoader: TokenStream batches produced by DataLoader worker processes, in the same order and with
the same exact state as calling `stream.next_batch()` in a loop.

Worker w of n produces this rank's batches in groups of g consecutive ones, group j when j % n == w
(counted from where the loader started); torch's DataLoader hands the workers' outputs back
round-robin, so the sequence is the same for any number of workers (0 = no worker processes).
Workers may prefetch ahead, but the state only counts batches the caller has received:
`state_dict()` after k batches equals the stream's state after k calls of `next_batch()`, and a
resume neither skips nor repeats a sample.

How workers start: local shards fork (fast, and nothing but memory-mapped files is used in the worker), and
so do memory:// ones (only a fork has a copy of this process's in-memory files).
Remote shards use a fork server instead: s3fs/aiobotocore keep an event-loop thread, sockets and locks
that a fork would copy in whatever state they are in (a lock held by another thread at that moment stays
locked forever in the child). The fork server is a clean process started once, with data.loader and
torch already imported, so each worker still starts in milliseconds; it opens its own S3 connection.
"""

from __future__ import annotations

import copy
import multiprocessing
import signal
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.process import die_with_parent
from common.storage import is_local, protocols
from data.stream import BatchWithPositions, TokenStream

START_METHODS = ("fork", "forkserver", "spawn")
MESSAGE_TOKENS = 1 << 16  # a worker sends batches in groups of at least this many tokens (up to 16 batches)


def default_start_method(stream: TokenStream) -> str:
    """fork for local shards and for memory:// (which lives in this process: only a fork's copy has the
    files); forkserver for remote ones (fsspec clients are not fork-safe)."""
    fs = stream.shards.fs
    return "fork" if is_local(fs) or "memory" in protocols(fs) else "forkserver"


def _context(method: str, stream: TokenStream) -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Import torch, this module and the filesystem's client library (s3fs, botocore: seconds) once in
        # the server rather than in every worker; this only counts before the server first starts.
        # (Python 3.11's server never imports __main__, whatever it is told.)
        ctx.set_forkserver_preload(["data.loader", type(stream.shards.fs).__module__])
    return ctx


class _WorkerBatches(IterableDataset):
    """Groups of `group` consecutive batches of a private copy of the stream: group j = batches
    start + j*group ... start + j*group + group - 1 (counted in global batches), for j = w, w+n, ...
    (w = this worker of n). Each batch is a tuple of numpy arrays: (tokens,) or (tokens, positions, mask)."""

    def __init__(self, stream: TokenStream, start: int, with_positions: bool, group: int = 1) -> None:
        self.stream, self.start, self.with_positions, self.group = stream, start, with_positions, group

    def __iter__(self) -> Iterator[list[tuple[np.ndarray, ...]]]:
        info = get_worker_info()
        worker, n = (info.id, info.num_workers) if info else (0, 1)
        stream = copy.copy(self.stream)
        stream.shards = self.stream.shards.reopen()  # own file handles / S3 session in this process
        stream.state = copy.copy(self.stream.state)
        j = worker
        while True:
            stream.state.samples_consumed = self.start + j * self.group * stream.geometry.global_batch
            out = []
            for _ in range(self.group):
                tokens = stream.next_batch()
                if self.with_positions:
                    out.append((tokens.numpy(), stream.positions(tokens).numpy(), stream.loss_mask(tokens).numpy()))
                else:
                    out.append((tokens.numpy(),))
            yield out
            j += n


def _die_with_parent(worker_id: int) -> None:
    """worker_init_fn: ignore SIGTERM, and get SIGKILLed when the parent dies (Linux). A rank that is
    killed never tells its workers to stop, and a worker blocked sending a batch into a pipe nobody
    reads would never exit: it would hold its memory and the job's stdout/stderr open forever."""
    # SIGTERM (Slurm sends it to every process) is for the rank to act on: it finishes its step and saves.
    # A worker that died of it first would make the rank's DataLoader raise in the middle of that.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The OS parent is the rank (fork) or the fork server, which exits when the rank does.
    parent = multiprocessing.parent_process()  # the rank, whatever the start method
    die_with_parent(lambda: parent is None or parent.is_alive())


def _as_is(batch: list[tuple[np.ndarray, ...]]) -> list[tuple[np.ndarray, ...]]:
    """collate_fn: keep numpy arrays, which pickle by value (one memcpy); torch tensors would cross to
    the main process through a shared-memory segment and file descriptor per tensor, a fixed cost per
    tensor that outweighs pickling a batch's bytes by value (docs/performance.md, "Data loading and
    checkpoint I/O")."""
    return batch


def _to_torch(arrays: tuple[np.ndarray, ...]) -> torch.Tensor | BatchWithPositions:
    tensors = [torch.from_numpy(a) for a in arrays]
    return tensors[0] if len(tensors) == 1 else BatchWithPositions(*tensors)


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
        self._ready: deque[tuple[np.ndarray, ...]] = deque()  # received, not yet handed out
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0; got {num_workers}")
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}; got {start_method!r}")
        self.stream, self.num_workers, self.prefetch_factor = stream, num_workers, prefetch_factor
        self.with_positions, self.timeout_s = with_positions, timeout_s
        self.start_method = start_method or default_start_method(stream)
        # Batches per message from a worker: enough tokens that the fixed per-message cost (pickling,
        # pipe and wake-ups; docs/performance.md, "Data loading and checkpoint I/O") stays small next
        # to the data; 1 without workers.
        tokens = stream.geometry.local_batch * (stream.geometry.seq_len + 1)
        self.group = 1 if num_workers == 0 else max(1, min(16, -(-MESSAGE_TOKENS // tokens)))

    def _start(self) -> Iterator:
        batches = _WorkerBatches(self.stream, self.stream.state.samples_consumed, self.with_positions, self.group)
        if self.num_workers == 0:
            return iter(batches)
        self._loader = DataLoader(
            batches,
            batch_size=None, collate_fn=_as_is, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
            persistent_workers=False, timeout=self.timeout_s, worker_init_fn=_die_with_parent,
            multiprocessing_context=_context(self.start_method, self.stream),
        )
        return iter(self._loader)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> torch.Tensor | BatchWithPositions:
        if self._it is None:
            self._it = self._start()
        if not self._ready:
            self._ready.extend(next(self._it))
        batch = _to_torch(self._ready.popleft())
        self.stream.state.samples_consumed += self.stream.geometry.global_batch
        return batch

    def close(self) -> None:
        """Stop the worker processes (a later `next()` restarts them from the current state)."""
        it, self._it, self._loader = self._it, None, None
        self._ready.clear()
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
