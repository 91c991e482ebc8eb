"""The background writer of async checkpoints (staging) and of the memory tier: one named thread that
runs the jobs given to it one after another while training goes on, and the hook that makes
`optimizer.step()` (the only thing in a training step that changes the tensors a job reads) wait for
what the job must finish first. Torch is not imported: the optimizer is any object with
`register_step_pre_hook`."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWriter:
    """One thread, named `name`, for one rank's background writes. `submit` returns the job's future;
    `wait` blocks until the last job submitted is done and returns its error instead of raising it;
    `close` waits for what is in flight, or, with `wait=False`, cancels what has not started and returns."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._last: Future | None = None
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # by optimizer (not its id)

    def submit(self, job: Callable[..., Any], *args: Any) -> Future:
        self._last = self._pool.submit(job, *args)
        return self._last

    @property
    def pending(self) -> bool:
        """Whether a job was submitted since the last `wait`."""
        return self._last is not None

    def wait(self) -> Exception | None:
        """Block until the last job submitted is done; its error, or None. Each job's outcome is given
        once: a second call returns None at once."""
        last, self._last = self._last, None
        if last is None:
            return None
        try:
            last.result()
        except Exception as e:  # noqa: BLE001 - given to the caller, who decides what a failed write means
            return e
        return None

    def hold_steps(self, optimizer: Any, wait: Callable[[], None]) -> None:
        """Make `optimizer.step()` call `wait()` first, until `close` (hooked once per optimizer)."""
        if optimizer not in self._hooks:
            self._hooks[optimizer] = optimizer.register_step_pre_hook(lambda *_: wait())

    def close(self, wait: bool = True) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
