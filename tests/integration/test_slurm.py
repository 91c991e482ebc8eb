"""Slurm, really: Debian's slurm-wlm and munge on this host (one slurmctld and two slurmd "nodes",
each daemon under its own user, as on a cluster), `launch/cluster/slurm.sbatch` submitted as it is on
2 nodes under `--nnodes 1:2`: one node is lost (its processes SIGKILLed, the node marked DOWN) and the
other goes on alone; that one is then preempted with SIGTERM (what the recipe's `--signal=TERM@180`
sends before the time limit), the recipe requeues the job, and both nodes resume from the emergency
checkpoint with no step lost. (Two nodes preempted together agree on the step they commit:
test_launch_preemption.py, without Slurm.)

Needs root (the daemons switch users; the recipe's rendezvous host, the first node's name, must
resolve, so a line is added to /etc/hosts) and the packages, which are installed with apt-get when
missing (about 10 s from a Debian mirror). Skipped, saying why, without root, without apt-get, or
when the install fails (no network). Everything it starts (munged, slurmctld, both slurmd, the job's
processes) is stopped at the end and /etc/hosts is restored; every wait is bounded. Marked `slurm`:
`-m "not slurm"` leaves it out; REKINDLE_SLURM_KEEP=1 keeps its directory (/tmp/rekindle-slurm-*:
slurm.conf, the daemons' logs, the job's output and run directory) for a look afterwards."""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO, SMOKE, child_env, free_port, read_metrics
from trainer.runtime.protocol import read_events, read_heartbeats

pytestmark = pytest.mark.slurm

PACKAGES = ["slurm-wlm", "munge"]
BINARIES = ["munged", "mungekey", "munge", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol",
            "scancel", "sinfo"]
NODES = ("rkn1", "rkn2")  # the Slurm node names; both are this host
HOSTS_LINE = f"127.0.0.1 {' '.join(NODES)}  # rekindle tests/integration/test_slurm.py\n"
STEPS = 240  # seconds of smoke training (0.02-0.05 s a step): time to lose a node and be signalled mid-run
#              (the survivor alone trains a step in about 0.02 s: the signal must come before its last)
LOSE_AFTER = 20  # a node is lost once rank 0 has finished this step
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")


