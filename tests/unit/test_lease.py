"""One job per directory (trainer.runtime.lease), on real files and on a loopback S3 endpoint: a live job's
lease refuses another job naming its holder; a dead or silent holder's lease is taken over, saying why;
the ranks of one job share it; a clean end removes it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from common import storage
from tests.helpers import wait_for
from trainer.runtime import lease
from trainer.runtime.lease import LEASE, DirectoryInUse, Lease


def as_job(monkeypatch, job: str) -> None:
    monkeypatch.setenv(lease.JOB_ENV, job)


def write_holder(directory: str, **fields) -> None:
    record = {"job": "other", "host": socket.gethostname(), "pid": 1, "started": 0.0, "renewed": time.time(),
              **fields}
    fs, p = storage.filesystem(storage.join(directory, LEASE))
    fs.makedirs(storage.filesystem(directory)[1], exist_ok=True)
    fs.pipe_file(p, json.dumps(record).encode())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def renew_in_background(directory: str, stop: threading.Event, **fields) -> threading.Thread:
    """Another host's live holder: it rewrites its lease every 0.1 s."""
    write_holder(directory, **fields)

    def renew() -> None:
        while not stop.wait(0.1):
            write_holder(directory, **fields)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    return thread


def check_lease_rules(directory: str, monkeypatch) -> None:
    as_job(monkeypatch, "job-a")
    first = Lease(directory, ttl_s=30)
    assert first.acquire() is None
    try:
        as_job(monkeypatch, "job-b")  # another job, while job-a's holder (this very process) lives
        with pytest.raises(DirectoryInUse, match=rf"in use by another job \(job job-a: pid \d+ on "
                                                 rf"{socket.gethostname()}, running since"):
            Lease(directory, ttl_s=30).acquire()
        as_job(monkeypatch, "job-a")  # the same job (a restarted rank 0): shares it
        again = Lease(directory, ttl_s=30)
        assert again.acquire() is None
        again.release()  # (the lease now names `again`: releasing `first` below leaves it alone)
    finally:
        first.release()
    fs, p = storage.filesystem(storage.join(directory, LEASE))
    assert not fs.exists(p)  # a clean end removes it

    as_job(monkeypatch, "job-b")
    stop = threading.Event()
    renewing = renew_in_background(directory, stop, host="elsewhere", pid=4242)  # live on another host
    try:
        with pytest.raises(DirectoryInUse, match="pid 4242 on elsewhere"):
            Lease(directory, ttl_s=1.0).acquire()
    finally:
        stop.set()
        renewing.join()
    write_holder(directory, host="elsewhere", pid=4242, renewed=time.time() + 3600)  # silent (its clock: ahead)
    taken, start = Lease(directory, ttl_s=1.0), time.monotonic()
    holder, why = taken.acquire()
    taken.release()
    assert (holder.host, holder.pid, why) == ("elsewhere", 4242, "not renewed for 1s (run.lease_s)")
    assert 1.0 <= time.monotonic() - start < 10
    write_holder(directory, pid=dead_pid())  # this host, its process gone
    taken = Lease(directory, ttl_s=30)
    assert taken.acquire()[1] == "its holder is dead"
    taken.release()


def test_lease_rules_on_a_local_directory(tmp_path, monkeypatch):
    check_lease_rules(str(tmp_path / "run"), monkeypatch)


def test_lease_rules_on_s3(s3_bucket, monkeypatch):
    check_lease_rules(f"{s3_bucket}/ckpt", monkeypatch)


def test_the_lease_is_renewed_while_held(tmp_path, monkeypatch):
    as_job(monkeypatch, "job-a")
    held = Lease(str(tmp_path), ttl_s=0.6)
    held.acquire()
    try:
        first = json.loads((tmp_path / LEASE).read_text())["renewed"]
        # Renewed every ttl/3 (0.2 s): the renewal is seen as soon as it is written, within 0.8 s.
        took = wait_for("renewal of the lease", lambda: json.loads((tmp_path / LEASE).read_text())["renewed"] > first,
                        10, every=0.02)
        assert took <= 0.8, took
    finally:
        held.release()


def test_two_jobs_starting_together_cannot_both_get_the_lease(tmp_path, monkeypatch):
    leases = []
    for job in ("job-a", "job-b"):
        as_job(monkeypatch, job)
        leases.append(Lease(str(tmp_path), ttl_s=30))
    outcomes: list[str] = []

    def take(each: Lease) -> None:
        try:
            each.acquire()
            outcomes.append("held")
        except DirectoryInUse:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(each,)) for each in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for each in leases:
        each.release()
    assert sorted(outcomes) == ["held", "refused"]


def test_a_holder_whose_lease_was_taken_over_stops(tmp_path, monkeypatch):
    """While this job was silent, another took the lease over: its next renewal says so (on_lost)."""
    as_job(monkeypatch, "job-a")
    lost = threading.Event()
    said: list[str] = []
    held = Lease(str(tmp_path), ttl_s=0.6, on_lost=lambda message: (said.append(message), lost.set()))
    held.acquire()
    try:
        write_holder(str(tmp_path), job="job-b", host="elsewhere", pid=99)
        assert lost.wait(5)
        assert "lost the lease on" in said[0] and "job job-b: pid 99 on elsewhere" in said[0]
        assert json.loads((tmp_path / LEASE).read_text())["job"] == "job-b"  # and it did not write over it
    finally:
        held.release()
    assert (tmp_path / LEASE).exists()  # not ours: left alone
