"""Warm restarts: a fork server ("zygote") per launcher, so that a restarted rank does not pay
interpreter start-up and `import torch` again (what they cost: docs/fault-tolerance.md, "Warm restarts").

The launcher starts it once (`Zygote.start`, `python -m launch.zygote SOCKET ...`): it listens on a Unix
socket in a private directory (0700), imports torch, torch.distributed and the trainer with everything
it imports (`PRELOAD`) and runs no torch operation (no OpenMP or intra-op threads, no CUDA: a fork of it
is safe), then serves requests. torchelastic still starts every rank (its monitoring, exit codes, error
files and the supervisor's agent are unchanged), but as `launch/stub.py`, a stdlib-only stub that sends
its command line, environment, working directory and stdio descriptors here; the fork server forks a
child that becomes that rank's trainer: its own session (as torchelastic's workers), the stub's stdio,
environment and directory, then `trainer.__main__.main(argv)`. The heartbeat pid is the child's own.

Lifetimes: the server is single-threaded (one selector over the listening socket, each stub's
connection and each child's pidfd); it waits for its children and tells each stub how its child ended
(the stub exits the same way). A stub that dies (torchelastic's teardown SIGKILLs it) gets its
trainer's process group SIGKILLed at once, a stopped (SIGSTOP) one included. The children die with the
server and the server with the launcher (PR_SET_PDEATHSIG), so killing the launcher leaves no process
behind. The same template serves every restart; a server that died is started again for the next
group, and a stub that cannot reach one starts the plain trainer itself (a cold start)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from common.clock import wait_until
from common.process import kill_group
from launch import stub
from trainer.contract import die_with_parent, exit_now, scratch_prefix, sweep_scratch, temp_name

# What the trainer imports on its way to the first step (trainer.__main__ imports most of it lazily), as a
# 2-rank run shows it: nothing more is imported after the fork.
PRELOAD = ("trainer.__main__", "trainer.config", "trainer.observability.wandb_log", "trainer.loop",
           "trainer.checkpoint", "trainer.checkpoint.memory", "trainer.runtime.fault", "trainer.runtime.lease",
           "trainer.step", "common.storage",
           "data.shards", "data.stream", "data.loader", "data.corpus",
           "torch.distributed.elastic.multiprocessing.errors", "torch.profiler", "torch.utils.serialization",
           "fsspec.implementations.local", "numpy.ma")
STUB_PATH = str(Path(stub.__file__).resolve())
SOCKET_NAME = "fork.sock"
_PREFIX = "rekindle-zygote-"
MAX_STARTS = 3  # a fork server that keeps dying is given up: the stubs start the plain trainer


# ---------------------------------------------------------------------- the launcher's side
class Zygote:
    """The launcher's handle on its fork server (launch.supervisor starts it on its main thread, since
    PR_SET_PDEATHSIG follows the thread that started a process, and closes it at the end)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        sweep()
        # mode 0700: only this user connects
        self.directory = tempfile.mkdtemp(prefix=directory_prefix(), dir=socket_parent())
        self.socket = os.path.join(self.directory, SOCKET_NAME)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        """Start (or start again) the fork server; it binds its socket first and preloads after that
        (a stub that connects meanwhile waits for it)."""
        self.starts += 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)  # a previous server's: `wait_bound` waits for the new one's
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "launch.zygote", self.socket, "--launcher", str(os.getpid()),
             "--run-dir", self.run_dir], stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure(self) -> bool:
        """Before a worker group starts: whether a fork server is running, starting one if the previous
        one died (at most MAX_STARTS in all)."""
        if not self.alive() and self.starts < MAX_STARTS:
            self.start()
        return self.alive()

    def wait_bound(self, timeout_s: float = 10.0) -> bool:
        """Wait (bounded) until the server listens, so that the first stubs find it."""
        wait_until(lambda: os.path.exists(self.socket) or not self.alive(), timeout_s)
        return os.path.exists(self.socket)

    def close(self) -> None:
        """Stop the server (its children, if any are left, die with it) and remove its directory."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def directory_prefix(pid: int | None = None) -> str:
    """`rekindle-zygote-<pid namespace>-<launcher pid>-`: the socket directories of launcher `pid`
    (trainer.runtime.scratch)."""
    return scratch_prefix(_PREFIX, pid)


def socket_parent() -> str:
    """The temp directory, or /tmp where that is long: a Unix socket's path has at most 107 bytes, and
    the server binds at a temp name beside its socket first (`temp_name`, with the server's own pid, of
    up to 7 digits)."""
    parent = tempfile.gettempdir()
    longest = len(temp_name(os.path.join(parent, f"{directory_prefix()}{'x' * 8}", SOCKET_NAME)))
    longest += 7 - len(str(os.getpid()))
    return parent if longest <= 107 or not os.path.isdir("/tmp") else "/tmp"


def sweep() -> None:
    """Remove the socket directories of launchers (of this pid namespace) that no longer exist: one
    killed outright leaves its directory behind."""
    sweep_scratch(_PREFIX, tempfile.gettempdir(), socket_parent())


# ---------------------------------------------------------------------- the fork server
@dataclass
class _Stub:
    """One stub's connection: its request as it arrives, then its trainer child."""

    sock: socket.socket
    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)  # stdio received with the request
    pid: int | None = None  # the forked trainer
    pidfd: int | None = None
    connected: bool = True