def ensure_packages() -> None:
    """slurm-wlm and munge installed (apt-get when missing), or the test skipped saying why."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the Slurm and munge daemons run under their own users and /etc/hosts is edited")
    if all(which(b) for b in BINARIES):
        return
    if not which("apt-get"):
        pytest.skip("slurm-wlm and munge are not installed and there is no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    for cmd, limit in ((["apt-get", "update", "-qq"], 60), (install, 150)):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`{' '.join(cmd)}` took over {limit}s (no network to a Debian mirror?)")
        if proc.returncode != 0:
            pytest.skip(f"`{' '.join(cmd)}` failed with exit {proc.returncode} (no network to a Debian mirror?): "
                        f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    missing = [b for b in BINARIES if not which(b)]
    if missing:
        pytest.skip(f"installed {' '.join(PACKAGES)}, and still no {', '.join(missing)}")


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path.name}: none)"


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def processes_with(marker: bytes) -> list[int]:
    """The processes whose environment holds `marker` (this cluster's SLURM_CONF=...): its daemons'
    children (slurmstepd) and the job's processes, which the daemons do not take down with them."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class Cluster:
    """munged, slurmctld and one slurmd per node of NODES, all on this host, in a fresh directory
    (state, spool, logs, munge key and socket) with ports that were free; `slurm()` runs a client."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rekindle-slurm-", dir="/tmp"))  # not pytest's: 0700 root
        self.dir.chmod(0o755)  # the munge and slurm users reach their own folders through it
        self.conf = self.dir / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.jobs: list[str] = []
        self.hosts: bytes | None = None

    @property
    def env(self) -> dict[str, str]:
        return child_env(SLURM_CONF=str(self.conf))

    def slurm(self, *args: str, timeout: float = 30, check: bool = True, env: dict[str, str] | None = None) -> str:
        proc = subprocess.run(args, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr}\n{self.logs()}")
        return proc.stdout

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{tail(p, 25)}" for p in sorted((self.dir / "log").glob("*.log")))

    def daemon(self, cmd: list[str], log: str, **kwargs) -> subprocess.Popen:
        with open(self.dir / "log" / log, "ab") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    **kwargs)
        self.daemons.append(proc)
        return proc

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        slurm, munge = pwd.getpwnam("slurm"), pwd.getpwnam("munge")
        d = self.dir
        for sub in ("state", "log", "spool", "munge", "jobs"):
            (d / sub).mkdir(mode=0o755)
        os.chown(d / "state", slurm.pw_uid, slurm.pw_gid)
        os.chown(d / "log", slurm.pw_uid, slurm.pw_gid)
        os.chown(d / "munge", munge.pw_uid, munge.pw_gid)
        key, sock = d / "munge" / "munge.key", d / "munge" / "socket"
        subprocess.run([which("mungekey"), "--create", f"--keyfile={key}"], check=True, timeout=30)
        os.chown(key, munge.pw_uid, munge.pw_gid)
        key.chmod(0o600)
        self.daemon([which("munged"), "--foreground", f"--key-file={key}", f"--socket={sock}",
                     f"--pid-file={d / 'munge' / 'munged.pid'}", f"--seed-file={d / 'munge' / 'seed'}"],
                    "munged.log", user="munge", group="munge")
        self.wait(lambda: sock.exists(), 20, "munged's socket")

        self.hosts = Path("/etc/hosts").read_bytes()  # written back in place (a bind mount in containers)
        Path("/etc/hosts").write_bytes(self.hosts + (b"" if self.hosts.endswith(b"\n") else b"\n") +
                                       HOSTS_LINE.encode())

        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 "
                          f"RealMemory=1000 State=UNKNOWN" for n in NODES)
        self.conf.write_text(f"""\
ClusterName=rekindle-ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=10
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'log'}/slurmctld.pid
SlurmdPidFile={d / 'log'}/slurmd-%n.pid
SlurmctldLogFile={d / 'log'}/slurmctld.log
SlurmdLogFile={d / 'log'}/slurmd-%n.log
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.daemon([which("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld.out")
        for n in NODES:
            self.daemon([which("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")

        def idle() -> bool:
            out = self.slurm(which("sinfo"), "-h", "-N", "-t", "idle", "-o", "%N", check=False, timeout=10)
            return len(out.split()) == len(NODES)

        self.wait(idle, 60, f"{len(NODES)} idle nodes")

    def wait(self, ready, timeout: float, what: str, every: float = 0.5, explain=None) -> None:
        """Until ready() (bounded); a daemon that exits meanwhile fails at once. `explain()`: what to show."""
        deadline = time.time() + timeout
        while not ready():
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise AssertionError(f"{proc.args[0]} exited {proc.returncode} while waiting for {what}\n"
                                         f"{explain() if explain else self.logs()}")
            if time.time() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f}s\n{explain() if explain else self.logs()}")
            time.sleep(every)

    # ------------------------------------------------------------------ jobs
    def submit(self, name: str, env: dict[str, str], *args: str) -> str:
        job = self.slurm(which("sbatch"), "--parsable", f"--job-name={name}", f"--chdir={self.dir / 'jobs'}",
                         "--cpus-per-task=1", f"--output={self.dir / 'jobs'}/%x-%j.out",
                         str(REPO / "launch" / "cluster" / "slurm.sbatch"), *args, env=env).strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        out = self.slurm(which("scontrol"), "show", "job", "-o", job, check=False, timeout=10)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        try:
            slurmctld = self.daemons[1] if len(self.daemons) > 1 else None
            if self.jobs and slurmctld is not None and slurmctld.poll() is None:
                self.slurm(which("scancel"), *self.jobs, check=False, timeout=15)
                deadline = time.time() + 20
                while time.time() < deadline and self.slurm(which("squeue"), "-h", "-j", ",".join(self.jobs),
                                                            check=False, timeout=10).strip():
                    time.sleep(0.5)
        except (subprocess.TimeoutExpired, OSError):
            pass
        finally:
            for proc in reversed(self.daemons):  # the slurmds, slurmctld, then munged
                stop(proc)
            for pid in processes_with(f"SLURM_CONF={self.conf}".encode()):  # slurmstepd, leftover ranks
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.hosts is not None:
                Path("/etc/hosts").write_bytes(self.hosts)
            if not os.environ.get("REKINDLE_SLURM_KEEP"):  # =1: keep the logs, state and run directory
                shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    ensure_packages()
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.close()


def wait_for_rank0_step(cluster: Cluster, jid: str, run_dir: Path, step: int, timeout: float, explain) -> dict:
    """Rank 0's heartbeat once it has finished `step`; fails at once if the job ends first."""
    found: list[dict] = []
    next_look = time.time() + 2

    def reached() -> bool:
        nonlocal next_look
        for directory in run_dir.glob("heartbeats-*"):
            beat = read_heartbeats(directory).get(0)
            if beat and beat.step >= step and beat.phase == "train":
                found.append(beat)
                return True
        if time.time() > next_look:  # (scontrol every 2 s, not every 0.1 s)
            next_look = time.time() + 2
            if cluster.job(jid).get("JobState") in FINAL_STATES:
                raise AssertionError(f"job {jid} ended before rank 0 reached step {step}\n{explain()}")
        return False

    cluster.wait(reached, timeout, f"rank 0 at step {step}", every=0.1, explain=explain)
    return found[0]


def rendezvous_port(n: int = len(NODES)) -> int:
    """A port P with P .. P+n-1 free, below the ephemeral range (32768 and up on Linux): the recipe's i-th
    endpoint listens at RDZV_PORT + i, and a port in that range can meanwhile become some connection's
    own port (a launcher moving to that endpoint then finds it taken)."""
    for _ in range(100):
        base = random.randrange(20000, 32000)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("", port))
        except OSError:
            continue
        return base
    raise AssertionError("no free port range below 32000")


def slurm_node_of(pid: int) -> str:
    """The Slurm node a job's process runs on (its SLURMD_NODENAME): all of them share this host."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"SLURMD_NODENAME="):
            return item.split(b"=", 1)[1].decode()
    raise AssertionError(f"process {pid} runs outside the Slurm job")


def lose_node(cluster: Cluster, node: str) -> list[int]:
    """`node` lost as a crash loses it: every process of the job there SIGKILLed (its launcher, fork server
    and the real trainer rank), then the node marked DOWN, as slurmctld concludes once its slurmd stops
    answering (after SlurmdTimeout, minutes; this says it at once). Returns the pids killed."""
    pids = processes_with(f"SLURMD_NODENAME={node}".encode())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.slurm(which("scontrol"), "update", f"NodeName={node}", "State=DOWN", "Reason=lost-by-the-test")
    return pids


def test_a_lost_node_leaves_the_other_going_on_then_the_requeued_job_resumes_on_both(cache_dir, cluster):
    """A 2-node allocation under `--nnodes 1:2` (MIN_NODES=1) loses a node mid-run (not the batch host): the
    other goes on alone from the memory snapshot resharded, in process with its pid kept (when the lost node
    hosted the rendezvous, at the next endpoint, its launcher adopting the rank). Slurm's SIGTERM then
    preempts it: it commits an emergency checkpoint and exits 75; the recipe requeues the job (srun
    reports the lost node's task, 137, over the survivor's 75), the node is back, and on both nodes the
    requeued job resumes from that committed step and finishes, with no step lost."""
    name = f"rekindle-{uuid.uuid4().hex[:8]}"
    run_dir = cluster.dir / "jobs" / "runs" / name  # the recipe's run.dir=runs/$SLURM_JOB_NAME
    # The recipe as it is; this cluster's differences through its variables and sbatch options.
    env = dict(cluster.env, PYTHONPATH=str(REPO), PYTHON=sys.executable, CONFIG=str(SMOKE), NPROC="1",
               RDZV_PORT=str(rendezvous_port()), MIN_NODES="1")
    jid = cluster.submit(name, env, f"train.steps={STEPS}", "train.eval_every=0", "train.log_every=10",
                         "checkpoint.every=1000", "log.progress=false")
    output = cluster.dir / "jobs" / f"{name}-{jid}.out"

    def say() -> str:
        return f"job {jid}: {cluster.job(jid)}\n--- job output\n{tail(output, 60)}\n{cluster.logs()}"

    wait_for_rank0_step(cluster, jid, run_dir, LOSE_AFTER, timeout=120, explain=say)
    # Not the batch host: losing it ends the job script (and srun with it), which is Slurm's to requeue.
    lost = next(n for n in NODES if n != cluster.job(jid)["BatchHost"])
    # Both nodes are 127.0.0.1 here, so either launcher may have bound the first endpoint: if the lost
    # node hosted the rendezvous, the survivor moves down the endpoint list first; either way its rank goes
    # on in process.
    hosts = [e for e in read_events(run_dir) if e["event"] == "rendezvous" and e["hosted"]]
    assert len(hosts) == 1, hosts
    host_lost = slurm_node_of(int(hosts[0]["node"].rsplit(":", 1)[1])) == lost
    reached = max(b.step for d in run_dir.glob("heartbeats-*") for b in read_heartbeats(d).values())
    assert lose_node(cluster, lost), say()

    def survivor_went_on() -> bool:
        return any(e["event"] == "resume" for e in read_events(run_dir))

    def stacks_then_say() -> str:  # the surviving launcher's stacks (SIGUSR1) into the job's output first
        for pid in processes_with(f"SLURMD_NODENAME={next(n for n in NODES if n != lost)}".encode()):
            with contextlib.suppress(OSError):
                if b"launch" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3]:
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(1)
        return say()

    cluster.wait(survivor_went_on, 30, "the survivor's resume", every=0.1, explain=stacks_then_say)
    wait_for_rank0_step(cluster, jid, run_dir, reached + 3, timeout=60, explain=say)  # training again, alone
    # The node back (or replaced): ReturnToService=2 returns it once its slurmd answers, RESUME if not yet.
    cluster.slurm(which("scontrol"), "update", f"NodeName={lost}", "State=RESUME", check=False)
    cluster.slurm(which("scancel"), "--signal=TERM", jid)  # to the job's step, as before the time limit

    # RUNNING -> (exit 75 and 137, `scontrol requeue`) PENDING -> RUNNING -> COMPLETED.
    cluster.wait(lambda: cluster.job(jid).get("JobState") in FINAL_STATES, 150, f"end of job {jid}", explain=say)
    info = cluster.job(jid)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), say()
    assert int(info["Restarts"]) == 1, say()  # requeued once, by the recipe

    events = read_events(run_dir)
    done = [i for i, e in enumerate(events) if e["event"] == "done"]
    assert len(done) == 3, say()  # attempt 1: the survivor only; attempt 2: both nodes
    first, second = events[: done[0] + 1], events[done[0] + 1:]
    # Attempt 1: the survivor goes on alone in process (its pid kept) from the memory snapshot resharded; when
    # the lost node hosted the rendezvous, at the next endpoint, moved to, its launcher adopting the rank.
    resumed = next(e for e in first if e["event"] == "resume")
    assert resumed["tier"] == "memory-reshard", resumed
    if host_lost:
        moved = [e for e in first if e["event"] == "rendezvous" and e["hosted"] and e["index"] == 1]
        assert len(moved) == 1 and moved[0]["adopted"], moved
    failure = next(e for e in first if e["event"] == "failure")
    assert (failure["cause"], failure["path"], resumed["path"]) == ("node", "in-process", "in-process"), first
    assert len(next(e for e in first if e["event"] == "in_process_done")["kept_pids"]) == 1, first
    # ... then SIGTERM: an emergency checkpoint, exit 75, nothing it had finished lost (both attempts' output
    # when not: the first attempt's launcher lines are not in the tail that say() shows).
    preempt = next(e for e in first if e["event"] == "preempt")
    end, both = events[done[0]], output.read_text(errors="replace")[-12000:]
    assert (end["exit_code"], end["outcome"]) == (75, "preempted"), f"{end}\n{both}"
    step = end["committed_step"]
    assert [e["step"] for e in first if e["event"] == "commit"] == [step], f"{first}\n{both}"  # the only commit
    assert preempt["step"] <= step < STEPS, (preempt, step)
    assert output.read_text().count("-> exit 75") == 1, say()
    # Attempt 2 (the requeued job): both launchers start, resume from that step exactly and finish.
    assert sum(e["event"] == "start" for e in second) == 2, second
    ends = [e for e in second if e["event"] == "done"]
    assert [(e["exit_code"], e["outcome"]) for e in ends] == [(0, "done")] * 2, ends
    for e in ends:  # every step after `step` trained once more, none before
        assert (e["final_step"], e["final_step"] - e["steps_kept"]) == (STEPS, step), e
    assert f"resumed from step {step} " in output.read_text(), say()
    assert [e["step"] for e in second if e["event"] == "commit"][-1] == STEPS
    assert read_metrics(run_dir)[STEPS]["step"] == STEPS
