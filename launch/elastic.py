"""The supervisor: torchrun's own elastic agent (`LocalElasticAgent`, c10d rendezvous) run inside
this process, with the parts torchrun lacks added around it:

- hang detection from per-rank heartbeats (`launch.watchdog`), not only process exits;
- restarts that SIGKILL the old group at once (its survivors sit in dead collectives), with a
  restart policy (`launch.policy`): backoff without progress, crash-loop and bad-input stops;
- a node joining (a membership change) is no failure: the ranks get SIGTERM and the grace period to
  commit an emergency checkpoint before the group is restarted with the new node, so no step is lost;
- preemption: SIGTERM (or Ctrl-C) to the launcher is passed to the ranks, which finish the step,
  commit an emergency checkpoint and exit 75 within `fault.preempt_grace_s`; between worker groups
  (rendezvous, backoff) nothing is left to ask, and the launcher stops at once;
- the ledger (`launch.ledger`): start, failure, restart, resume, preempt, done in events.jsonl.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from launch.ledger import Ledger, format_summary
from launch.policy import EXIT_FAILED, Decision, Failure, RestartPolicy
from launch.watchdog import Watchdog, proc_stat
from trainer.config import Config
from trainer.cost import cost_report, format_cost
from trainer.fault import EXIT_PREEMPTED, HEARTBEAT_ENV
from trainer.parallel import is_loopback, tcp_store_server

LAUNCHER_PID_ENV = "REKINDLE_LAUNCHER_PID"


class _QuietThreadWarning(logging.Filter):
    """torchelastic warns that it cannot install signal handlers off the main thread: this launcher
    handles SIGTERM/SIGINT itself (and ranks die with it through PR_SET_PDEATHSIG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to register signal handlers" not in record.getMessage()


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietThreadWarning())


@dataclass
class LaunchOptions:
    config_path: str
    overrides: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int | None = None  # None: fault.max_restarts from the config
    rdzv_endpoint: str = ""  # empty: this node alone, rendezvous on 127.0.0.1
    rdzv_id: str = ""  # empty: derived from run.name and run.dir (the same on every node)
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None  # address the other ranks reach this node at; None: auto
    monitor_interval_s: float = 0.1


def say(msg: str) -> None:
    print(f"[launch] {msg}", file=sys.stderr, flush=True)


def _traceback_tail(failure, lines: int = 6) -> str:
    stack = (failure.error_file_data or {}).get("message", {})
    stack = stack.get("extraInfo", {}).get("py_callstack", "") if isinstance(stack, dict) else ""
    return "\n".join(stack.strip().splitlines()[-lines:])


class _Stopping(Exception):
    """Raised in the agent thread when a signal arrived between worker groups: start nothing more."""


