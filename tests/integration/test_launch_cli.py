"""The launcher's parts with real processes: the watchdog's diagnosis of real stopped / spinning /
waiting processes, CLI errors of `python -m launch` before anything starts, and the Slurm recipe
(checked by bash, and shellcheck where installed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from common.process import proc_stat
from launch.watchdog import Watchdog
from tests.helpers import REPO, SMOKE, wait_for
from trainer.runtime.protocol import HeartbeatRecord, StartupTimes, TrainingProgress


def _beat(directory, rank: int, pid: int, age_s: float, phase: str = "train") -> None:
    now = time.time()
    record = HeartbeatRecord(pid=pid, rank=rank, attempt=0, phase=phase, step=7, t=now - age_s,
                             startup=StartupTimes(t_first=now - 100),
                             progress=TrainingProgress(busy_s=1.0, steps_run=7))
    (directory / f"rank-{rank}.json").write_text(json.dumps(record.to_json()))


def cpu_s(pid: int) -> float:
    """The CPU time a process has used (user + system), in seconds."""
    return proc_stat(pid)[1] / os.sysconf("SC_CLK_TCK")


def spun_a_second(pid: int) -> None:
    """Wait (bounded) until the spinning process `pid` has used another second of CPU time: a second at least
    has passed (the watchdog samples CPU time a second apart), and it spun all along."""
    start = cpu_s(pid)
    wait_for("second of the spinning process's CPU time", lambda: cpu_s(pid) - start >= 1.0, 30, every=0.05)


def test_watchdog_tells_stopped_spinning_and_waiting_ranks_apart(tmp_path):
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    waiting = subprocess.Popen(["sleep", "60"])
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        # As the watchdog will see them: the SIGSTOP taken effect, `sleep` asleep (not still starting).
        wait_for("stopped process and sleeping one", lambda: proc_stat(stopped.pid)[0] in "Tt"
                 and proc_stat(waiting.pid)[0] == "S", 10, every=0.01)
        dog = Watchdog(tmp_path, hang_timeout_s=5)
        _beat(tmp_path, 0, waiting.pid, age_s=1)  # fresh: fine
        assert dog.check(attempt=0) is None
        for rank, proc in enumerate([waiting, spinning, stopped]):
            _beat(tmp_path, rank, proc.pid, age_s=10)
        dog.check(attempt=0)
        spun_a_second(spinning.pid)  # a CPU-time sample a second apart tells spinning from waiting
        hang = dog.check(attempt=0)
        assert (hang.rank, hang.state) == (2, "stopped") and "stopped" in hang.describe()
        (tmp_path / "rank-2.json").unlink()
        assert (dog.check(attempt=0).rank, dog.check(attempt=0).state) == (1, "spinning")
        (tmp_path / "rank-1.json").unlink()
        spun_a_second(spinning.pid)  # the next sample, a second later: the sleeping process used no CPU time
        hang = dog.check(attempt=0)
        assert (hang.rank, hang.state) == (0, "waiting")
        assert dog.check(attempt=1) is None  # records of another attempt are ignored
    finally:
        for p in (spinning, waiting, stopped):
            p.kill()
            p.wait(timeout=10)


def test_a_stopped_rank_is_blamed_even_if_a_peer_became_overdue_first(tmp_path):
    """The peer finished its last step a moment earlier, so it is overdue first; it only waits for the
    stopped rank. A stopped rank alone, not yet overdue, is no hang."""
    waiting = subprocess.Popen(["sleep", "60"])
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        wait_for("stopped process", lambda: proc_stat(stopped.pid)[0] in "Tt", 10, every=0.01)  # SIGSTOP takes effect
        dog = Watchdog(tmp_path, hang_timeout_s=5)
        _beat(tmp_path, 1, stopped.pid, age_s=3)
        assert dog.check(attempt=0) is None
        _beat(tmp_path, 0, waiting.pid, age_s=6)
        hang = dog.check(attempt=0)
        assert (hang.rank, hang.state) == (1, "stopped"), hang
        _beat(tmp_path, 0, waiting.pid, age_s=1)  # the peer moved on: nothing is overdue
        assert dog.check(attempt=0) is None
    finally:
        for p in (waiting, stopped):
            p.kill()
            p.wait(timeout=10)

def test_a_rank_stuck_in_a_checkpoint_save_is_reported_as_such(tmp_path):
    """A storage that accepts connections and never answers leaves a rank asleep in a save: the
    diagnosis says where it was (its heartbeat's phase), and the same hang elsewhere is another failure."""
    from launch.failures import from_hang

    waiting = subprocess.Popen(["sleep", "60"])
    try:
        wait_for("sleeping process", lambda: proc_stat(waiting.pid)[0] == "S", 10, every=0.01)  # as in a blocked read
        dog = Watchdog(tmp_path, hang_timeout_s=5)
        _beat(tmp_path, 0, waiting.pid, age_s=10, phase="save")
        hang = dog.check(attempt=0)
        assert (hang.state, hang.phase) == ("waiting", "save"), hang
        assert "is waiting (in a collective or I/O) while saving a checkpoint (is the checkpoint storage " \
               "answering?): no step finished for" in hang.describe()
        _beat(tmp_path, 0, waiting.pid, age_s=10)
        in_training = dog.check(attempt=0)
        assert "while" not in in_training.describe()
        assert from_hang(hang).signature() != from_hang(in_training).signature()
    finally:
        waiting.kill()
        waiting.wait(timeout=10)


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
