"""The worker entrypoint under warm restarts (launch.zygote): what torchelastic starts for each rank,
`python -S launch/stub.py CONFIG [key=value ...]`. It imports no torch (and, run with -S, no site
packages either: about a tenth of a second on a busy 2-core machine); it hands its command line,
environment, working directory and stdin/stdout/stderr (SCM_RIGHTS) to the launcher's fork server,
which forks the trainer from a process that has torch and the trainer already imported.

The stub stands in for the trainer towards torchelastic and the supervisor:
- signals sent to it (SIGTERM for a preemption, SIGINT, SIGHUP, SIGUSR1/2) are passed to the trainer;
- it exits the way the trainer did: the same exit code, or the same signal raised on itself;
- when it dies (torchelastic's teardown SIGKILLs it), the fork server SIGKILLs the trainer and its
  process group at once, a stopped (SIGSTOP) trainer included; the stub dies with the launcher
  (PR_SET_PDEATHSIG), as the trainer does.
When the fork server cannot be reached, or refuses, the stub execs the plain trainer in its own process
(`python -u -m trainer ...`: a cold start, and the same pid).

Stdlib only, and importable by the fork server (launch.zygote) for the wire format: a request is
MAGIC, a 4-byte big-endian length and a JSON object {argv, env, cwd, stdio, cpus}, with the stdio descriptors
attached to its first bytes; the answers are JSON lines, {"pid": N} once the trainer is forked, then
{"exit": N} when it has ended (Popen's returncode: the exit code, or minus the signal that killed it),
or {"error": why} instead of a pid."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

ZYGOTE_ENV = "REKINDLE_ZYGOTE"  # the fork server's socket; unset: the plain trainer
MAGIC = b"RKZ1"
HEADER = struct.Struct("!4sI")
MAX_REQUEST = 16 << 20
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
LAUNCHER_PID_ENV = "REKINDLE_LAUNCHER_PID"  # trainer.runtime.protocol's (this file imports nothing of the project)


def trainer_command(argv: list[str]) -> list[str]:
    """The plain (cold) trainer command for the same arguments: what torchelastic ran before."""
    return [sys.executable, "-u", "-m", "trainer", *argv]


def encode_request(argv: list[str], env: dict[str, str], cwd: str, stdio: list[int],
                   cpus: list[int] | None = None) -> bytes:
    """`stdio`: which of the descriptors 0, 1, 2 travel with the request, in order; `cpus`: the stub's CPU
    affinity (a NUMA binding that torchelastic gave it is the trainer's)."""
    request = {"argv": list(argv), "env": dict(env), "cwd": cwd, "stdio": list(stdio)}
    if cpus is not None:
        request["cpus"] = sorted(cpus)
    payload = json.dumps(request).encode()
    return HEADER.pack(MAGIC, len(payload)) + payload


def decode_request(data: bytes) -> tuple[dict | None, int]:
    """(request, bytes it took) once `data` holds a whole one; (None, bytes still needed) before.
    ValueError for anything that is not a request."""
    if len(data) < HEADER.size:
        return None, HEADER.size - len(data)
    magic, length = HEADER.unpack_from(data)
    if magic != MAGIC or length > MAX_REQUEST:
        raise ValueError("not a warm-start request")
    end = HEADER.size + length
    if len(data) < end:
        return None, end - len(data)
    request = json.loads(data[HEADER.size:end])
    if not (isinstance(request, dict) and isinstance(request.get("argv"), list)
            and isinstance(request.get("env"), dict) and isinstance(request.get("cwd"), str)
            and set(request.get("stdio", [None])) <= {0, 1, 2}):
        raise ValueError("malformed warm-start request")
    return request, end


def exit_like(returncode: int) -> None:
    """End this process as a child with `returncode` ended: exit with it, or die of the same signal
    (no core dump: the trainer's is the one that matters)."""
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (their action cannot be changed, nor blocked)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is to be ignored (SIGCHLD, SIGWINCH ...)


def die_with_launcher() -> None:
    """PR_SET_PDEATHSIG, as trainer.runtime.fault.die_with_launcher: a lost launcher leaves no stub behind
    (and with the stub gone, the fork server ends the trainer)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


class Relay:
    """Signals for the trainer: passed on once its pid is known, kept until then."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        if self.pid is None:
            self.pending.append(signum)
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self(signum, None)
        self.pending.clear()


def cold_start(argv: list[str], relay: Relay, why: str) -> None:
    """The plain trainer in this process (exec: same pid), unless a signal already asked it to stop."""
    if relay.pending:  # a cold trainer signalled this early would have died of it too
        exit_like(-relay.pending[0])
    print(f"[launch] warm start unavailable ({why}): starting the trainer afresh", file=sys.stderr, flush=True)
    for s in RELAYED:
        signal.signal(s, signal.SIG_DFL)
    os.execv(sys.executable, trainer_command(argv))


def read_message(stream) -> dict | None:
    """The next JSON line from the fork server; None at its end (or a line that is not one)."""
    try:
        line = stream.readline()
        message = json.loads(line) if line else None
    except (OSError, ValueError):
        return None
    return message if isinstance(message, dict) else None


def main(argv: list[str]) -> None:
    relay = Relay()
    for s in RELAYED:
        signal.signal(s, relay)
    die_with_launcher()
    path = os.environ.get(ZYGOTE_ENV, "")
    if not path:
        cold_start(argv, relay, f"${ZYGOTE_ENV} is not set")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    try:
        sock.connect(path)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        request = encode_request(argv, dict(os.environ), os.getcwd(), fds, cpus)
        socket.send_fds(sock, [request[:1]], fds)  # the descriptors travel with the first byte
        sock.sendall(request[1:])
    except OSError as e:
        sock.close()
        cold_start(argv, relay, f"fork server {path}: {e.strerror or e}")
    stream = sock.makefile("rb")
    answer = read_message(stream)
    if not answer or not isinstance(answer.get("pid"), int):
        sock.close()
        cold_start(argv, relay, (answer or {}).get("error", "the fork server closed the connection"))
    relay.started(answer["pid"])
    ended = read_message(stream)
    # No exit: the fork server died, and the trainer with it (PR_SET_PDEATHSIG, SIGKILL).
    exit_like(ended["exit"] if ended and isinstance(ended.get("exit"), int) else -signal.SIGKILL)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    main(sys.argv[1:])