class _SupervisedAgent(LocalElasticAgent):
    """torchrun's agent with the supervisor's hooks at start, monitor, stop and restart."""

    def __init__(self, spec: WorkerSpec, supervisor: Supervisor) -> None:
        super().__init__(spec, DefaultLogsSpecs(), start_method="spawn", exit_barrier_timeout=60)
        self.supervisor = supervisor
        self.victims: set[int] = set()  # local ranks still alive when the group was torn down
        self.attempt = 0  # the running group's restart count (its ranks' TORCHELASTIC_RESTART_COUNT)

    def _restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def stop_restarts(self) -> None:
        self._remaining_restarts = 0

    def worker_pids(self) -> dict[int, int]:
        return dict(self._pcontext.pids()) if self._pcontext else {}

    def _start_workers(self, worker_group):
        if self.supervisor.preempt_at is not None:
            raise _Stopping("signalled before the worker group started")
        self.attempt = self._restart_count()  # what torchelastic gives the ranks (stop_restarts() changes it later)
        self.supervisor.before_start(self.attempt)
        pids = super()._start_workers(worker_group)
        self._fast_close(self._pcontext)
        self.supervisor.after_start(self.attempt, pids)
        return pids

    def _fast_close(self, pcontext) -> None:
        """When one rank fails, torchelastic SIGTERMs the others and waits up to 30s. Those survivors
        are stuck in collectives with the dead rank (SIGTERM only reaches Python between C++ calls),
        so kill them at once, and remember which ranks were still alive: they are victims, not causes.
        During a preemption the ranks get the gentle signal and the grace period instead."""
        close = pcontext.close
        self.victims = set()

        def close_now(death_sig=None, timeout: int = 30) -> None:
            self.victims = {lr for lr, pid in pcontext.pids().items() if _alive(pid)}
            if self.supervisor.preempt_at is None:
                death_sig, timeout = death_sig or signal.SIGKILL, min(timeout, 5)
            close(death_sig, timeout)

        pcontext.close = close_now

    def _stop_workers(self, worker_group) -> None:
        # Survivors of a failure are blocked in collectives with a dead peer; a SIGSTOPped rank
        # ignores SIGTERM. Waiting for either only delays recovery: SIGKILL the process groups.
        self._shutdown(signal.SIGKILL, timeout=5)

    def _restart_workers(self, worker_group) -> None:
        """Stop the group first (a hung rank must not hold its memory or GPU through the backoff),
        then back off, rendezvous and start. After a failure the group is SIGKILLed; on a membership
        change (a node joining) the ranks first get SIGTERM and the grace period to commit an emergency
        checkpoint, as in a preemption, so that the new group loses no step."""
        membership = not self.supervisor.restart_pending
        if membership:
            self._drain(self.supervisor.cfg.fault.preempt_grace_s)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self.supervisor.before_restart(self._restart_count(), membership)
        self._initialize_workers(worker_group)

    def _drain(self, grace_s: float) -> None:
        """SIGTERM every rank (they agree on the step, commit and exit 75); wait for them within grace_s."""
        pids = list(self.worker_pids().values())
        for pid in pids:
            _signal(pid, signal.SIGTERM, group=False)
        deadline = time.time() + grace_s
        while any(_alive(pid) for pid in pids) and time.time() < deadline and not self.supervisor.hard_stop:
            time.sleep(0.1)

    def _monitor_workers(self, worker_group) -> RunResult:
        return self.supervisor.review(super()._monitor_workers(worker_group), self)


