"""Test and benchmark infrastructure (not part of the installed package): a real S3 endpoint (moto's
server) on 127.0.0.1, reached over HTTP through s3fs exactly as a user's bucket would be (endpoint and
credentials from the standard AWS environment variables, which child processes inherit); a pausable TCP
proxy (storage that stops answering); process-tree kills and freezes (a lost node); which launcher hosts
the rendezvous store (from the ledger); free_port. moto is imported lazily since it is a dev dependency
(`pip install -e '.[dev]'`).

    with LoopbackS3() as s3:        # AWS_* point at the server inside, and are restored after
        fs = s3fs.S3FileSystem()    # s3.endpoint is http://127.0.0.1:<port>

Used by the tests (the `s3_endpoint` / `s3_bucket` fixtures in tests/conftest.py, tests/helpers.py and the
test files) and by the benchmarks and checks in scripts/ (bench.py, bench_ckpt.py, bench_data.py,
bench_node_loss.py, chaos.py, gpu_inprocess_check.py), which put the repository root on sys.path to import
it as `tests.fixtures`."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
REGION = "us-east-1"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), read from /proc; in other sessions too
    (a launcher's fork server and its ranks start sessions of their own)."""
    from common.process import parent_pid

    parents = {int(entry): parent_pid(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send `sig` to `pid`, its process group and every process below it (a node: the launcher, its fork
    server and its ranks, in sessions of their own). Returns the pids it was sent to."""
    victims = [pid, *descendants(pid)]
    for send, target in [(os.killpg, pid)] + [(os.kill, p) for p in victims]:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return victims


def kill_tree(pid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL `pid` and everything below it (`signal_tree`: a lost node), then wait until none is left
    (bounded), so that nothing of it writes on."""
    import signal
    import time

    from common.process import is_alive

    victims = signal_tree(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for victim in victims:
        while is_alive(victim):  # a zombie waiting for its parent to reap it counts as dead
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {victim} still alive {timeout_s:.0f}s after SIGKILL")
            time.sleep(0.01)


def freeze_tree(pid: int) -> list[int]:
    """SIGSTOP `pid` and everything below it (`signal_tree`): a node lost without a word (frozen, or its
    power or link gone), whose connections stay open and silent, unlike a crash's. Returns the pids
    stopped (SIGCONT wakes them; `kill_tree` ends them)."""
    import signal

    return signal_tree(pid, signal.SIGSTOP)


def _hosted(run_dir) -> list[dict]:
    """The ledger's `rendezvous` events of launchers that hosted the store, oldest first."""
    from trainer.runtime.protocol import read_events

    return [e for e in read_events(run_dir) if e["event"] == "rendezvous" and e.get("hosted")]


def wait_for_rendezvous_host(run_dir, timeout_s: float = 90.0, proc=None) -> None:
    """Wait until a launcher of the job in `run_dir` hosts its rendezvous store (its ledger's `rendezvous`
    event says `hosted`), so that the next one started on this machine joins it as a guest. For a fixed
    --nnodes only: under MIN:MAX the host would meanwhile start alone. Raises TimeoutError after
    `timeout_s`, RuntimeError when `proc` (that launcher) ended first."""
    import time

    deadline = time.monotonic() + timeout_s
    while not _hosted(run_dir):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the first launcher ended (exit {proc.returncode}) before it hosted the rendezvous")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no launcher hosted the rendezvous store within {timeout_s:.0f}s")
        time.sleep(0.05)


def rendezvous_host(run_dir, procs: list) -> int:
    """Which of `procs` (the job's launchers on this machine, as started) hosted the rendezvous store of
    its first meeting: the first to bind it, which under load need not be the first started. From the
    ledger's `rendezvous` events (their node is host:pid)."""
    pids = [e["node"].rpartition(":")[2] for e in _hosted(run_dir)]
    if not pids:
        raise RuntimeError(f"no launcher of {run_dir} says it hosted the rendezvous store")
    return next(i for i, p in enumerate(procs) if str(p.pid) == pids[0])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackS3:
    """moto's S3 server on 127.0.0.1 (a free port) with dummy credentials. `start()` (or entering the
    context) starts it and points this process's AWS_* variables at it; `stop()` (or leaving the
    context) stops it and restores the variables as they were."""

    def __init__(self, credentials: str = "testing") -> None:
        self.credentials = credentials
        self.endpoint: str | None = None
        self._server = None
        self._saved: dict[str, str | None] = {}

    def start(self) -> LoopbackS3:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._saved = {k: os.environ.get(k) for k in AWS_VARIABLES}
        os.environ.update(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=self.credentials,
                          AWS_SECRET_ACCESS_KEY=self.credentials, AWS_DEFAULT_REGION=REGION)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        try:
            self._server.stop()
        finally:
            self._server = None
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_s3(credentials: str = "testing") -> LoopbackS3:
    """Start a LoopbackS3 (stop it with `.stop()`); the AWS_* variables point at it until then."""
    return LoopbackS3(credentials).start()


def unreachable_env(base: Mapping[str, str] | None = None, secret: str = "s3cr3t-never-printed") -> dict[str, str]:
    """`base` (default: this process's environment) with an S3 endpoint nobody listens on (a closed
    loopback port), dummy credentials whose secret key is `secret`, and no retries, so that an S3
    client in a child process started with it fails at once."""
    return {**(os.environ if base is None else base), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
            "AWS_ACCESS_KEY_ID": "AKIDTEST", "AWS_SECRET_ACCESS_KEY": secret, "AWS_MAX_ATTEMPTS": "1",
            "AWS_DEFAULT_REGION": REGION}


class TcpProxy:
    """A TCP relay on 127.0.0.1 in a process of its own, in front of `target_port`: point a client at
    `.port`, then `pause()` it (SIGSTOP: connections are still accepted by the kernel, and nothing is
    ever answered, as with storage that stops answering) and `resume()` it (SIGCONT)."""

    def __init__(self, target_port: int) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self._proc = subprocess.Popen([sys.executable, "-c", _RELAY, str(self.port), str(target_port)],
                                      stdout=subprocess.PIPE)
        if self._proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the TCP proxy did not start")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pause(self) -> None:
        import signal

        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        import signal

        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self._proc.kill()
        self._proc.wait(10)
        self._proc.stdout.close()


_RELAY = r"""
import ctypes, signal, socket, sys, threading
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the test that started it
listen, target = int(sys.argv[1]), int(sys.argv[2])
server = socket.create_server(("127.0.0.1", listen), backlog=128)
def pump(src, dst):
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
def serve(client):
    try:
        upstream = socket.create_connection(("127.0.0.1", target))
    except OSError:
        client.close()
        return
    threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    serve(conn)
"""
