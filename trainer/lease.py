"""One job per directory: rank 0 holds a lease, `LEASE.json`, on the run directory and on the
checkpoint directory (local or object storage) for the whole run, and renews it every `ttl/3`
seconds. A job finds a lease held by another job and refuses to start (`DirectoryInUse`, exit 2),
naming the holder's host, pid and start time, unless the lease is stale: its holder is dead (same host,
the pid gone or another process) or has not renewed it for `ttl` seconds. Then the job takes it over,
and says so (the caller records a `lease_taken` event). The ranks of one job, over its restarts, share
a lease: its job id is the launcher's ($REKINDLE_JOB), torchrun's run id, or this process.

Object stores have no lock: two jobs that start within the same second could both write a lease. The
later write wins and the earlier job sees a holder other than itself when it reads the lease back after
`SETTLE_S`, and refuses. Torch-free."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field

from trainer import storage
from trainer.process import is_alive, process_start_time

LEASE = "LEASE.json"
JOB_ENV = "REKINDLE_JOB"  # set by the launcher: the job (its nodes and restarts) that owns the lease
SETTLE_S = 0.3  # a competing write lands within this (a read after it tells who won)


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

    def stale(self, ttl_s: float, now: float) -> str:
        """Why this lease may be taken over ('' while its holder lives)."""
        if self.host == socket.gethostname():
            if not is_alive(self.pid) or abs(process_start_time(self.pid) - self.started) > 1.0:
                return "its holder is dead"
            return ""
        if now - self.renewed > ttl_s:
            return f"not renewed for {now - self.renewed:.0f}s (run.lease_s={ttl_s:g})"
        return ""


class Lease:
    """The lease on one directory (a path or URL), held by this process for its job."""

    def __init__(self, directory: str, ttl_s: float) -> None:
        self.directory, self.ttl_s = directory, ttl_s
        self.url = storage.join(directory, LEASE)
        self.holder = Holder(job_id())
        self._stop = threading.Event()
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

    def _write(self) -> None:
        self.holder.renewed = time.time()
        fs, p = storage.filesystem(self.url)
        fs.makedirs(storage.filesystem(self.directory)[1], exist_ok=True)
        storage.write_file(fs, p, json.dumps(asdict(self.holder)).encode())

    def acquire(self) -> tuple[Holder, str] | None:
        """Hold the lease and keep renewing it. Returns (previous holder, why) when a stale lease of another
        job was taken over, else None. Raises DirectoryInUse when a live job of another id holds it."""
        previous = self._read()
        taken = None
        if previous is not None and previous.job != self.holder.job:
            why = previous.stale(self.ttl_s, time.time())
            if not why:
                raise DirectoryInUse(self._in_use(previous))
            taken = (previous, why)
        self._write()
        if previous is None or previous.job != self.holder.job:  # (a restart of this job: nobody to race)
            time.sleep(SETTLE_S)
            now = self._read()
            if now is not None and now.job != self.holder.job:  # another job wrote it at the same time, and won
                raise DirectoryInUse(self._in_use(now))
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()
        return taken

    def _in_use(self, holder: Holder) -> str:
        return (f"{self.directory} is in use by another job ({holder.describe()}; renewed "
                f"{time.time() - holder.renewed:.0f}s ago): stop it, or give this run another run.dir / "
                f"checkpoint.dir; a lease not renewed for run.lease_s={self.ttl_s:g}s is taken over")

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - storage trouble is the save's to report; try again next time
                continue

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this job's (a clean end of the run)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = self._read()
        if holder is not None and holder.job == self.holder.job:
            fs, p = storage.filesystem(self.url)
            fs.rm_file(p)
