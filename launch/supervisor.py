"""The supervisor: one node's launcher. It runs torchrun's elastic agent (`launch.agent`, c10d
rendezvous from `launch.rendezvous`) on a thread of its own and adds what torchrun lacks:

- hang detection from per-rank heartbeats (`launch.watchdog`), not only process exits;
- failure attribution (`launch.failures`): the root cause among the ranks that failed, with its message
  and traceback, and a restart policy (`launch.policy`): backoff without progress, crash-loop and
  bad-input stops;
- a node joining (a membership change) is no failure: the agent drains the ranks (SIGTERM and the
  grace period to commit an emergency checkpoint) before restarting the group with the new node;
- preemption: SIGTERM (or Ctrl-C) to the launcher is passed to the ranks, which finish the step,
  commit an emergency checkpoint and exit 75 within `fault.preempt_grace_s`; between worker groups
  (rendezvous, backoff) nothing is left to ask, and the launcher stops at once;
- the ledger (`launch.ledger`): start, failure, restart, resume, preempt, done in events.jsonl, and
  the outcome with its exit code (trainer.runtime.protocol's EXIT_*)."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from launch import failures, outcome, rendezvous
from launch.agent import GroupStatus, SupervisedAgent
from launch.commits import newest_commit
from launch.failures import Failure
from launch.inprocess import UNAWARE_S, InProcessRecovery, announce_handled, print_stacks
from launch.ledger import Ledger, format_summary, resume_line
from launch.nodes import Meeting
from launch.options import LaunchOptions
from launch.policy import Decision, RestartPolicy
from launch.stub import ZYGOTE_ENV
from launch.watchdog import Watchdog, abandoned_progress, heartbeat_prefix
from launch.zygote import Zygote, kill_group
from trainer.contract import (
    COORD_STORE_ENV,
    EXIT_PREEMPTED,
    HEARTBEAT_DIR_ENV,
    JOB_ENV,
    LAUNCHER_PID_ENV,
    Config,
    format_cost,
)

log = logging.getLogger(__name__)
AGAIN_AFTER_S = 1.0  # a second signal stops at once from then on; sooner, it is one signal sent to pid and group
HANG_EXIT_WAIT_S = 10.0  # a hung rank SIGKILLed alone: how long its exit may take to reach the agent


class Supervisor(Meeting):
    """One node's launcher: runs the agent, watches heartbeats, applies the restart policy, keeps the
    ledger and decides the exit code. Its agent hooks run on the agent's thread, the rest on the main one."""

    def __init__(self, cfg: Config, opts: LaunchOptions, zygote: Zygote | None = None) -> None:
        self.cfg, self.opts, f = cfg, opts, cfg.fault
        self.zygote: Zygote | None = zygote  # warm restarts' fork server (started by launch.__main__; None: off)
        max_restarts = f.max_restarts if opts.max_restarts is None else opts.max_restarts
        self.policy = RestartPolicy(max_restarts, f.restart_backoff_s, crash_loop_repeats=f.crash_loop_repeats)
        self.ledger = Ledger(Path(cfg.run.dir))
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        lost = abandoned_progress(cfg.run.dir)  # a launcher of this node killed outright before this one
        self.heartbeat_dir = Path(tempfile.mkdtemp(prefix=heartbeat_prefix(), dir=cfg.run.dir))
        stall = cfg.storage.stall_s
        self.watchdog = Watchdog(self.heartbeat_dir, f.hang_timeout_s, stall + 10.0 if stall else 0.0)
        # A failed rank is replaced alone on one node; with several, a lost node's survivors go on in a smaller world.
        one = opts.max_nodes == 1
        self.inproc = InProcessRecovery(f.in_process and one, one, f.in_process and opts.min_nodes < opts.max_nodes)
        self.agent: SupervisedAgent | None = None  # created by run()
        self.attempt = 0  # the running group's restart count (its ranks' TORCHELASTIC_RESTART_COUNT)
        self.preempt_at: float | None = None  # set by the signal handler (main thread)
        self._ranks_at_signal = False  # whether a worker group was running when the signal came
        self._committed_step: int | None = None  # the newest commit, once a preempted launcher asked the store
        self._hard_stop = False  # a second signal
        self._signalled: set[int] = set()  # ranks already sent SIGTERM
        self._decision: Decision | None = None  # the policy's, when it stopped restarting
        self._delay_s = 0.0  # backoff before the next restart
        self._interrupted: tuple[float, str] | None = None  # (when, why) the running group was stopped
        if lost is not None:  # the first attempt resumes what it left: count its lost steps from here
            self.ledger.previous_last_step = lost["step"]
            self._interrupted = (self.ledger.started, "launcher lost")
        self._next_check = 0.0
        self._recorded = False  # the failed group's failure is in the ledger already (in-process path)
        self._succeeded = False
        self._closed = False  # the rendezvous was closed by the others before this node took part
        self._final: int | None = None  # the job's final committed step once asked (0: not committed)
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ agent hooks (agent thread)
    def signalled(self) -> bool:
        return self.preempt_at is not None

    def hard_stop(self) -> bool:
        return self._hard_stop

    def before_start(self, attempt: int) -> None:
        self.attempt = attempt
        self.watchdog.reset()
        self.inproc.reset()
        if self.zygote is not None and not self.zygote.alive():
            if self.zygote.ensure() and self.zygote.wait_bound():
                log.warning(f"the fork server for warm restarts had ended: started again (pid {self.zygote.pid})")
            else:
                log.warning("the fork server for warm restarts is gone: the ranks start afresh")

    def after_start(self, attempt: int, pids: dict[int, int]) -> None:
        interrupted, self._interrupted = self._interrupted, None
        self.ledger.attempt_started(attempt, *(interrupted or (None, "")))
        log.info(f"attempt {attempt}: {len(pids)} worker(s) started, pids {sorted(pids.values())}")
        self._join_liveness()
        self._note_joined()

    def before_restart(self, attempt: int, membership: bool) -> float:
        """The old group is stopped: log the restart and say how long to back off."""
        delay, self._delay_s = self._delay_s, 0.0
        reason = "membership change" if membership else "failure"
        if membership:
            self._interrupted = (time.time(), reason)
            log.info("a node is waiting to join: restarting the worker group with it")
        self.ledger.event("restart", n=attempt, delay_s=delay, reason=reason)
        if delay:
            log.info(f"no progress since the last failure: waiting {delay:.1f}s before restarting")
        return delay

    def replace_failed(self, exits: dict) -> dict[str, str] | None:
        """In-process recovery (launch.inprocess): the replacements' environment, or None for a full restart."""
        beats = self.watchdog.beats(self.attempt)
        if (env := self.inproc.replace_unaware(exits, beats)) is not None:
            log.info(f"in-process recovery: starting rank(s) {sorted(exits)} again too")
            return env
        failure, tb = failures.from_exits(exits, set(), beats, self._last_step())
        failure, self.inproc.hang = self.inproc.hang or failure, None  # a hung rank this launcher killed
        # The trainers' own pids (a warm rank's torchelastic worker is its stub): single node, local = global rank.
        running = {lr: beats[lr]["pid"] if lr in beats else pid for lr, pid in self.agent.worker_pids().items()}
        env, why = self.inproc.offer(exits, beats, failure, running, self.agent)
        if env is None:
            if why:
                log.info(f"in-process recovery not possible: {why}; restarting the whole worker group")
                self.ledger.event("in_process_fallback", why=why, rank=failure.rank)
            return None
        self._on_failure(failure, tb, path="in-process")
        if self._decision is not None:  # the policy stopped here (budget, crash loop): it is recorded
            self.inproc.reset()
            self._recorded = True
            return None
        pending = self.inproc.pending
        announce_handled(self.agent, pending.generation)
        self.ledger.attempt_started(self.attempt, pending.noticed, "failure", path="in-process")
        log.info(f"in-process recovery, generation {pending.generation}: starting rank(s) {pending.replaced} "
                 f"again; the other ranks keep their processes (pids {sorted(pending.kept.values())} here)")
        return env

    def review(self, status: GroupStatus) -> bool:
        """Every monitor interval, with the agent's own view; True turns a healthy group into a hung one."""
        now = time.time()
        if self.preempt_at is not None:
            self._forward_preemption(now)
        if status.state not in ("failed", "succeeded") and now < self._next_check and self.inproc.pending is None:
            return False
        self._next_check = now + self.cfg.fault.heartbeat_s
        beats = self.watchdog.beats(self.attempt)
        current = self.inproc.current(beats)
        pending = self.inproc.pending
        if current:
            kept = [r for r, b in current.items() if pending is None or b.get("pid") in pending.kept.values()]
            self._observe(current[min(kept or current)])
        settled = self.inproc.settle(beats)
        if settled is not None:
            self.ledger.event("in_process_done", generation=settled.generation, replaced=settled.replaced,
                              kept_pids=sorted(settled.kept.values()))
        if self.preempt_at is not None:
            return False
        if status.state == "failed":
            if not self._recorded:
                self._on_failure(*failures.from_exits(status.exits, set(status.victims), beats, self._last_step()))
            self._recorded = False
        elif status.state == "healthy":
            if self._silent_nodes():
                return True
            if stuck := self.inproc.overdue(now):
                return self._fall_back(*stuck, beats)
            unaware, stuck = self.inproc.unaware_ranks(beats, now)
            if stuck:
                return self._fall_back(*stuck, beats)
            for rank, pid in unaware.items():  # killed, then started again
                log.info(f"rank {rank} (pid {pid}) still trains in the failed generation {UNAWARE_S:.0f}s after the "
                         f"failure (blocked where no error reaches it): killing it, to start it again too")
                self.ledger.event("in_process_unaware", rank=rank, pid=pid, generation=self.inproc.generation)
                kill_group(pid)
            if lost := self.inproc.lost_node(beats, self.agent, now, self.liveness):
                return self._go_smaller(*lost, beats)
            if self.inproc.hang is not None and now - self.inproc.hang_killed_at < HANG_EXIT_WAIT_S:
                return False  # the hung rank was SIGKILLed alone: its exit is on its way to the agent
            hang = self.watchdog.check(self.attempt, now, ignore=self.inproc.unjudged_pids())
            if hang and self.inproc.enabled and self.inproc.pending is None and hang.state != "gone":
                # In process: kill the hung rank alone; its replacement is started as for a crash.
                self.inproc.hang, self.inproc.hang_killed_at = failures.from_hang(hang, self.cfg.checkpoint_dir), now
                log.info(f"{self.inproc.hang.describe()}: killing it (pid {hang.pid})")
                kill_group(hang.pid)
                return False
            if hang:
                self.inproc.restarting(beats, self.agent)  # several nodes: the others wait for this group
                self._on_failure(failures.from_hang(hang, self.cfg.checkpoint_dir), "")
                return True
        return False

    def _fall_back(self, rank: int, why: str, beats: dict[int, dict]) -> bool:
        """The in-process recovery under way cannot finish: the ranks it waited for in vain print their stacks,
        and the whole group restarts (True)."""
        log.info(f"in-process recovery not possible: {why}; restarting the whole worker group")
        self.ledger.event("in_process_fallback", why=why, rank=rank)
        print_stacks({r: b for r, b in beats.items() if b.get("phase") != "recover"}, "did not come to the recovery")
        self._on_failure(Failure(rank, "hang", self._last_step() + 1, message=why, key="in-process recovery stuck"), "")
        return True

    def _go_smaller(self, generation: int, noticed: float, beats: dict[int, dict]) -> bool:
        """Every rank here waits for ranks of other nodes nobody replaces: their node is lost. The survivors go
        on in process in a smaller world; when they cannot, the group restarts (True)."""
        kept = {lr: beats[rank]["pid"] for lr, rank in self.agent.global_ranks().items() if rank in beats}
        lost, why = self.inproc.smaller_world(self.agent, generation, self.opts.min_nodes, os.environ[COORD_STORE_ENV])
        failure = Failure(lost[0] if lost else 0, "node", self._last_step() + 1, key="node lost", message=(
            f"rank(s) {lost} of another node stopped answering: the node is lost" if lost else f"a peer left: {why}"))
        if why:
            log.info(f"in-process recovery not possible: {why}; restarting the whole worker group")
            self.ledger.event("in_process_fallback", why=why, rank=failure.rank)
        self._on_failure(failure, "", path="restart" if why else "in-process")
        if why or self._decision is not None:
            return True
        self.inproc.go_smaller(generation, noticed, kept, lost)
        self._join_liveness(generation)
        self.ledger.attempt_started(self.attempt, noticed, "failure", path="in-process")
        log.info(f"in-process recovery, generation {generation}: the ranks here go on as a world of "
                 f"{len(kept)} without rank(s) {lost}")
        return False

    def _last_step(self) -> int:
        return self.ledger.attempts[-1].last_step if self.ledger.attempts else 0

    def _observe(self, beat: dict) -> None:
        """Fold this node's lowest rank's heartbeat into the ledger; say so once a restarted group resumed."""
        event = self.ledger.observe(beat)
        if event:
            log.info(resume_line(event))

    def _on_failure(self, failure: Failure, tb: str, path: str = "restart") -> None:
        record = self.ledger.failure(attempt=self.attempt, rank=failure.rank, cause=failure.cause, step=failure.step,
                                     exit_code=failure.exit_code, signal=failure.signal, message=failure.message,
                                     traceback=tb, path=path)
        log.info(f"failure: {failure.describe()}" + (f"\n{tb}" if tb else ""))
        self._interrupted = (record["time"], "failure")
        decision = self.policy.decide(failure)
        if decision.restart:
            self._delay_s = decision.delay_s if path == "restart" else 0.0
            what = ("going on without them" if failure.cause == "node" and path == "in-process" else
                    f"restarting {'the failed rank(s) alone' if path == 'in-process' else 'the worker group'}")
            log.info(f"{what} (restart {self.policy.restarts} of {self.policy.max_restarts})")
        else:
            self._decision = decision
            self.agent.stop_restarts()
            log.info(decision.reason)

    def _forward_preemption(self, now: float) -> None:
        """SIGTERM each rank once; SIGKILL them when the grace period is over or a second signal came."""
        self.agent.stop_restarts()
        pids = set(self.agent.worker_pids().values())
        self.agent.terminate(pids - self._signalled)
        self._signalled |= pids
        grace = self.cfg.fault.preempt_grace_s
        if self._hard_stop or now > self.preempt_at + grace - min(5.0, 0.25 * grace):  # a reserve to finish in
            if not self._hard_stop:  # once: where the ranks that did not commit in time are stuck
                print_stacks(self.watchdog.beats(self.attempt), "did not commit its emergency checkpoint in time")
            self._hard_stop = True
            self.agent.kill()

    # ------------------------------------------------------------------ main thread
    def run(self) -> int:
        """Supervise the training run on this node to its end; returns the launcher's exit code."""
        os.environ.update({HEARTBEAT_DIR_ENV: str(self.heartbeat_dir), LAUNCHER_PID_ENV: str(os.getpid())})
        if self.opts.job:
            os.environ[JOB_ENV] = self.opts.job  # the ranks of this job share its leases (trainer.runtime.lease)
        o = self.opts
        listed = rendezvous.endpoints(o.rdzv_endpoint)
        at = rendezvous.first_answering(listed) if len(listed) > 1 else 0
        self.ledger.event("start", nproc_per_node=o.nproc_per_node, nnodes=f"{o.min_nodes}:{o.max_nodes}",
                          max_restarts=self.policy.max_restarts, config=o.config_path, overrides=o.overrides,
                          warm_restarts=self.zygote is not None)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self.zygote is not None:
                self._use_zygote()
            while self._meet_at(at) and self._job_finished() is None and at + 1 < len(listed):
                at = self._move_down(listed, at)
            if beats := self.watchdog.beats(self.attempt):  # the last word of this node's ranks, for the outcome
                self._observe(beats[min(beats)])
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.watchdog.remove()
            if self.zygote is not None:
                self.zygote.close()
        return self._finish()

    def _use_zygote(self) -> None:
        """Point the stubs at the fork server (launch.zygote) and wait until it listens (the stubs wait too)."""
        os.environ[ZYGOTE_ENV] = self.zygote.socket
        self.zygote.wait_bound()
        log.info(f"warm restarts: ranks are forked from a process with torch and the trainer imported "
                 f"(pid {self.zygote.pid}; fault.warm_restarts=false turns this off)")

    def _run_agent(self, agent: SupervisedAgent) -> None:
        """The agent's thread. An agent left behind when this node moved down the endpoint list (blocked in
        a call to the lost store) reports nothing when it ends: the next meeting is not its."""
        error = None
        try:
            ended = agent.supervise()
            if agent is self.agent:
                self._succeeded, self._closed = ended == "succeeded", ended == "closed"
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            error = e
            if agent is self.agent and self._error is None:
                self._error = e
        finally:
            # A preempted node leaves the rendezvous open for its replacement, an outvoted one for the majority;
            # a lost store has none to close.
            if (self.preempt_at is None and agent is self.agent and not self._outvoted
                    and not (error and rendezvous.store_lost(error))):
                agent.leave_rendezvous()

    def _wait_for(self, thread: threading.Thread) -> None:
        """Wait for the agent's thread to end, or, once signalled, for no worker group to be left to ask."""
        idle_since = None
        while thread.is_alive():
            thread.join(0.2)
            if self.preempt_at is None:
                if self._cut_off():
                    return
                self._note_spare()
                continue
            if self._hard_stop:
                self.agent.kill()
            if self.agent.running():
                idle_since = None
                continue
            # Signalled, and no rank is running: the agent is in a rendezvous, a backoff or the exit
            # barrier, where nothing acts on the signal (for up to join_timeout). Stop here.
            now = time.time()
            idle_since = idle_since or now
            # Idle for 2 s, or less once the end of the grace period nears (a second is kept for the outcome).
            patience = min(2.0, max(0.0, self.preempt_at + self.cfg.fault.preempt_grace_s - 1.0 - now))
            if self._hard_stop or now - idle_since >= patience:
                log.info("no worker group is running: stopping now")
                return

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if self.preempt_at is not None:
            self._hard_stop = self._hard_stop or time.time() - self.preempt_at >= AGAIN_AFTER_S
            return
        self.preempt_at = time.time()
        self._ranks_at_signal = self.agent is not None and self.agent.running()
        name = signal.Signals(signum).name
        self.ledger.event("preempt", signal=name, step=self._last_step())
        log.info(f"{name}: asking the ranks to finish the step and commit an emergency checkpoint "
                 f"(grace {self.cfg.fault.preempt_grace_s:.0f}s; send it again a second later to stop at once)")

    def _outcome(self) -> tuple[int, str]:
        """The exit code and one line saying why."""
        if self.preempt_at is not None and not self._succeeded:
            return self._preempted_outcome()
        gone = self._closed or self._error is not None and rendezvous.store_lost(self._error)
        return outcome.ended(self._succeeded, self._closed, self._error, self._decision, self._endpoint,
                             len(rendezvous.endpoints(self.opts.rdzv_endpoint)), bool(self.ledger.attempts),
                             self._job_finished() if gone else None)

    def _job_finished(self) -> int | None:
        """The final step, when the checkpoint store holds its commit: the job is over (asked once the
        rendezvous is gone: its host may simply have finished, with this node a spare or a late one)."""
        if self._final is None:
            newest = newest_commit(self.cfg.checkpoint_dir, 10.0)
            self._final = newest[0] if newest is not None and newest[0] >= self.cfg.train.steps else 0
        return self._final or None

    def _preempted_outcome(self) -> tuple[int, str]:
        attempt = self.ledger.attempts[-1] if self.ledger.attempts else None
        line, self._committed_step = outcome.preempted(self.cfg.checkpoint_dir, self.cfg.fault.preempt_grace_s,
                                                       self.preempt_at, self._ranks_at_signal, attempt)
        return EXIT_PREEMPTED, line

    def _finish(self) -> int:
        code, outcome = self._outcome()
        c = self.cfg
        extra = {} if self._committed_step is None else {"committed_step": self._committed_step}
        summary = self.ledger.done(code, outcome, devices=self.opts.nproc_per_node,
                                   tokens_per_step=c.train.global_batch * c.model.seq_len,
                                   price=c.log.cost_per_device_hour, **extra)
        log.info(f"{outcome}: {format_summary(summary)} -> exit {code}")
        if "cost" in summary:
            log.info(f"this node: {format_cost(summary['cost'])}")
        return code