class Supervisor:
    """One node's launcher: runs the agent, watches heartbeats, applies the restart policy, keeps the ledger."""

    def __init__(self, cfg: Config, opts: LaunchOptions) -> None:
        self.cfg, self.opts, f = cfg, opts, cfg.fault
        max_restarts = f.max_restarts if opts.max_restarts is None else opts.max_restarts
        self.policy = RestartPolicy(max_restarts, f.restart_backoff_s, crash_loop_repeats=f.crash_loop_repeats)
        self.ledger = Ledger(Path(cfg.run.dir))
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        self.heartbeat_dir = Path(tempfile.mkdtemp(prefix="heartbeats-", dir=cfg.run.dir))
        self.watchdog = Watchdog(self.heartbeat_dir, f.hang_timeout_s)
        self.preempt_at: float | None = None  # set by the signal handler (main thread)
        self.hard_stop = False
        self._signalled: set[int] = set()
        self._decision: Decision | None = None
        self._delay_s = 0.0
        self.restart_pending = False  # the next restart follows a failure (else: a membership change)
        self._interrupted: tuple[float, str] | None = None  # (when, why) the running group was stopped
        self._next_check = 0.0
        self._result: RunResult | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ agent hooks (agent thread)
    def before_start(self, attempt: int) -> None:
        self.watchdog.reset()

    def after_start(self, attempt: int, pids: dict[int, int]) -> None:
        interrupted, self._interrupted = self._interrupted, None
        self.ledger.attempt_started(attempt, *(interrupted or (None, "")))
        say(f"attempt {attempt}: {len(pids)} worker(s) started, pids {sorted(pids.values())}")

    def before_restart(self, attempt: int, membership: bool) -> None:
        """The old group is stopped: log the restart, then wait out the backoff (a signal ends the wait)."""
        delay, self._delay_s = self._delay_s, 0.0
        self.restart_pending = False
        if membership:
            self._interrupted = (time.time(), "membership change")
        self.ledger.event("restart", n=attempt, delay_s=delay, reason="membership change" if membership else "failure")
        if membership:
            say("a node is waiting to join: restarting the worker group with it")
        if delay:
            say(f"no progress since the last failure: waiting {delay:.1f}s before restarting")
        deadline = time.time() + delay
        while time.time() < deadline:
            if self.preempt_at is not None:
                raise _Stopping("signalled during the backoff")
            time.sleep(min(0.1, max(deadline - time.time(), 0.0)))

    def review(self, result: RunResult, agent: _SupervisedAgent) -> RunResult:
        """Called every monitor interval with the agent's own view; may turn HEALTHY into UNHEALTHY."""
        now = time.time()
        if self.preempt_at is not None:
            self._forward_preemption(agent, now)
        if result.state in (WorkerState.FAILED, WorkerState.SUCCEEDED) or now >= self._next_check:
            self._next_check = now + self.cfg.fault.heartbeat_s
            beats = self.watchdog.beats(agent.attempt)
            if beats:
                event = self.ledger.observe(beats[min(beats)])
                if event:
                    say(f"resumed at step {event['step']}: {event['lost_steps']} step(s) lost, recovery "
                        f"{event['recovery_s']:.1f}s (restart {event['restart_s']:.1f}s, load {event['load_s']:.1f}s, "
                        f"first step {event['first_step_s']:.1f}s)")
            if result.state == WorkerState.FAILED and self.preempt_at is None:
                self._on_failure(*self._classify(result, beats, agent.victims), agent)
            elif result.state == WorkerState.HEALTHY and self.preempt_at is None:
                hang = self.watchdog.check(agent.attempt, now)
                if hang:
                    failure = Failure(hang.rank, "hang", hang.step + 1, message=hang.describe(),
                                      key=f"rank {hang.rank} {hang.state}")  # no pid or seconds: same hang, same key
                    self._on_failure(failure, "", agent)
                    return RunResult(state=WorkerState.UNHEALTHY)
        return result

    def _classify(self, result: RunResult, beats: dict[int, dict], victims: set[int]) -> tuple[Failure, str]:
        """The root cause (first failure) and its traceback excerpt from torchelastic's error file.
        Ranks that were still running when the group was torn down (victims) are causes only if
        nothing else failed."""
        causes = {r: f for r, f in result.failures.items() if f.local_rank not in victims} or result.failures
        rank, pf = min(causes.items(), key=lambda kv: _blame_order(*kv))
        step = beats.get(rank, {}).get("step", self.ledger.attempts[-1].last_step if self.ledger.attempts else 0) + 1
        if pf.exitcode is not None and pf.exitcode < 0:
            failure = Failure(rank, "signal", step, pf.exitcode, pf.signal_name())
        elif pf.exitcode == EXIT_PREEMPTED:
            failure = Failure(rank, "preemption", step, pf.exitcode)
        else:
            failure = Failure(rank, "exit", step, pf.exitcode, message=_message(pf))
        return failure, _traceback_tail(pf) if failure.cause == "exit" and pf.error_file_data else ""

    def _on_failure(self, failure: Failure, tb: str, agent: _SupervisedAgent) -> None:
        self.ledger.failure(attempt=agent.attempt, rank=failure.rank, cause=failure.cause, step=failure.step,
                            exit_code=failure.exit_code, signal=failure.signal, message=failure.message,
                            traceback=tb)
        say(f"failure: {failure.describe()}" + (f"\n{tb}" if tb else ""))
        self._interrupted = (self.ledger.failures[-1]["time"], "failure")
        decision = self.policy.decide(failure)
        if decision.restart:
            self._delay_s, self.restart_pending = decision.delay_s, True
            say(f"restarting the worker group (restart {self.policy.restarts} of {self.policy.max_restarts})")
        else:
            self._decision = decision
            agent.stop_restarts()
            say(decision.reason)

    def _forward_preemption(self, agent: _SupervisedAgent, now: float) -> None:
        agent.stop_restarts()
        for pid in agent.worker_pids().values():
            if pid not in self._signalled:
                self._signalled.add(pid)
                _signal(pid, signal.SIGTERM, group=False)
        if self.hard_stop or now > self.preempt_at + self.cfg.fault.preempt_grace_s:
            for pid in agent.worker_pids().values():
                _signal(pid, signal.SIGKILL, group=True)

    # ------------------------------------------------------------------ main thread
    def _spec(self) -> WorkerSpec:
        o = self.opts
        standalone = not o.rdzv_endpoint
        endpoint = o.rdzv_endpoint or "127.0.0.1:0"
        host = endpoint.rsplit(":", 1)[0]
        local_addr = o.local_addr or ("127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else None)
        conf = {"join_timeout": "900", "close_timeout": "10", "keep_alive_interval": "1",
                "keep_alive_max_attempt": "3"}
        if o.min_nodes != o.max_nodes:
            conf["last_call_timeout"] = "3"  # torchrun waits 30s for late nodes by default
        conf.update(o.rdzv_conf)
        # Nodes of one job share a rendezvous id; a standalone run gets a fresh one.
        salt = os.urandom(4).hex() if standalone else ""
        run_id = o.rdzv_id or "rekindle-" + hashlib.sha256(
            f"{self.cfg.run.name}:{self.cfg.run.dir}:{salt}".encode()).hexdigest()[:12]
        params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=o.min_nodes,
                                      max_nodes=o.max_nodes, local_addr=local_addr, **conf)
        return WorkerSpec(role="trainer", local_world_size=o.nproc_per_node, entrypoint=sys.executable,
                          args=("-u", "-m", "trainer", o.config_path, *o.overrides),
                          rdzv_handler=_rendezvous_handler(params),
                          max_restarts=self.policy.max_restarts, monitor_interval=o.monitor_interval_s,
                          local_addr=local_addr)

    def _run_agent(self, agent: _SupervisedAgent) -> None:
        try:
            self._result = agent.run()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self._error = e
        finally:
            if self.preempt_at is None:  # a preempted node leaves the rendezvous open for its replacement
                agent._worker_group.spec.rdzv_handler.shutdown()

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if self.preempt_at is None:
            self.preempt_at = time.time()
            name = signal.Signals(signum).name
            self.ledger.event("preempt", signal=name, step=self.ledger.attempts[-1].last_step
                              if self.ledger.attempts else 0)
            say(f"{name}: asking the ranks to finish the step and commit an emergency checkpoint "
                f"(grace {self.cfg.fault.preempt_grace_s:.0f}s; send it again to stop at once)")
        else:
            self.hard_stop = True

    def run(self) -> int:
        os.environ[HEARTBEAT_ENV] = str(self.heartbeat_dir)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        # A restarted group must not reuse the agent's store: stale gloo addresses (FIELD-NOTES).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        o = self.opts
        agent = _SupervisedAgent(self._spec(), self)
        self.ledger.event("start", nproc_per_node=o.nproc_per_node, nnodes=f"{o.min_nodes}:{o.max_nodes}",
                          max_restarts=self.policy.max_restarts, config=o.config_path, overrides=o.overrides)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        thread = threading.Thread(target=self._run_agent, args=(agent,), name="elastic-agent", daemon=True)
        thread.start()
        idle_since = None
        try:
            while thread.is_alive():
                thread.join(0.2)
                if self.preempt_at is None:
                    continue
                pids = agent.worker_pids().values()
                if self.hard_stop:
                    for pid in pids:
                        _signal(pid, signal.SIGKILL, group=True)
                if any(_alive(pid) for pid in pids):
                    idle_since = None
                    continue
                # Signalled, and no rank is running: the agent is in a rendezvous, a backoff or the exit
                # barrier, where nothing acts on the signal (for up to join_timeout). Stop here.
                idle_since = idle_since or time.time()
                if self.hard_stop or time.time() - idle_since > 2.0:
                    say("no worker group is running: stopping now")
                    break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.watchdog.remove()
        return self._finish()

    def _committed_since(self, t: float) -> bool:
        """Whether the checkpoint store holds a step committed at or after unix time `t`. Asked of the
        store itself, which every node shares: exit codes do not tell (ranks still tearing down when the
        first one exits may be killed), and rank 0's `commit` events are in its own run.dir, which on
        another node's pod this launcher does not see."""
        from trainer.checkpoint import Checkpointer, read_commit, step_dir
        from trainer.parallel import DistInfo

        root = self.cfg.checkpoint_dir
        try:
            steps = Checkpointer(root, DistInfo(0, 1, 0, torch.device("cpu"), "gloo")).committed_steps()
            return bool(steps) and read_commit(step_dir(root, steps[-1]))["time"] >= t
        except Exception as e:  # noqa: BLE001 - unreadable store: say so, and count it as not committed
            say(f"could not check {root} for the emergency checkpoint: {type(e).__name__}: {e}")
            return False

    def _finish(self) -> int:
        result, summary = self._result, self.ledger.summary()
        if result is not None and result.state == WorkerState.SUCCEEDED:
            code, outcome = 0, "done"
        elif self.preempt_at is not None:
            clean = self._committed_since(self.preempt_at)
            code, outcome = EXIT_PREEMPTED, "preempted" if clean else "preempted (no emergency checkpoint)"
        elif self._error is not None:
            code, outcome = EXIT_FAILED, f"launcher error: {type(self._error).__name__}: {self._error}"
        elif self._decision is not None:
            code, outcome = self._decision.exit_code, self._decision.reason.splitlines()[0]
        else:
            code, outcome = EXIT_FAILED, "failed"
        if self.cfg.log.cost_per_device_hour:
            tokens = summary["steps_kept"] * self.cfg.train.global_batch * self.cfg.model.seq_len
            summary["cost"] = cost_report(self.opts.nproc_per_node, summary["wall_s"], tokens,
                                          summary["lost_s"], self.cfg.log.cost_per_device_hour)
        self.ledger.event("done", exit_code=code, outcome=outcome, **summary)
        say(f"{outcome}: {format_summary(summary)} -> exit {code}")
        if "cost" in summary:
            say(f"this node: {format_cost(summary['cost'])}")
        return code