class Server:
    def __init__(self, path: str) -> None:
        self.path = path
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stubs: list[_Stub] = []

    def bind(self) -> None:
        """Listen, then appear at `path` (renamed there: a stub that finds the path can connect)."""
        fresh = temp_name(self.path)
        self.listener.bind(fresh)
        os.chmod(fresh, 0o600)
        self.listener.listen(256)
        os.replace(fresh, self.path)

    def serve(self) -> None:
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.selector.select():
                kind, entry = key.data if key.data else ("accept", None)
                if kind == "accept":
                    self._accept()
                elif kind == "stub":
                    self._from_stub(entry)
                else:
                    self._reap(entry)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        uid = peer_uid(sock)
        if uid != os.getuid():  # the directory is private; this is a second lock on the door
            sock.close()
            return
        sock.setblocking(False)
        entry = _Stub(sock)
        self.stubs.append(entry)
        self.selector.register(sock, selectors.EVENT_READ, ("stub", entry))

    def _from_stub(self, entry: _Stub) -> None:
        try:
            if entry.pid is None:
                data, fds, _, _ = socket.recv_fds(entry.sock, 1 << 16, 3)
                entry.fds += fds
            else:
                data = entry.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the stub is gone (killed, or it gave up): so is its trainer
            self._disconnect(entry)
            if entry.pid is not None:
                kill_group(entry.pid)
            else:
                self._forget(entry)
            return
        if entry.pid is not None:
            return  # nothing is expected from a stub once its trainer runs
        entry.data += data
        try:
            request, _ = stub.decode_request(bytes(entry.data))
            if request is not None and len(entry.fds) != len(request["stdio"]):
                raise ValueError("the stdio descriptors did not arrive with the request")
        except ValueError as e:
            self._answer(entry, {"error": str(e)})
            self._disconnect(entry)
            self._forget(entry)
            return
        if request is not None:
            self._fork(entry, request)

    def _fork(self, entry: _Stub, request: dict) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            inherited = [self.listener.fileno(), self.selector.fileno()]
            for other in self.stubs:
                inherited += [other.sock.fileno(), *(other.fds if other is not entry else [])]
                inherited += [other.pidfd] if other.pidfd is not None else []
            become_trainer(request, entry.fds, inherited, server)  # never returns
        for fd in entry.fds:
            os.close(fd)
        entry.fds, entry.pid = [], pid
        entry.pidfd = os.pidfd_open(pid)
        self.selector.register(entry.pidfd, selectors.EVENT_READ, ("exit", entry))
        self._answer(entry, {"pid": pid})

    def _reap(self, entry: _Stub) -> None:
        _, status = os.waitpid(entry.pid, 0)
        self.selector.unregister(entry.pidfd)
        os.close(entry.pidfd)
        entry.pidfd = None
        self._answer(entry, {"exit": os.waitstatus_to_exitcode(status)})
        self._disconnect(entry)
        self._forget(entry)

    def _answer(self, entry: _Stub, message: dict) -> None:
        if not entry.connected:
            return
        try:
            entry.sock.setblocking(True)
            entry.sock.settimeout(5.0)
            entry.sock.sendall(json.dumps(message).encode() + b"\n")
            entry.sock.setblocking(False)
        except OSError:
            pass  # the stub is gone: its end of file tells us next

    def _disconnect(self, entry: _Stub) -> None:
        if entry.connected:
            entry.connected = False
            self.selector.unregister(entry.sock)
            entry.sock.close()

    def _forget(self, entry: _Stub) -> None:
        for fd in entry.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        entry.fds = []
        if entry in self.stubs:
            self.stubs.remove(entry)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def become_trainer(request: dict, fds: list[int], inherited: list[int], server: int) -> None:
    """In the forked child of fork server `server`: take the stub's place (session, stdio, directory,
    environment, signals), run the trainer's main() and exit with its code, as `python -u -m trainer
    ARGV` would."""
    code = 1
    try:
        os.setsid()  # its own session and process group, as torchelastic starts workers
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        die_with_parent(lambda: os.getppid() == server)  # the server dies with the launcher
        for target, fd in zip(request["stdio"], fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        if request.get("cpus"):
            with contextlib.suppress(OSError):  # (CPUs this process may not use: it keeps its own)
                os.sched_setaffinity(0, request["cpus"])
        os.environ.clear()
        os.environ.update(request["env"])
        # The process this rank dies with (trainer.runtime.fault.die_with_launcher) is its parent, the server.
        os.environ[stub.LAUNCHER_PID_ENV] = str(server)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # libgomp read the server's environment, not this one
            import torch

            torch.set_num_threads(int(threads))
        from trainer.contract import trainer_main

        sys.argv = [trainer_main.__file__, *request["argv"]]
        sys.modules["__main__"] = trainer_main  # as under `python -m trainer` (multiprocessing's spawn reads it)
        code = trainer_main.main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        stub.exit_like(-signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            exit_now(code)
        finally:
            os._exit(code)


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import the trainer and what it imports; refuse (RuntimeError) if that started a Python thread,
    which a fork would copy in whatever state it is in. (Native threads that libraries start at import,
    such as OpenBLAS's pool, shut down and restart around a fork by themselves.)"""
    for name in modules:
        importlib.import_module(name)
    if threading.active_count() > 1:
        raise RuntimeError(f"importing the trainer started Python threads: {threading.enumerate()}")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("importing the trainer initialised CUDA, which a fork cannot inherit")
    # Out of the collector's sight from here: a child's collections then do not walk (and so copy,
    # page by page) the modules' objects it shares with this process.
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.zygote", description=__doc__.split("\n\n")[0])
    p.add_argument("socket")
    p.add_argument("--launcher", type=int, required=True, help="pid of the launcher this server dies with")
    p.add_argument("--run-dir", default="", help="the run it serves (shown in ps; not used)")
    args = p.parse_args(argv)
    die_with_parent(lambda: os.getppid() == args.launcher)
    # It ends with the launcher (or when the launcher closes it), never on a signal meant for the ranks:
    # Slurm sends SIGTERM to every process of the job, and the ranks need this process (their parent)
    # alive to commit their emergency checkpoint.
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    if not hasattr(os, "pidfd_open"):
        print("[launch] warning: warm restarts are off: this system has no pidfd_open (Linux 5.3+)",
              file=sys.stderr, flush=True)
        return 1
    server = Server(args.socket)
    server.bind()  # first: stubs that come while the imports run wait in the backlog
    try:
        preload()
    except Exception as e:  # noqa: BLE001 - the stubs start the plain trainer instead
        print(f"[launch] warning: warm restarts are off: the fork server could not preload the trainer: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
