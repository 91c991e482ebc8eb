"""Async saves: a background thread copies the state into a reused CPU buffer, then writes it, while
training goes on. Until the copy is done the tensors must not change, so `optimizer.step()` (the only
thing in a training step that changes them) is hooked to wait for it; forward and backward overlap
with the copy. At most one save is in flight; committing it is the Checkpointer's (collective) job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.background import BackgroundWriter
from trainer.distributed.torch_compat import copy_state_dict, create_cpu_state_dict


class AsyncStager:
    """One rank's background writer. Its collectives run in their own process group (`group`): on the
    default group, gloo aborts on collectives interleaved with the training thread's."""

    def __init__(self, device: torch.device, world: int) -> None:
        self._pin = device.type == "cuda"
        self._writer = BackgroundWriter("ckpt")
        self.group = dist.new_group(backend="gloo") if world > 1 else None
        self._buffer: dict | None = None  # CPU copy of the state, reused from save to save
        self._staged = threading.Event()
        self._staged.set()
        self.waited_s = 0.0  # time optimizer.step() waited for the copy since the last submit

    def submit(self, sd: dict, optimizer: torch.optim.Optimizer, write: Callable[[dict, Any], dict]) -> Future:
        """Start copying `sd`, then `write(copy, group)` in the background; returns the write's future."""
        self._writer.hold_steps(optimizer, self.wait_staged)
        self._staged = threading.Event()
        self.waited_s = 0.0
        return self._writer.submit(self._stage_and_write, sd, write, self._staged)

    def _stage_and_write(self, sd: dict, write: Callable[[dict, Any], dict], staged: threading.Event) -> dict:
        try:
            copy = self._stage(sd)
        finally:
            staged.set()  # on failure too: the error is raised on every rank when the save is committed
        return write(copy, self.group)

    @torch.no_grad()
    def _stage(self, sd: dict) -> dict:
        if self._buffer is not None:
            try:
                return copy_state_dict(sd, self._buffer)
            except Exception:  # noqa: BLE001 - the state's structure changed (e.g. CompanionMismatch): new buffer
                self._buffer = None
        self._buffer = create_cpu_state_dict(sd, pin_memory=self._pin)
        return copy_state_dict(sd, self._buffer)

    def wait_staged(self) -> None:
        """Block until the background copy is done (then the tensors may change)."""
        if not self._staged.is_set():
            start = time.perf_counter()
            self._staged.wait()
            self.waited_s += time.perf_counter() - start

    def close(self, wait: bool = True) -> None:
        self._writer.close(wait)
        self._buffer = None
