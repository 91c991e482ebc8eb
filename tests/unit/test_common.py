"""The shared primitives of common/ (and trainer.recovery.keys) on real sockets, processes and threads:
the kill helper, bounded waits, the exception chain and the lost-peer classifier (on what two real gloo
ranks raise when a peer is SIGKILLed mid-collective and when a collective times out), the listening
probe, the timings' orderings."""

from __future__ import annotations

import errno
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from common import clock, errors, exits, net, process, timing
from tests.helpers import REPO


# ---------------------------------------------------------------------- process
def test_send_signal_reaches_a_process_group_and_says_when_nobody_is_there():
    # A shell leading its own group, with a child in it: the group's signal ends both.
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    try:
        assert process.send_signal(proc.pid, signal.SIGKILL, group=True)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert clock.wait_until(lambda: not process.is_alive(child), 10)
    finally:
        process.send_signal(proc.pid, signal.SIGKILL, group=True)
        proc.stdout.close()
        proc.wait(timeout=10)
    assert not process.send_signal(proc.pid, signal.SIGTERM, group=False)  # reaped: no such process


# ---------------------------------------------------------------------- exits
def test_the_exit_codes_are_one_list_that_the_protocol_and_the_contract_pass_on():
    from trainer import contract
    from trainer.runtime import protocol

    codes = {name: getattr(exits, name) for name in exits.__all__}
    assert len(set(codes.values())) == len(codes)
    assert all(getattr(protocol, name) == getattr(contract, name) == code for name, code in codes.items())


# ---------------------------------------------------------------------- clock
def test_wait_until_returns_when_the_condition_holds_and_is_bounded_otherwise():
    done = threading.Event()
    threading.Timer(0.1, done.set).start()
    start = time.monotonic()
    assert clock.wait_until(done.is_set, 10.0)
    assert time.monotonic() - start < 5.0
    start = time.monotonic()
    assert not clock.wait_until(lambda: False, 0.2, 0.05)
    assert 0.2 <= time.monotonic() - start < 5.0
    assert clock.wait_until(lambda: True, 0.0)  # asked once even without time


def test_call_bounded_returns_raises_or_leaves_a_blocked_call_behind():
    assert clock.call_bounded(lambda: 7, 10.0).result() == 7
    with pytest.raises(ZeroDivisionError):
        clock.call_bounded(lambda: 1 / 0, 10.0).result()
    release = threading.Event()
    start = time.monotonic()
    blocked = clock.call_bounded(lambda: release.wait(30), 0.2, name="blocked-for-a-test")
    assert not blocked.done and blocked.result() is None
    assert time.monotonic() - start < 5.0
    release.set()
    assert clock.wait_until(lambda: blocked.done, 10.0) and blocked.value is True


# ---------------------------------------------------------------------- errors
def chained(inner: BaseException, suppress: bool = False) -> BaseException:
    """`RuntimeError("step failed")` raised while handling `inner` (`suppress`: `from None`)."""
    try:
        try:
            raise inner
        except BaseException:
            if suppress:
                raise RuntimeError("step failed") from None
            raise RuntimeError("step failed")  # noqa: B904 - the implicit context is what is tested
    except RuntimeError as e:
        return e


def test_exception_chain_follows_causes_and_contexts_as_python_prints_them():
    inner = ValueError("inner")
    assert list(errors.exception_chain(chained(inner)))[1:] == [inner]
    assert len(list(errors.exception_chain(chained(inner, suppress=True)))) == 1
    assert list(errors.exception_chain(chained(inner, suppress=True), suppressed=True))[1:] == [inner]
    loop = ValueError("a")
    loop.__cause__ = ValueError("b")
    loop.__cause__.__cause__ = loop
    assert len(list(errors.exception_chain(loop))) == 2  # each once