def _rendezvous_handler(params: RendezvousParameters):
    """torchrun's c10d rendezvous; on a loopback endpoint its store listens on that address only
    (torch's would listen on every interface), hosted by the first launcher to bind it."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    if not is_loopback(host):
        return rdzv_registry.get_rendezvous_handler(params)
    timeout = timedelta(seconds=int(params.get("read_timeout", "60")))
    try:
        store = tcp_store_server(host, port, None, timeout, multi_tenant=True)
    except OSError:  # taken: another launcher on this machine hosts the rendezvous
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    return dynamic_rendezvous.create_handler(store, C10dRendezvousBackend(store, params.run_id), params)


# A rank that lost a peer fails too, with one of these: it is a victim, not the root cause.
_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
                "Timed out", "timed out", "NCCL", "gloo", "ProcessGroup")


def _message(pf) -> str:
    """First line of the exception in torchelastic's error file ('' without one)."""
    if not pf.error_file_data:
        return ""
    message = pf.message if isinstance(pf.message, str) else pf.message.get("message", "")
    return message.strip().splitlines()[0] if message.strip() else ""


def _blame_order(rank: int, pf) -> tuple:
    """Sort key for root causes: a signal, then an exception, then a lost-peer error; earliest first
    (the error file's mtime is precise; torchelastic's own timestamps are whole seconds)."""
    message = _message(pf)
    if pf.exitcode is not None and pf.exitcode < 0:
        kind = 0
    elif message and not any(m in message for m in _PEER_ERRORS):
        kind = 1
    else:
        kind = 2
    try:
        when = os.stat(pf.error_file).st_mtime
    except (OSError, TypeError):
        when = float(pf.timestamp)
    return kind, when, rank


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting to be reaped)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _signal(pid: int, sig: signal.Signals, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
