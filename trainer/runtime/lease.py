"""One job per directory: rank 0 holds a lease, `LEASE.json`, on the run directory and on the
checkpoint directory (local or object storage) for the whole run, and renews it every `ttl/3`
seconds. A job that finds a lease held by another job refuses to start (`DirectoryInUse`, exit 2),
naming the holder's host, pid and start time, unless the holder is gone: on this host, its process is
dead; on another host, the lease is not renewed while this job watches it for `ttl` seconds (no clocks
of two machines are compared). Then the job takes the lease over and says so (the caller records a
`lease_taken` event). The ranks of one job, over its restarts, share a lease: its job id is the
launcher's ($REKINDLE_JOB), torchrun's run id, or this process.

A new lease is created exclusively (a hard link locally, If-None-Match on S3), so two jobs that start
together cannot both get it. Each renewal first reads the lease: a holder that finds another job's
lease there (it was taken over while this one was silent) stops the run (`on_lost`).

The launcher's lock on run.dir (launch.lock) says "one job per directory" too, and both are needed: the
lock is the launcher's, local and taken before any rank starts, shared by the launchers of one job; the
lease is rank 0's, covers checkpoint.dir on object storage as well, and holds under plain torchrun or a
single process, where no launcher runs. Torch-free."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from common import storage
from common.process import is_alive, process_start_time
from common.timing import SETTLE_S

LEASE = "LEASE.json"
JOB_ENV = "REKINDLE_JOB"  # set by the launcher: the job (its nodes and restarts) that owns the lease


class DirectoryInUse(RuntimeError):
    """Another live job holds the lease on a directory. Bad input (exit 2): restarting cannot fix it."""


def job_id() -> str:
    """This process's job: the launcher's job, torchrun's run id, or this host and process."""
    if os.environ.get(JOB_ENV):
        return os.environ[JOB_ENV]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    return f"process:{socket.gethostname()}:{os.getpid()}"


@dataclass
class Holder:
    job: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=process_start_time)  # the holder's process start (unix time)
    renewed: float = field(default_factory=time.time)

    def describe(self) -> str:
        return (f"job {self.job}: pid {self.pid} on {self.host}, running since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}")

    def same_process(self, other: Holder) -> bool:
        return (self.job, self.host, self.pid) == (other.job, other.host, other.pid)


class Lease:
    """The lease on one directory (a path or URL), held by this process for its job. `on_lost(message)`
    is called (from the renewal thread) if another job holds the lease at a renewal."""

    def __init__(self, directory: str, ttl_s: float, on_lost: Callable[[str], None] | None = None) -> None:
        self.directory, self.ttl_s, self.on_lost = directory, ttl_s, on_lost
        self.url = storage.join(directory, LEASE)
        self.holder = Holder(job_id())
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one write at a time; none after release
        self._thread: threading.Thread | None = None

    def _read(self) -> Holder | None:
        fs, p = storage.filesystem(self.url)
        try:
            record = json.loads(fs.cat_file(p))
            return Holder(**{k: record[k] for k in ("job", "host", "pid", "started", "renewed")})
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):  # a torn or foreign file: nobody holds it
            return None

    def _record(self) -> bytes:
        self.holder.renewed = time.time()
        return json.dumps(asdict(self.holder)).encode()

    def _write(self) -> None:
        fs, p = storage.filesystem(self.url)
        storage.write_file(fs, p, self._record())

    def _create(self) -> bool:
        """Write the lease only if there is none (atomically); whether this process created it."""
        fs, p = storage.filesystem(self.url)
        fs.makedirs(storage.filesystem(self.directory)[1], exist_ok=True)
        try:
            storage.write_file(fs, p, self._record(), exclusive=True)  # two creators cannot both succeed
        except FileExistsError:
            return False
        return True

    def _gone(self, holder: Holder) -> str:
        """Why `holder` (another job's) no longer holds the lease, or '' while it does."""
        if holder.host == socket.gethostname():
            if not is_alive(holder.pid) or abs(process_start_time(holder.pid) - holder.started) > 1.0:
                return "its holder is dead"
            return ""
        deadline = time.monotonic() + self.ttl_s  # another host: alive only if it renews while we watch
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.ttl_s / 10))
            now = self._read()
            if now is None:
                return "its holder released it"
            if not now.same_process(holder) or now.renewed != holder.renewed:
                return ""
        return f"not renewed for {self.ttl_s:g}s (run.lease_s)"

    def acquire(self) -> tuple[Holder, str] | None:
        """Hold the lease and keep renewing it. Returns (previous holder, why) when another job's lease
        was taken over, else None. Raises DirectoryInUse when another job holds it."""
        previous = self._read()
        taken = None
        if previous is None:
            if not self._create():
                previous = self._read()  # another job created it just now
                if previous is not None and previous.job != self.holder.job:
                    raise DirectoryInUse(self._in_use(previous))
                self._write()
        elif previous.job == self.holder.job:
            self._write()  # a restart of this job
        else:
            why = self._gone(previous)
            if not why:
                raise DirectoryInUse(self._in_use(self._read() or previous))
            taken = (previous, why)
            self._write()
            time.sleep(SETTLE_S)  # two jobs taking over the same dead lease: the later write wins
            now = self._read()
            if now is not None and not now.same_process(self.holder):
                raise DirectoryInUse(self._in_use(now))
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()
        return taken

    def _in_use(self, holder: Holder) -> str:
        return (f"{self.directory} is in use by another job ({holder.describe()}): stop it, or give this run "
                f"another run.dir / checkpoint.dir; a lease its holder stops renewing for run.lease_s="
                f"{self.ttl_s:g}s is taken over")

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                now = self._read()
                with self._lock:
                    if self._stop.is_set():
                        return
                    if now is not None and now.job != self.holder.job:
                        if self.on_lost is not None:
                            self.on_lost(f"lost the lease on {self.directory} to another job ({now.describe()}): "
                                         "this job was silent for longer than run.lease_s; stopping")
                        return
                    self._write()
            except Exception:  # noqa: BLE001 - storage trouble is the save's to report; try again next time
                continue

    def release(self) -> None:
        """Stop renewing and remove the lease if this very process still holds it (a clean end)."""
        with self._lock:
            self._stop.set()
        holder = self._read()
        if holder is not None and holder.same_process(self.holder):
            fs, p = storage.filesystem(self.url)
            fs.rm_file(p)
