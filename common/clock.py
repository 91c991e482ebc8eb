"""Bounded waits: `wait_until` (poll a condition until it holds or a deadline on the monotonic clock
passes) and `call_bounded` (run a call that may block forever on a thread of its own, and stop waiting
for it after a bound). Torch-free."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Ask `predicate()` every `interval_s` until it is true (True) or `timeout_s` has passed on the
    monotonic clock (False). It is asked at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(interval_s, left))


class Bounded(Generic[T]):
    """What `call_bounded` saw: `done` (the call returned or raised within the bound), and then its
    `value` or its `error`."""

    def __init__(self) -> None:
        self.done = False
        self.value: T | None = None
        self.error: BaseException | None = None

    def result(self) -> T | None:
        """The call's value; its exception raised again; None when it did not finish within the bound."""
        if self.error is not None:
            raise self.error
        return self.value


def call_bounded(fn: Callable[[], T], timeout_s: float, name: str = "bounded-call") -> Bounded[T]:
    """Run `fn()` on a daemon thread named `name` and wait at most `timeout_s` for it. A call that blocks
    forever (storage that stopped answering: a blocked read cannot be interrupted) is left running on
    its thread, and the caller goes on; `Bounded.done` says which it was."""
    outcome: Bounded[T] = Bounded()

    def run() -> None:
        try:
            outcome.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.error = e
        outcome.done = True

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome
