"""The pure parts of warm restarts (launch.stub, launch.zygote) and of the start-up cuts that go with
them: the stub's wire format, how it ends like its trainer, its signal relay, the fork server's refusal
of a module that starts a thread, the sweep of dead launchers' socket directories, the per-launch
memo of start-up measurements, the wait for a TCPStore's server, and the built-in corpus's file list.
Processes here are tiny ones (no torch); the real fork server is tested in
tests/integration/test_warm_restarts.py."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch import stub, zygote
from tests.helpers import REPO
from trainer.runtime.protocol import HEARTBEAT_DIR_ENV


def test_a_request_round_trips_and_arrives_in_pieces():
    data = stub.encode_request(["c.yaml", "train.steps=3"], {"A": "1", "PATH": "/bin"}, "/work", [0, 1, 2])
    request, used = stub.decode_request(data + b"trailing")
    assert used == len(data)
    assert request == {"argv": ["c.yaml", "train.steps=3"], "env": {"A": "1", "PATH": "/bin"}, "cwd": "/work",
                       "stdio": [0, 1, 2]}
    assert stub.decode_request(data[:3]) == (None, stub.HEADER.size - 3)  # not even the header yet
    assert stub.decode_request(data[:-5]) == (None, 5)  # the header, not all of the payload
    pinned, _ = stub.decode_request(stub.encode_request(["c.yaml"], {}, "/", [1, 2], cpus={3, 1}))
    assert pinned["cpus"] == [1, 3] and pinned["stdio"] == [1, 2]


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\n\r\n",  # not ours
    stub.HEADER.pack(stub.MAGIC, stub.MAX_REQUEST + 1),  # too large to be one
    stub.HEADER.pack(stub.MAGIC, 2) + b"[]",  # not an object
    stub.HEADER.pack(stub.MAGIC, 29) + b'{"argv": [], "env": {}, "cwd"',  # not JSON
])
def test_anything_else_is_refused(data):
    with pytest.raises(ValueError):
        stub.decode_request(data)


def test_a_request_needs_its_fields():
    body = b'{"argv": ["c.yaml"], "env": {}, "cwd": "/", "stdio": [1, 7]}'  # 7 is not stdio
    with pytest.raises(ValueError):
        stub.decode_request(stub.HEADER.pack(stub.MAGIC, len(body)) + body)


@pytest.mark.parametrize("returncode", [0, 3, 75, -signal.SIGTERM, -signal.SIGKILL, -signal.SIGSEGV])
def test_the_stub_ends_as_its_trainer_did(returncode):
    """An exit code is passed on; a signal death is re-enacted (torchelastic and the failure
    attribution see SIGKILL, not an exit code)."""
    proc = subprocess.run([sys.executable, "-S", "-c",
                           f"import sys; sys.path.insert(0, {str(REPO / 'launch')!r}); import stub; "
                           f"stub.exit_like({returncode})"], capture_output=True, timeout=30)
    assert proc.returncode == returncode, proc.stderr


def test_signals_before_the_trainer_exists_are_passed_on_once_it_does():
    relay = stub.Relay()
    relay(signal.SIGTERM, None)  # the trainer is not forked yet
    assert relay.pending == [signal.SIGTERM]
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        relay.started(sleeper.pid)
        assert sleeper.wait(timeout=10) == -signal.SIGTERM and relay.pending == []
        relay(signal.SIGINT, None)  # gone: nothing to do, no error
    finally:
        sleeper.kill()


def test_the_stub_falls_back_to_the_plain_trainer_without_a_fork_server(tmp_path):
    """No fork server at the given path: the stub execs `python -u -m trainer ARGV` in its own process."""
    env = dict(os.environ, **{stub.ZYGOTE_ENV: str(tmp_path / "nobody.sock")})
    proc = subprocess.run([sys.executable, "-S", zygote.STUB_PATH, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "warm start unavailable" in proc.stderr and "usage: python -m trainer" in proc.stdout


def test_the_fork_server_refuses_a_module_that_starts_a_thread(tmp_path):
    (tmp_path / "threaded.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(5,), "
                                          "daemon=True).start()\n")
    code = "from launch.zygote import preload; preload(('json', 'threaded'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    assert proc.returncode != 0 and "started Python threads" in proc.stderr, proc.stderr


def test_socket_directories_of_dead_launchers_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine, gone = tmp_path / f"{zygote.directory_prefix()}a", tmp_path / f"{zygote.directory_prefix(dead.pid)}b"
    other = tmp_path / "rekindle-zygote-elsewhere"
    for d in (mine, gone, other):
        d.mkdir()
    assert zygote.socket_parent() == str(tmp_path) or len(str(tmp_path)) > 48
    monkeypatch.setattr(zygote, "socket_parent", lambda: str(tmp_path))
    handle = zygote.Zygote(str(tmp_path / "run"))  # sweeps, and makes its own directory
    try:
        assert mine.exists() and other.exists() and not gone.exists()
        directory = Path(handle.directory)
        assert directory.name.startswith(zygote.directory_prefix()) and directory.stat().st_mode & 0o777 == 0o700
    finally:
        handle.close()
    assert not Path(handle.directory).exists()


def test_the_socket_path_stays_short_under_a_long_temp_directory(tmp_path, monkeypatch):
    long = tmp_path / ("x" * 80)
    long.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(long))
    handle = zygote.Zygote(str(tmp_path / "run"))
    try:
        assert len(handle.socket) < 100, handle.socket  # a Unix socket's path has at most 107 bytes
    finally:
        handle.close()


def test_startup_measurements_are_kept_for_the_launchers_next_groups(tmp_path, monkeypatch):
    from trainer.observability.startup import remembered

    calls = []

    def measure() -> float:
        calls.append(1)
        return 1.5e11

    monkeypatch.delenv(HEARTBEAT_DIR_ENV, raising=False)
    assert remembered("peak", measure) == 1.5e11 and remembered("peak", measure) == 1.5e11
    assert len(calls) == 2  # no launcher: every start measures
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    assert [remembered("peak", measure) for _ in range(3)] == [1.5e11] * 3
    assert len(calls) == 3  # once under the launcher
    (tmp_path / "memo-peak.json").write_text("{torn")
    assert remembered("peak", measure) == 1.5e11 and len(calls) == 4  # unreadable: measured again
    assert remembered("other", lambda: 7) == 7


def test_a_store_client_waits_for_its_server_without_backing_off():
    from common.net import wait_listening

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    assert not wait_listening("127.0.0.1", port, 0.2)  # nobody there: bounded
    assert time.monotonic() - start < 2.0

    server = socket.socket()

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen(1)

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        start = time.monotonic()
        assert wait_listening("127.0.0.1", port, 10.0)
        assert time.monotonic() - start < 1.0  # a few polls after it listens, not a backoff later
    finally:
        thread.join()
        server.close()


def test_the_corpus_file_list_is_the_one_rglob_gave(tmp_path):
    """data.corpus.source_files walks the tree, skipping tests and site-packages: the same files in the
    same order as the rglob it replaced (so the built-in corpus and its cache key do not change): the
    listing is what changed; both choose from their list with the same `shuffled_up_to`."""
    from data.corpus import shuffled_up_to, source_files

    rng = random.Random(1)
    for path in ("a.py", "b.txt", "pkg/m.py", "pkg/test_m.py", "pkg/tests/x.py", "test/t.py", "idle_test/i.py",
                 "idlelib/idle_test/j.py", "site-packages/s/z.py", "deep/er/still/n.py", "deep/testing.py",
                 "Upper/Z.py", "pkg/sub/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x" * rng.randrange(1, 50))

    def rglob_files(max_bytes: int) -> list[Path]:  # the previous implementation
        def excluded(p: Path) -> bool:
            parts = p.relative_to(tmp_path).parts
            return "site-packages" in parts or any(part.startswith(("test", "idle_test")) for part in parts)

        return shuffled_up_to([p for p in tmp_path.rglob("*.py") if not excluded(p)], max_bytes)

    for max_bytes in (1, 60, 10**6):
        assert source_files(max_bytes, tmp_path) == rglob_files(max_bytes)
    assert {p.name for p in source_files(10**6, tmp_path)} == {"a.py", "m.py", "n.py", "Z.py", "__init__.py"}
