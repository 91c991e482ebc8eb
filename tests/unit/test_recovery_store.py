"""The launcher's side of the ranks' coordination store (launch.recovery.store), on a real TCP store: hearing
that another launcher handles its ranks' failure, and telling the ranks, with no connection tried where
nothing listens (one would print torch's C++ frames and wait seconds)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from common.clock import wait_until
from launch.liveness import Liveness
from launch.recovery.store import StoreQuestions, announce
from tests.fixtures import free_port
from trainer.contract import (
    COORD_STORE_ENV,
    announce_failure,
    coordination_store,
    failure_handled,
    publish_smaller_world,
    tcp_store_server,
)


class Agent:
    """The part of launch.agent.SupervisedAgent that the store helpers ask."""

    def round(self) -> str:
        return "r1"

    def run_id(self) -> str:
        return "job"


@pytest.fixture
def store_at(monkeypatch):
    server = tcp_store_server("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    where = f"127.0.0.1:{server.port}"
    monkeypatch.setenv(COORD_STORE_ENV, where)
    yield where
    del server


def test_a_launcher_hears_that_another_handles_its_ranks_failure_or_went_on_without_it(store_at, monkeypatch, capfd):
    liveness = Liveness(store_at, "node-a").start()  # asked only while the store answers
    try:
        assert wait_until(liveness.answering, 10.0, 0.05), "the store never answered"
        asks = StoreQuestions()
        handled = asks.handled
        store = coordination_store(store_at, "job", "r1", 5.0)
        assert not handled(Agent(), 3, liveness)
        announce_failure(store, 3, by="0")  # the ranks that noticed say so: not their launcher
        assert not handled(Agent(), 3, liveness)
        announce_failure(store, 2, handled=True)
        assert not handled(Agent(), 3, liveness)  # another generation's announcement
        announce_failure(store, 3, handled=True)
        # (a set is sent without an answer: another connection may see it a moment later, on a busy machine)
        assert wait_until(lambda: handled(Agent(), 3, liveness), 5.0, 0.05)
        assert not asks.left_behind(Agent(), 3, liveness)
        publish_smaller_world(store, 3, [0, 1])
        assert wait_until(lambda: asks.left_behind(Agent(), 3, liveness), 5.0, 0.05)
        assert not asks.left_behind(Agent(), 4, liveness)
        assert StoreQuestions().handled(Agent(), 3, None)  # no liveness: not asked (the coordinator's bound decides)
        assert StoreQuestions().left_behind(Agent(), 3, None)  # asked whatever liveness heard (a node waking)
        monkeypatch.setenv(COORD_STORE_ENV, f"127.0.0.1:{free_port()}")  # nobody listens there
        assert StoreQuestions().handled(Agent(), 4, liveness) and not StoreQuestions().left_behind(Agent(), 4, liveness)
        assert "frame #" not in capfd.readouterr().err  # no connection was tried where nothing listens
    finally:
        liveness.stop()


def test_telling_the_ranks_reaches_a_live_store_and_tries_no_connection_to_a_gone_one(store_at, monkeypatch, capfd):
    def told() -> bool:
        return not any(t.name == "tell-the-ranks" for t in threading.enumerate())

    announce(Agent(), 4, handled=True)
    assert wait_until(told, 10.0, 0.02), "the announcement did not end"
    assert failure_handled(coordination_store(store_at, "job", "r1", 5.0), 4)
    monkeypatch.setenv(COORD_STORE_ENV, f"127.0.0.1:{free_port()}")  # its host is gone
    announce(Agent(), 5, handled=True)
    assert wait_until(told, 2.0, 0.02), "an announcement to a gone store waited"
    assert "frame #" not in capfd.readouterr().err


def test_a_store_gone_after_its_connection_was_made_is_not_called_again(monkeypatch, capfd):
    """The connection kept from before its host was lost is not used: a call would print torch's C++ frames
    (the failure that follows a lost store host) and wait; each question answers its default at once."""
    server = tcp_store_server("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv(COORD_STORE_ENV, f"127.0.0.1:{server.port}")
    liveness = Liveness(f"127.0.0.1:{server.port}", "node-a").start()
    try:
        assert wait_until(liveness.answering, 10.0, 0.05), "the store never answered"
        asks = StoreQuestions()
        assert not asks.handled(Agent(), 1, liveness) and not asks.left_behind(Agent(), 1, liveness)  # connected
        liveness.stop()
        del server  # the host is gone
        started = time.monotonic()
        assert asks.handled(Agent(), 1, None) and not asks.left_behind(Agent(), 1, None)
        assert time.monotonic() - started < 2.0
        assert "frame #" not in capfd.readouterr().err
    finally:
        liveness.stop()
