"""The shared writers' helpers: atomic writes (common.storage: unique temp names, nothing left behind,
durable and exclusive variants) and their users' promises (the launcher's run.dir lock, the lease's
create-if-absent, the fork server's socket path); the background writer of async saves and the memory
tier (trainer.checkpoint.background); per-process scratch directories (trainer.runtime.scratch)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading

import pytest

from common import storage
from trainer.checkpoint.background import BackgroundWriter
from trainer.runtime.scratch import scratch_prefix, sweep_scratch


def test_temp_names_are_unique_per_host_process_and_call(tmp_path):
    path = str(tmp_path / "f.json")
    names = {storage.temp_name(path) for _ in range(100)}
    assert len(names) == 100
    host = socket.gethostname().split(".", 1)[0][:16]
    assert all(n.startswith(f"{path}.tmp-{host}-{os.getpid()}-") and os.path.dirname(n) == str(tmp_path)
               for n in names)


def test_an_atomic_write_replaces_whole_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "f.json"
    storage.atomic_write(path, b"one")
    storage.atomic_write(path, b"two", durable=True)
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["f.json"]
    with pytest.raises(OSError, match=r"writing .*missing/f\.json"):  # says which file
        storage.atomic_write(tmp_path / "missing" / "f.json", b"x")
    with pytest.raises(RuntimeError), storage.atomic_file(str(path)) as f:  # the block's own failure
        f.write(b"half")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["f.json"]


def test_an_exclusive_write_has_exactly_one_winner(tmp_path):
    path = tmp_path / "LEASE.json"
    results: list[str] = []
    barrier = threading.Barrier(8)

    def create(i: int) -> None:
        barrier.wait()
        try:
            storage.atomic_write(path, f"{i}".encode(), exclusive=True)
            results.append(f"won {i}")
        except FileExistsError:
            results.append("lost")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (won,) = [r for r in results if r.startswith("won")]
    assert path.read_text() == won.split()[1] and results.count("lost") == 7
    assert os.listdir(tmp_path) == ["LEASE.json"]
    fs, p = storage.filesystem(str(path))
    with pytest.raises(FileExistsError):
        storage.write_file(fs, p, b"again", exclusive=True)


def test_the_launchers_lock_is_held_once_visible_and_gone_after(tmp_path):
    from launch.lock import LOCKS, RunDirInUse, claim

    with claim(tmp_path, "job-a") as path:
        assert sorted(os.listdir(tmp_path / LOCKS)) == [path.name]  # no temp file left
        with pytest.raises(RunDirInUse, match=re.escape(f"pid {os.getpid()} on {socket.gethostname()}")):
            with claim(tmp_path, "job-b"):
                pass
        # Another process sees it locked (the lock outlives the file object that wrote the record).
        probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
                 "try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError: sys.exit(3)")
        assert subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 3
    assert os.listdir(tmp_path / LOCKS) == []


def test_a_lock_whose_launcher_ends_while_it_is_read_is_nobodys(tmp_path, monkeypatch):
    """The holder still held it at the look, then ended and removed its file before the record was read (a
    requeued job's old launcher exiting): nobody holds it, not "another job" (which refused the new one)."""
    from pathlib import Path

    from launch.lock import _holder, claim

    with claim(tmp_path, "job-a") as path:
        real = Path.read_text

        def gone(self, *args, **kwargs):
            if self == path:
                raise FileNotFoundError(str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", gone)
        assert _holder(path) is None
        monkeypatch.setattr(Path, "read_text", real)
        assert _holder(path)["job"] == "job-a"  # held and readable: its record


def test_the_fork_servers_temp_socket_path_fits(tmp_path, monkeypatch):
    from launch import zygote

    for parent in ("/tmp", str(tmp_path)):
        monkeypatch.setattr("tempfile.tempdir", parent)
        chosen = zygote.socket_parent()
        bound = storage.temp_name(os.path.join(chosen, f"{zygote.directory_prefix()}xxxxxxxx", zygote.SOCKET_NAME))
        assert len(bound) <= 107, bound


def test_scratch_directories_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine, gone = tmp_path / f"{scratch_prefix('x-')}a", tmp_path / f"{scratch_prefix('x-', dead.pid)}b"
    other = tmp_path / f"{scratch_prefix('y-', dead.pid)}c"  # another prefix: not ours to sweep
    for d in (mine, gone, other):
        d.mkdir()
    sweep_scratch("x-", str(tmp_path))
    assert mine.exists() and other.exists() and not gone.exists()


class _Optimizer:
    """What BackgroundWriter needs of an optimizer: a step pre-hook."""

    def __init__(self) -> None:
        self.hooks: dict[int, object] = {}

    def register_step_pre_hook(self, hook):
        key = len(self.hooks)
        self.hooks[key] = hook
        hooks = self.hooks

        class Handle:
            def remove(self) -> None:
                hooks.pop(key, None)

        return Handle()

    def step(self) -> None:
        for hook in list(self.hooks.values()):
            hook(self, (), {})


def test_the_background_writer_runs_jobs_in_order_and_gives_each_error_once():
    writer, done, waited = BackgroundWriter("test"), [], []
    optimizer = _Optimizer()
    assert not writer.pending and writer.wait() is None
    writer.hold_steps(optimizer, lambda: waited.append(writer.wait()))
    writer.hold_steps(optimizer, lambda: waited.append("twice"))  # hooked once per optimizer
    gate = threading.Event()
    writer.submit(gate.wait)
    future = writer.submit(done.append, 2)
    assert writer.pending and not future.done()
    gate.set()
    optimizer.step()  # waits for the last job
    assert done == [2] and waited == [None] and not writer.pending

    def fail() -> None:
        raise OSError("memory full")

    writer.submit(fail)
    error = writer.wait()
    assert isinstance(error, OSError) and str(error) == "memory full"
    assert writer.wait() is None  # said once
    assert threading.current_thread().name != "test" and any(t.name.startswith("test") for t in threading.enumerate())
    writer.close()
    optimizer.step()
    assert waited == [None]  # unhooked at close
