"""The supervisor: one node's launcher. It runs torchrun's elastic agent (`launch.agent`, c10d
rendezvous from `launch.rendezvous`) on a thread of its own, and composes what torchrun lacks:

- the recovery coordinator (`launch.recovery`): every failure, hang and silent node goes to it as an
  event, and the supervisor carries out the actions it returns (replace ranks in process, kill a pid,
  restart the group, stop), with the restart policy (`launch.policy`) asked inside it;
- hang detection from per-rank heartbeats (`launch.watchdog`) and failure attribution (`launch.failures`);
- membership (`launch.nodes`): the endpoint list, spares, and whether the other nodes still answer;
- a node joining (a membership change) is no failure: the agent drains the ranks (SIGTERM and the
  grace period to commit an emergency checkpoint) before restarting the group with the new node;
- preemption (`launch.preemption`): SIGTERM (or Ctrl-C) to the launcher is passed to the ranks, which
  finish the step, commit an emergency checkpoint and exit 75 within `fault.preempt_grace_s`;
- the ledger (`launch.ledger`): start, failure, restart, resume, preempt, done in events.jsonl, and the
  outcome with its exit code (common.exits)."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common.process import is_alive
from launch import failures, outcome, rendezvous
from launch.actions import carry_out
from launch.agent import SupervisedAgent
from launch.agent_hooks import GroupStatus
from launch.commits import newest_commit
from launch.ledger import Ledger, format_summary, resume_line
from launch.nodes import Membership
from launch.options import LaunchOptions
from launch.policy import Decision, RestartPolicy
from launch.preemption import Preemption
from launch.recovery import store as recovery_store
from launch.recovery.coordinator import RecoveryCoordinator
from launch.recovery.events import GroupFailed, GroupLeft, GroupStarted, Observed, Preempted, RanksExited, Tick
from launch.recovery.states import Mode
from launch.rounds import stop_keep_alive
from launch.stub import ZYGOTE_ENV
from launch.watchdog import Watchdog, abandoned_progress, heartbeat_prefix
from launch.zygote import Zygote
from trainer.contract import (
    COORD_STORE_ENV,
    EXIT_PREEMPTED,
    HEARTBEAT_DIR_ENV,
    JOB_ENV,
    LAUNCHER_PID_ENV,
    Config,
    HeartbeatRecord,
    forget_store_moves,
    format_cost,
    write_store_moved,
)

log = logging.getLogger(__name__)


@dataclass
class Ending:
    """How the agent's run ended, as far as known: its result ("succeeded", "failed", "closed": the others
    closed the rendezvous before this node took part; "" while it runs), its error, the decision that stopped
    it, whether this node was outvoted in a partition, and the job's final committed step once asked (0: not
    committed)."""

    result: str = ""
    error: BaseException | None = None
    decision: Decision | None = None
    outvoted: bool = False
    final: int | None = None


class Supervisor:
    """One node's launcher: runs the agent, feeds the recovery coordinator and carries out its actions,
    keeps the ledger and decides the exit code. Its agent hooks run on the agent's thread, the rest on the
    main one."""

    def __init__(self, cfg: Config, opts: LaunchOptions, zygote: Zygote | None = None) -> None:
        self.cfg, self.opts, f = cfg, opts, cfg.fault
        self.zygote: Zygote | None = zygote  # warm restarts' fork server (started by launch.__main__; None: off)
        max_restarts = f.max_restarts if opts.max_restarts is None else opts.max_restarts
        one, policy = opts.max_nodes == 1, RestartPolicy.of(f, max_restarts, opts.min_nodes < opts.max_nodes)
        mode = Mode(in_process=f.in_process, single_node=one,
                    smaller=f.in_process and opts.min_nodes < opts.max_nodes, min_nodes=opts.min_nodes)
        self.coordinator = RecoveryCoordinator(mode, policy)
        self.ledger = Ledger(Path(cfg.run.dir))
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        lost = abandoned_progress(cfg.run.dir)  # a launcher of this node killed outright before this one
        heartbeat_dir = Path(tempfile.mkdtemp(prefix=heartbeat_prefix(), dir=cfg.run.dir))
        stall = cfg.storage.stall_s
        self.watchdog = Watchdog(heartbeat_dir, f.hang_timeout_s, stall + 10.0 if stall else 0.0)
        self.members = Membership(rendezvous.endpoints(opts.rdzv_endpoint), self.ledger, opts.max_nodes > 1,
                                  silence_s=f.node_silence_s)
        self.agent: SupervisedAgent | None = None  # created for each endpoint met
        self.attempt = 0  # the running group's restart count (its ranks' TORCHELASTIC_RESTART_COUNT)
        self.preemption = Preemption(grace_s=f.preempt_grace_s)
        self.ending = Ending()
        if lost is not None:  # the first attempt resumes what it left: count its lost steps from here
            self.ledger.previous_last_step = lost.step
            self.ledger.interrupted = (self.ledger.started, "launcher lost")
        self._next_check = 0.0  # when review next reads the heartbeats (fault.heartbeat_s; at once in a recovery)

    @property
    def policy(self) -> RestartPolicy:
        return self.coordinator.policy

    # ------------------------------------------------------------------ agent hooks (agent thread)
    def signalled(self) -> bool:
        return self.preemption.at is not None

    def hard_stop(self) -> bool:
        return self.preemption.hard

    def before_start(self, attempt: int) -> None:
        self.attempt = attempt
        self.watchdog.reset()
        forget_store_moves(self.watchdog.directory)
        claim = self.agent.spare_claim  # a spare's ranks start in a lost node's place, in its recovery's generation
        self.coordinator.handle(GroupStarted(claim["generation"] if claim else 0))
        if self.zygote is not None and not self.zygote.alive():
            if self.zygote.ensure() and self.zygote.wait_bound():
                log.warning(f"the fork server for warm restarts had ended: started again (pid {self.zygote.pid})")
            else:
                log.warning("the fork server for warm restarts is gone: the ranks start afresh")

    def after_start(self, attempt: int, pids: dict[int, int]) -> None:
        interrupted, self.ledger.interrupted = self.ledger.interrupted, None
        self.ledger.attempt_started(attempt, *(interrupted or (None, "")))
        log.info(f"attempt {attempt}: {len(pids)} worker(s) started, pids {sorted(pids.values())}")
        self.members.joined(self.agent)

    def before_restart(self, attempt: int, membership: bool) -> float:
        """The old group is stopped: log the restart and say how long to back off."""
        delay = self.coordinator.take_backoff()
        reason = "membership change" if membership else "failure"
        if membership:
            self.ledger.interrupted = (time.time(), reason)
            log.info("a node is waiting to join: restarting the worker group with it")
        self.ledger.event("restart", n=attempt, delay_s=delay, reason=reason)
        if delay:
            log.info(f"no progress since the last failure: waiting {delay:.1f}s before restarting")
        return delay

    def keep_ranks_on_store_loss(self) -> bool:
        """Whether the ranks keep running when the rendezvous store is lost: in process under --nnodes MIN:MAX,
        with an endpoint to move to, and no signal or stop decided (the next endpoint's agent adopts them)."""
        mode = self.coordinator.mode
        return (mode.in_process and mode.smaller and not self.members.last_endpoint and self.preemption.at is None
                and self.ending.decision is None)

    def replace_failed(self, exits: dict) -> dict[str, str] | None:
        """In-process recovery: the replacements' environment, or None for a full restart."""
        beats = self.watchdog.beats(self.attempt)
        failure, tb = failures.from_exits(exits, set(), beats, self.last_step())
        ranks = self.agent.global_ranks()  # (below: the trainers' own pids; a warm rank's worker is its stub)
        running = {lr: beats[ranks[lr]].pid if ranks.get(lr) in beats else pid
                   for lr, pid in self.agent.worker_pids().items()}
        mode = self.coordinator.mode
        behind = (mode.in_process and not mode.single_node and self.coordinator.pending is None
                  and self.members.left_behind(self.agent, self.coordinator.next_generation(beats)))
        exited = RanksExited(exits=exits, failure=failure, beats=beats, running=running, now=time.time(), traceback=tb,
                             left_behind=behind)
        return carry_out(self, self.coordinator.handle(exited)).env

    def review(self, status: GroupStatus) -> bool:
        """Every monitor interval, with the agent's own view; True turns a healthy group into a hung one."""
        now = time.time()
        if self.preemption.at is not None:
            self.preemption.forward(self.agent, now, beats=lambda: self.watchdog.beats(self.attempt))
        if status.state not in ("failed", "succeeded") and now < self._next_check and self.coordinator.pending is None:
            return False
        beats = self.watchdog.beats(self.attempt)
        recovering = any(b.phase == "recover" for b in beats.values())  # (a lost node is judged at once)
        self._next_check = now + (0 if recovering else self.cfg.fault.heartbeat_s)
        if (beat := self.coordinator.representative(beats)) is not None:
            self.observe(beat)
        exited = any(not is_alive(b.pid) for b in beats.values())  # after the read: see Observed
        actions = self.coordinator.handle(Observed(beats, now=now, ranks=self.agent.global_ranks(), exited=exited,
                                                   handled=lambda g: self.members.handled(self.agent, g, False)))
        if self.preemption.at is not None:
            actions += self.coordinator.handle(Preempted())
        elif status.state == "failed":
            failure, tb = failures.from_exits(status.exits, set(status.victims), beats, self.last_step())
            actions += self.coordinator.handle(GroupFailed(failure, traceback=tb))
        elif status.state == "healthy":
            actions += self.coordinator.handle(Tick(
                now=now, beats=beats, step=self.last_step() + 1,
                local_ranks=tuple(sorted(self.agent.global_ranks().values())),
                handled=lambda generation: self.members.handled(self.agent, generation),
                silence=self.members.silence(self.agent), can_tell=bool(os.environ.get(COORD_STORE_ENV))))
        return carry_out(self, actions).restart

    def group_left(self, nodes: list[str]) -> bool:
        """Nodes of the group restarted it (a failure there) while the ranks here ran on: a failure here too
        (launch.agent restarts at once, without a drain). False when the restart policy stops."""
        carry_out(self, self.coordinator.handle(GroupLeft(nodes=tuple(nodes), step=self.last_step() + 1)))
        return self.ending.decision is None

    def last_step(self) -> int:
        return self.ledger.attempts[-1].last_step if self.ledger.attempts else 0

    def observe(self, beat: HeartbeatRecord) -> None:
        """Fold this node's representative heartbeat into the ledger; say so once a restarted group resumed."""
        event = self.ledger.observe(beat)
        if event:
            log.info(resume_line(event))

    # ------------------------------------------------------------------ main thread
    def run(self) -> int:
        """Supervise the training run on this node to its end; returns the launcher's exit code."""
        os.environ.update({HEARTBEAT_DIR_ENV: str(self.watchdog.directory), LAUNCHER_PID_ENV: str(os.getpid())})
        if self.opts.job:
            os.environ[JOB_ENV] = self.opts.job  # the ranks of this job share its leases (trainer.runtime.lease)
        o, listed = self.opts, self.members.endpoints
        at = rendezvous.first_answering(listed) if len(listed) > 1 else 0
        self.ledger.event("start", nproc_per_node=o.nproc_per_node, nnodes=f"{o.min_nodes}:{o.max_nodes}",
                          max_restarts=self.policy.max_restarts, config=o.config_path, overrides=o.overrides,
                          warm_restarts=self.zygote is not None)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self.zygote is not None:
                self._use_zygote()
            handed = None
            while self._meet_at(at, handed) and self._job_finished() is None and at + 1 < len(listed):
                self.members.move_down()
                # Its ranks go on when it handed them over: the next endpoint's agent adopts them.
                handed = self.agent if self.agent is not None and self.agent.handed_over() else None
                if self.agent is not None:
                    stop_keep_alive(self.agent.spec.rdzv_handler)
                self.ending.error = None
                if handed is None:
                    self.ledger.interrupted = (time.time(), "rendezvous host lost")
                self.agent = None  # the old agent's thread may still be blocked in a call to the lost store
                at += 1
            if beats := self.watchdog.beats(self.attempt):  # the last word of this node's ranks, for the outcome
                self.observe(beats[min(beats)])
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

    def _meet_at(self, at: int, previous: SupervisedAgent | None = None) -> bool:
        """Run worker groups with the rendezvous at the `at`-th endpoint until the job ends here; True when
        it ended because that endpoint's store stopped answering (its node is lost, or this one cut off).
        `previous`: the agent of the lost endpoint, whose ranks still run; the new agent adopts them instead of
        meeting the others (their recovery moves to this endpoint's store)."""
        o = self.opts
        try:
            endpoint = self.members.meet(at)
            spec, hosted = rendezvous.worker_spec(o, self.cfg.run.name, self.cfg.run.dir,
                                                  self.policy.max_restarts - self.policy.restarts,
                                                  warm=self.zygote is not None, endpoint=endpoint)
        except Exception as e:  # noqa: BLE001 - the next endpoint's node may be lost too
            self.ending.error = e
            if previous is not None:  # nobody to adopt its ranks: they go
                previous.kill()
            log.info(f"cannot meet at {self.members.endpoints[at]}: {type(e).__name__}: {e}")
            return rendezvous.store_lost(e)
        self.members.watch(os.environ.get(COORD_STORE_ENV, ""))
        if not self.coordinator.mode.uses_store:  # (the rendezvous handler names its store for the ranks)
            os.environ.pop(COORD_STORE_ENV, None)
        door = self.members.door_for(spec, os.environ.get(COORD_STORE_ENV, ""), self.coordinator.mode.smaller
                                     and self.coordinator.mode.in_process and previous is None)
        self.agent = SupervisedAgent(spec, self, drain_grace_s=self.cfg.fault.preempt_grace_s, door=door)
        if previous is not None:
            self._adopt(previous, at)
        self.ledger.event("rendezvous", endpoint=self.members.endpoint, index=at, hosted=hosted,
                          adopted=previous is not None)
        thread = threading.Thread(target=self._run_agent, args=(self.agent,), name="elastic-agent", daemon=True)
        thread.start()
        try:
            self._wait_for(thread)
        finally:
            self.members.stop()
        error = self.ending.error
        return self.preemption.at is None and error is not None and rendezvous.store_lost(error)

    def _adopt(self, previous: SupervisedAgent, at: int) -> None:
        """The new agent takes over the ranks of the lost endpoint's; the ranks learn where their store went
        (the heartbeat directory's store file: trainer.recovery.regroup follows it)."""
        store, group = os.environ[COORD_STORE_ENV], f"{previous.round()}@{at}"
        old = (previous.move.coord_store, previous.round())
        self.agent.adopt(previous, group, {COORD_STORE_ENV: store})
        write_store_moved(self.watchdog.directory, old, (store, group))
        recovery_store.moved_here(self.agent)
        log.info(f"the ranks here keep running (pids {sorted(self.agent.worker_pids().values())}): their in-process "
                 f"recovery moves to the store at {self.members.endpoint}")

    def _run_agent(self, agent: SupervisedAgent) -> None:
        """The agent's thread. An agent left behind when this node moved down the endpoint list (blocked in
        a call to the lost store) reports nothing when it ends: the next meeting is not its."""
        error = None
        try:
            ended = agent.supervise()
            if agent is self.agent:
                self.ending.result = ended
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            error = e
            if agent is self.agent and self.ending.error is None:
                self.ending.error = e
        finally:
            # A preempted node leaves the rendezvous open for its replacement, an outvoted one for the majority;
            # a lost store has none to close.
            if (self.preemption.at is None and agent is self.agent and not self.ending.outvoted
                    and not (error and rendezvous.store_lost(error))):
                agent.leave_rendezvous()

    def _wait_for(self, thread: threading.Thread) -> None:
        """Wait for the agent's thread to end, or, once signalled, for no worker group to be left to ask."""
        idle_since = None
        while thread.is_alive():
            thread.join(0.2)
            p = self.preemption
            if self.agent.move.store_error is not None:  # its ranks go on under the next endpoint's agent
                self.ending.error = self.agent.move.store_error
                return
            if p.at is None:
                if self.ending.error is None and (cut := self.members.cut_off()) is not None:
                    # Its thread may be blocked in a call to the store for a minute more: the ranks go on under the
                    # next endpoint's agent, or are stopped here.
                    if self.agent.running() and self.keep_ranks_on_store_loss():
                        self.agent.hand_over()  # (its thread, blocked or not, ends no rank)
                    else:
                        self.agent.kill()
                    self.ending.error = cut
                    return
                self.members.note_spare(self.agent)
                continue
            if p.hard:
                self.agent.kill()
            if self.agent.running():
                idle_since = None
                continue
            # Signalled, and no rank is running: the agent is in a rendezvous, a backoff or the exit
            # barrier, where nothing acts on the signal (for up to join_timeout). Stop here.
            now = time.time()
            idle_since = idle_since or now
            if p.hard or now - idle_since >= p.patience(now):
                log.info("no worker group is running: stopping now")
                return

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        name = self.preemption.signalled(signum, time.time(), self.agent is not None and self.agent.running())
        if name is None:
            return
        self.ledger.event("preempt", signal=name, step=self.last_step())
        log.info(f"{name}: asking the ranks to finish the step and commit an emergency checkpoint "
                 f"(grace {self.cfg.fault.preempt_grace_s:.0f}s; send it again a second later to stop at once)")

    def _outcome(self) -> tuple[int, str]:
        """The exit code and one line saying why."""
        e = self.ending
        if self.preemption.at is not None and e.result != "succeeded":
            return self._preempted_outcome()
        gone = e.result == "closed" or e.error is not None and rendezvous.store_lost(e.error)
        return outcome.ended(e.result == "succeeded", e.result == "closed", e.error, e.decision,
                             self.members.endpoint, len(self.members.endpoints), bool(self.ledger.attempts),
                             self._job_finished() if gone else None)

    def _job_finished(self) -> int | None:
        """The final step, when the checkpoint store holds its commit: the job is over (asked once the
        rendezvous is gone: its host may simply have finished, with this node a spare or a late one)."""
        if self.ending.final is None:
            newest = newest_commit(self.cfg.checkpoint_dir, 10.0)
            self.ending.final = newest[0] if newest is not None and newest[0] >= self.cfg.train.steps else 0
        return self.ending.final or None

    def _preempted_outcome(self) -> tuple[int, str]:
        p = self.preemption
        attempt = self.ledger.attempts[-1] if self.ledger.attempts else None
        line, p.committed_step = outcome.preempted(self.cfg.checkpoint_dir, self.cfg.fault.preempt_grace_s,
                                                   p.at, p.ranks_running, attempt)
        return EXIT_PREEMPTED, line

    def _finish(self) -> int:
        code, why = self._outcome()
        c = self.cfg
        committed = self.preemption.committed_step
        extra = {} if committed is None else {"committed_step": committed}
        summary = self.ledger.done(code, why, devices=self.opts.nproc_per_node,
                                   tokens_per_step=c.train.global_batch * c.model.seq_len,
                                   price=c.log.cost_per_device_hour, **extra)
        log.info(f"{why}: {format_summary(summary)} -> exit {code}")
        if "cost" in summary:
            log.info(f"this node: {format_cost(summary['cost'])}")
        return code
