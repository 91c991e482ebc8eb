"""The trainer<->launcher contract's files: JSON-lines records survive a writer killed mid-line, the
fault-injection spec names a step and optionally a rank, and heartbeats round-trip."""

from __future__ import annotations

from trainer.runtime.protocol import HEARTBEAT_DIR_ENV, Heartbeat, append_jsonl, injected, read_heartbeats, read_jsonl


def test_a_torn_line_costs_only_itself(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    append_jsonl(path, {"step": 3})
    assert read_jsonl(path) == [{"step": 1}, {"step": 3}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_injection_spec_names_a_step_and_optionally_a_rank():
    assert injected("5", 5, 0) and injected("5", 5, 3)
    assert injected("5:1", 5, 1) and not injected("5:1", 5, 0)
    assert not injected("5", 4, 0) and not injected("", 5, 0)


def test_heartbeat_records_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    beat = Heartbeat(rank=3)
    beat.beat("train", step=7, busy_s=1.5)
    record = read_heartbeats(tmp_path)[3]
    assert (record["phase"], record["step"], record["busy_s"]) == ("train", 7, 1.5) and record["t_first"] > 0
    beat.close()
    assert read_heartbeats(tmp_path)[3]["phase"] == "done"


def test_sigusr1_prints_every_threads_stack_and_the_rank_goes_on():
    """trainer.runtime.fault.stacks_on_sigusr1: where a stuck rank is, for the launcher's log."""
    import subprocess
    import sys

    code = ("import os, signal, time\nfrom trainer.runtime import fault\nfault.stacks_on_sigusr1()\n"
            "def waiting_here():\n    os.kill(os.getpid(), signal.SIGUSR1)\n    time.sleep(0.2)\n"
            "waiting_here()\nprint('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "still running" in done.stdout, done.stderr[-2000:]
    assert "Current thread" in done.stderr and "waiting_here" in done.stderr, done.stderr[-2000:]
