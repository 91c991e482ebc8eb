"""One job per directory (trainer.lease), on real files and on a loopback S3 endpoint: a live job's
lease refuses another job naming its holder; a dead or silent holder's lease is taken over, saying why;
the ranks of one job share it; a clean end removes it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from trainer import lease, storage
from trainer.lease import LEASE, DirectoryInUse, Lease


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
        assert Lease(directory, ttl_s=30).acquire() is None
    finally:
        first.release()
    fs, p = storage.filesystem(storage.join(directory, LEASE))
    assert not fs.exists(p)  # a clean end removes it

    as_job(monkeypatch, "job-b")
    write_holder(directory, host="elsewhere", pid=4242, renewed=time.time())  # live on another host
    with pytest.raises(DirectoryInUse, match="pid 4242 on elsewhere"):
        Lease(directory, ttl_s=30).acquire()
    write_holder(directory, host="elsewhere", pid=4242, renewed=time.time() - 60)  # silent for 60 s
    taken = Lease(directory, ttl_s=30)
    holder, why = taken.acquire()
    taken.release()
    assert (holder.host, holder.pid) == ("elsewhere", 4242) and why.startswith("not renewed for 6")
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
        time.sleep(0.8)
        assert json.loads((tmp_path / LEASE).read_text())["renewed"] > first
    finally:
        held.release()
