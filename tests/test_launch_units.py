"""The launcher's parts on their own: restart policy decisions, the watchdog's diagnosis of real
stopped / spinning / waiting processes, goodput accounting, CLI errors, and the cluster recipes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO, SMOKE

from launch.ledger import Attempt, Ledger
from launch.policy import EXIT_CRASH_LOOP, EXIT_FAILED, EXIT_USAGE, Failure, RestartPolicy
from launch.watchdog import Watchdog


def kill(step: int, rank: int = 1) -> Failure:
    return Failure(rank, "signal", step, -9, "SIGKILL")


def test_policy_restarts_at_once_after_progress_and_backs_off_without_it():
    policy = RestartPolicy(max_restarts=10, backoff_s=1.0, crash_loop_repeats=5)
    assert policy.decide(kill(30)).delay_s == 0.0
    assert policy.decide(kill(50)).delay_s == 0.0  # got further: no backoff
    assert policy.decide(kill(45)).delay_s == 1.0  # no progress past step 50
    assert policy.decide(kill(48)).delay_s == 2.0
    assert policy.decide(kill(60)).delay_s == 0.0  # progress again


def test_policy_stops_a_crash_loop_before_the_budget_is_spent():
    policy = RestartPolicy(max_restarts=10, crash_loop_repeats=3)
    boom = Failure(1, "exit", 12, 1, message="RuntimeError: boom")
    assert policy.decide(boom).restart and policy.decide(boom).restart
    decision = policy.decide(boom)
    assert not decision.restart and decision.exit_code == EXIT_CRASH_LOOP
    assert "crash loop" in decision.reason and "step 12" in decision.reason and "RuntimeError: boom" in decision.reason
    assert policy.restarts == 2  # 8 of 10 restarts were not wasted


def test_policy_budget_and_bad_input():
    policy = RestartPolicy(max_restarts=1)
    assert policy.decide(kill(5)).restart
    spent = policy.decide(kill(9))
    assert not spent.restart and spent.exit_code == EXIT_FAILED and "budget" in spent.reason
    bad = RestartPolicy(max_restarts=5).decide(Failure(0, "exit", 1, EXIT_USAGE, message="ConfigError: x"))
    assert not bad.restart and bad.exit_code == EXIT_USAGE


def test_the_same_hang_again_and_again_is_a_crash_loop():
    """A hang's message names the pid and how long the rank was stale, which differ every time; its
    key does not, so a deterministic deadlock stops early instead of spending the restart budget."""
    policy = RestartPolicy(max_restarts=10, crash_loop_repeats=3)
    hangs = [Failure(0, "hang", 13, message=f"rank 0 (pid {pid}) is stopped: no step finished for {s}s after step 12",
                     key="rank 0 stopped") for pid, s in ((101, 60.1), (202, 60.4), (303, 60.2))]
    assert policy.decide(hangs[0]).restart and policy.decide(hangs[1]).restart
    assert policy.decide(hangs[2]).exit_code == EXIT_CRASH_LOOP


def test_nproc_per_node_takes_torchruns_words():
    from launch.__main__ import nproc_per_node

    assert nproc_per_node("3") == 3
    assert nproc_per_node("cpu") == (os.cpu_count() or 1)
    assert nproc_per_node("auto") == (os.cpu_count() or 1)  # no GPU here: the CPUs
    with pytest.raises(ValueError):
        nproc_per_node("gpu")  # asked for GPUs, there are none
    with pytest.raises(ValueError):
        nproc_per_node("many")


def test_goodput_counts_only_steps_that_survived(tmp_path):
    ledger = Ledger(tmp_path, started=0.0)
    # attempt 0 ran steps 1..50 in 50s; the next attempt resumed from 40: steps 41..50 were lost.
    ledger.attempts = [Attempt(0, 0.0, resumed_step=0, last_step=50, busy_s=50.0, steps_run=50),
                       Attempt(1, 60.0, resumed_step=40, last_step=100, busy_s=60.0, steps_run=60)]
    assert ledger.productive_s() == pytest.approx(40.0 + 60.0)
    ledger.resumes = [{"step": 40, "lost_steps": 10, "recovery_s": 5.0}]
    summary = ledger.summary(ended=125.0)
    assert summary["goodput"] == pytest.approx(100 / 125, abs=1e-4)
    assert summary["lost_s"] == pytest.approx(5.0 + 10.0)  # the recovery, and the 10 steps redone
    assert summary["steps_kept"] == 100


def _beat(directory, rank: int, pid: int, age_s: float) -> None:
    now = time.time()
    record = {"pid": pid, "rank": rank, "attempt": 0, "phase": "train", "step": 7, "t": now - age_s,
              "t_first": now - 100, "busy_s": 1.0, "steps_run": 7}
    (directory / f"rank-{rank}.json").write_text(json.dumps(record))


def test_watchdog_tells_stopped_spinning_and_waiting_ranks_apart(tmp_path):
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    waiting = subprocess.Popen(["sleep", "60"])
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        dog = Watchdog(tmp_path, hang_timeout_s=5)
        _beat(tmp_path, 0, waiting.pid, age_s=1)  # fresh: fine
        assert dog.check(attempt=0) is None
        for rank, proc in enumerate([waiting, spinning, stopped]):
            _beat(tmp_path, rank, proc.pid, age_s=10)
        dog.check(attempt=0)
        time.sleep(1.2)  # a CPU-time sample a second apart tells spinning from waiting
        hang = dog.check(attempt=0)
        assert (hang.rank, hang.state) == (2, "stopped") and "stopped" in hang.describe()
        (tmp_path / "rank-2.json").unlink()
        assert (dog.check(attempt=0).rank, dog.check(attempt=0).state) == (1, "spinning")
        (tmp_path / "rank-1.json").unlink()
        time.sleep(1.2)
        hang = dog.check(attempt=0)
        assert (hang.rank, hang.state) == (0, "waiting")
        assert dog.check(attempt=1) is None  # records of another attempt are ignored
    finally:
        for p in (spinning, waiting, stopped):
            p.kill()
            p.wait(timeout=10)


def test_launcher_rejects_bad_arguments_and_config_before_starting_anything(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60)

    bad_nodes = run("--nnodes", "3:1", str(SMOKE))
    assert bad_nodes.returncode == 2 and "--nnodes" in bad_nodes.stderr
    env = {**os.environ, "PET_NPROC_PER_NODE": "auto"}  # the Kubeflow operator's default: a valid value
    auto = subprocess.run([sys.executable, "-m", "launch", "--nproc-per-node", "0", str(SMOKE)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert auto.returncode == 2 and "--nproc-per-node" in auto.stderr and "Traceback" not in auto.stderr
    bad_key = run(str(SMOKE), f"run.dir={tmp_path}", "fault.hang_timeot_s=3")
    assert bad_key.returncode == 2 and "did you mean 'fault.hang_timeout_s'" in bad_key.stderr
    assert not (tmp_path / "events.jsonl").exists()


def test_slurm_recipe_is_valid_shell_and_runs_the_launcher():
    script = REPO / "launch" / "cluster" / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert "#SBATCH --nodes" in text and "srun" in text and "-m launch" in text
    assert "--rdzv-endpoint" in text and "--nnodes" in text
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "error", str(script)], check=True, timeout=60)


def test_kubernetes_recipe_is_an_elastic_pytorchjob():
    docs = list(yaml.safe_load_all((REPO / "launch" / "cluster" / "pytorchjob.yaml").read_text()))
    job = next(d for d in docs if d and d.get("kind") == "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    policy = spec["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] <= policy["maxReplicas"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    command = " ".join(container["command"] + container.get("args", []))
    assert container["name"] == "pytorch" and "launch" in command
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] >= 30  # room for the emergency checkpoint