def test_a_lost_peer_is_told_by_type_and_errno_with_words_only_as_the_fallback():
    import torch.distributed as dist

    assert errors.peer_lost(ConnectionResetError())
    assert errors.peer_lost(OSError(errno.EPIPE, "no such words here"))
    assert errors.peer_lost(dist.DistBackendError("NCCL error: remote process exited"))
    assert errors.peer_lost(chained(BrokenPipeError()))  # wrapped
    assert not errors.peer_lost(chained(ConnectionResetError(), suppress=True))  # `from None`: not the cause
    assert errors.peer_lost(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    assert not errors.peer_lost(TimeoutError("Timed out waiting 2000ms for recv operation to complete"))
    assert not errors.peer_lost(OSError(errno.ENOSPC, "No space left on device"))
    assert errors.says_peer_lost("torch.distributed.DistBackendError: NCCL error in: ...")
    assert not errors.says_peer_lost("RuntimeError: injected failure at step 12")
    assert errors.says_collective_failed("RuntimeError: [Rank 1]: Watchdog caught collective operation timeout: "
                                         "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds")


GLOO_RANK = """
import json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from common import errors

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
slow = dist.new_group([0, 1], timeout=timedelta(seconds=1))
t = torch.ones(4)
dist.all_reduce(t)
dist.all_reduce(t, group=slow)


def verdict(e):
    text = f"{type(e).__name__}: {e}"
    return {"text": text[:300], "peer_lost": errors.peer_lost(e), "says_peer_lost": errors.says_peer_lost(text),
            "says_collective_failed": errors.says_collective_failed(text)}


if rank == 1:  # stays out of the timed collective, then dies in the middle of the next one
    store.wait(["timed out"], timedelta(seconds=30))
    store.wait(["entering"], timedelta(seconds=30))
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
seen = {}
try:
    dist.all_reduce(t, group=slow)  # rank 1 never joins: the collective times out
except Exception as e:
    seen["timeout"] = verdict(e)
store.set("timed out", "1")
store.set("entering", "1")
try:
    dist.all_reduce(t)  # rank 1 is SIGKILLed while this waits for it
except Exception as e:
    seen["killed"] = verdict(e)
print(json.dumps(seen), flush=True)
os._exit(0)
"""


def test_the_classifier_on_what_gloo_raises_for_a_killed_peer_and_for_a_timeout():
    """Two real gloo ranks: a collective whose peer never joins times out (not a lost peer: the trainer does
    not recover in process from it, but the launcher counts it as a victim's error), and a collective whose
    peer is SIGKILLed meanwhile fails with a lost peer."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, str(rank), str(port)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        out, err = ranks[0].communicate(timeout=60)
        assert ranks[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate(timeout=10)
    seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else pytest.fail(err[-2000:])
    timeout, killed = seen["timeout"], seen["killed"]
    assert "Timed out" in timeout["text"], timeout
    assert not timeout["peer_lost"] and not timeout["says_peer_lost"] and timeout["says_collective_failed"]
    assert killed["peer_lost"] and killed["says_peer_lost"], killed


# ---------------------------------------------------------------------- net
def test_listening_is_true_only_where_something_accepts_connections():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        assert net.listening("127.0.0.1", port, 1.0)
        assert net.wait_listening("127.0.0.1", port, 1.0)
        assert net.listening_at(f"127.0.0.1:{port}", 1.0)
        assert not net.listening_at("127.0.0.1", 1.0) and not net.listening_at(f"127.0.0.1:{port}x", 1.0)
    start = time.monotonic()
    assert not net.listening_at(f"[::1]:{port}", 1.0)
    assert not net.listening("127.0.0.1", port, 1.0)  # closed: refused at once
    assert not net.wait_listening("127.0.0.1", port, 0.2)
    assert time.monotonic() - start < 5.0


# ---------------------------------------------------------------------- timing
def test_the_timings_orderings_hold_and_their_users_read_them_from_common():
    from launch import agent, liveness
    from trainer.runtime import fault, lease, protocol

    assert timing.broken_orderings() == []
    assert (liveness.LOST_S, liveness.INTERVAL_S, agent.SURVIVOR_GRACE_S) == (
        timing.LOST_S, timing.INTERVAL_S, timing.SURVIVOR_GRACE_S)
    assert (fault.BLOCK_ABOVE_S, lease.SETTLE_S, protocol.REFRESH_S) == (
        timing.BLOCK_ABOVE_S, timing.SETTLE_S, timing.REFRESH_S)
    names = [name for name in vars(timing) if name.endswith("_S")]
    assert all(isinstance(getattr(timing, name), float) and getattr(timing, name) > 0 for name in names)


# ---------------------------------------------------------------------- trainer.recovery.keys
def test_the_recovery_keys_are_distinct_per_generation_and_the_next_generation_follows_every_one_seen():
    from trainer.recovery import keys

    one = [keys.failed_key(1), keys.handled_key(1), keys.world_key(1), keys.setup_key(1), keys.arrived_key(1, 0)]
    two = [keys.failed_key(2), keys.handled_key(2), keys.world_key(2), keys.setup_key(2), keys.arrived_key(2, 0)]
    assert len(set(one + two + [keys.arrived_key(1, 1)])) == 11
    assert all(k.startswith(keys.generation_prefix(1) + "/") for k in one)
    assert keys.store_prefix("run", "r3") == "rekindle/inproc/run/r3"
    assert keys.next_generation(0) == 1 and keys.next_generation(2, [0, 5, 3]) == 6
