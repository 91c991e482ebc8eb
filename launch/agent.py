"""torchrun's elastic agent (`LocalElasticAgent`) with the supervisor's hooks. With launch.rounds (which
reads the rendezvous handler's `_state_holder`), the only module that touches torchelastic's internals
(its private methods, `_pcontext`, `_worker_group`, `_remaining_restarts`): when a torch release moves
them, these files are what to fix.

What it changes in torchrun's behaviour:
- a failed group's survivors are SIGKILLed at once instead of SIGTERMed with a 30s wait (they sit in
  collectives with a dead peer), and the ranks still alive then are remembered as victims;
- a restart stops the old group before the backoff, not after it (a hung rank must not hold its
  memory or GPU through the wait); a membership change first drains the ranks (SIGTERM, then the
  grace period to commit an emergency checkpoint), unless the node waiting is one of the group's own
  that restarted it (a failure there): then it is a failure here too, restarted at once;
- the ranks are told the group's rendezvous round (`ROUND_ENV`), the same on every node: their
  coordination store's prefix (a node's restart count is not the same everywhere);
- between worker groups a signal to the launcher starts nothing more (`Stopping`);
- a lost store does not stop the ranks when the hooks say so: the next endpoint's agent adopts them;
- a spare claimed for a lost node (launch.spares) starts that node's ranks in the running round, without a
  rendezvous (`_take_place`).
Everything else is asked of the `Hooks` (the supervisor): what to log, how long to back off, whether a group
is healthy."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from common.clock import wait_until
from common.process import send_signal
from common.timing import EXIT_BARRIER_S, SURVIVOR_GRACE_S
from launch.agent_hooks import GroupStatus, HandedOver, Hooks, Move, NoRestartLeft, Stopping
from launch.failures import drop_torn_error_file, rank_exit
from launch.rendezvous import store_lost
from launch.rounds import Round, SpareClaimed, claimable, keep_seat, nodes_that_left, spare_store
from launch.spares import SpareDoor
from trainer.contract import COORD_STORE_ENV, GENERATION_ENV, ROUND_ENV, check_elastic_agent, is_alive


class _QuietThreadWarning(logging.Filter):
    """torchelastic warns that it cannot install signal handlers off the main thread: this launcher
    handles SIGTERM/SIGINT itself (and ranks die with it through PR_SET_PDEATHSIG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to register signal handlers" not in record.getMessage()


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietThreadWarning())


class SupervisedAgent(LocalElasticAgent):
    """torchrun's agent with the supervisor's hooks at start, monitor, stop and restart. The supervisor
    uses `supervise`, `worker_pids`, `running`, `stop_restarts`, `terminate`, `kill` and `leave_rendezvous`."""

    def __init__(self, spec: WorkerSpec, hooks: Hooks, drain_grace_s: float, door: SpareDoor | None = None) -> None:
        super().__init__(spec, DefaultLogsSpecs(), start_method="spawn", exit_barrier_timeout=EXIT_BARRIER_S)
        check_elastic_agent(self)  # what follows overrides and reads torchelastic's private members
        self.spec, self.hooks, self.drain_grace_s = spec, hooks, drain_grace_s
        self._victims: set[int] = set()  # local ranks still alive when the group was torn down
        self.meeting = Round()  # the running group's rendezvous round
        self.move = Move(coord_store=os.environ.get(COORD_STORE_ENV, ""))  # its part in a move (`hand_over`, `adopt`)
        self.door = door  # a spare's way into a running group, in a lost node's place (launch.spares)
        claimable(spec.rdzv_handler, door)

    # ------------------------------------------------------------------ the supervisor's interface
    def supervise(self) -> str:
        """Run worker groups until one succeeds ("succeeded") or no restart is left ("failed"); "closed" when
        the others closed the rendezvous while this node waited to join (torchelastic returns nothing then).
        Raises `Stopping` when a signal arrived between groups."""
        try:
            result = self.run()
        except NoRestartLeft:
            return "failed"
        if result is None:
            return "closed"
        return "succeeded" if result.state == WorkerState.SUCCEEDED else "failed"

    def worker_pids(self) -> dict[int, int]:
        """Local rank -> pid of the current group ({} between groups)."""
        return dict(self._pcontext.pids()) if self._pcontext else {}

    def running(self) -> bool:
        """Whether any rank of the current group is still running."""
        return any(is_alive(pid) for pid in self.worker_pids().values())

    def stop_restarts(self) -> None:
        """Let the current group be the last: when it ends, `supervise` returns."""
        self._remaining_restarts = 0

    def terminate(self, pids: Iterable[int]) -> None:
        """SIGTERM these ranks (not their children): each finishes its step, commits and exits 75."""
        for pid in pids:
            send_signal(pid, signal.SIGTERM, group=False)

    def kill(self) -> None:
        """SIGKILL every rank's process group (the rank and its loader workers)."""
        for pid in self.worker_pids().values():
            send_signal(pid, signal.SIGKILL, group=True)

    def drain(self, grace_s: float) -> None:
        """SIGTERM every rank and wait up to `grace_s` for them to exit (a second signal ends the wait)."""
        pids = list(self.worker_pids().values())
        self.terminate(pids)
        wait_until(lambda: not any(is_alive(pid) for pid in pids) or self.hooks.hard_stop(), grace_s, 0.1)

    def global_ranks(self) -> dict[int, int]:
        """Local rank -> global rank of the current group."""
        return {w.local_rank: w.global_rank for w in self._worker_group.workers}

    def world_size(self) -> int:
        return self._worker_group.workers[0].world_size if self._worker_group.workers else 0

    def run_id(self) -> str:
        return self.spec.rdzv_handler.get_run_id()

    def round(self) -> str:
        """The running worker group's name, the same on every node: its rendezvous round ("r3")."""
        return self.meeting.name

    def group(self) -> tuple[str, int, int] | None:
        """The running worker group: its name (`round`), this node's rank in it and its number of nodes;
        None between groups."""
        g = self._worker_group
        if g.group_rank is None or not self.meeting.name:
            return None
        return self.meeting.name, g.group_rank, g.group_world_size

    def waiting_as_spare(self) -> bool:
        """Whether this node waits in the rendezvous's redundancy list (the job has its --nnodes MAX nodes):
        torch's private state, read as it stands (False when torch moved it)."""
        handler = self.spec.rdzv_handler
        try:
            return handler._this_node in handler._state_holder.state.redundancy_list
        except AttributeError:
            return False

    def nodes_waiting(self) -> int:
        return self.spec.rdzv_handler.num_nodes_waiting()

    def renumber(self, ranks: dict[int, int]) -> None:
        """The running group went on in a smaller world (a lost node, in process): its ranks' new numbers
        (old global rank -> new), for the replacement of a rank started later and for the reports. The
        lost nodes will not come to the exit barrier: it is skipped. Nor are they of the group any more: one
        that comes back to the rendezvous is a node joining (the ranks here drain, committing their
        progress, and restart with it), not a node of the group that restarted it (a failure: restarting at
        once, from the older state the two worlds still share, would lose the steps trained alone)."""
        self.meeting = self.meeting.renumbered(ranks, getattr(self.spec.rdzv_handler, "_this_node", None))
        world = len(ranks)
        for worker in self._worker_group.workers:
            worker.global_rank = worker.role_rank = ranks[worker.global_rank]
            worker.world_size = worker.role_world_size = world
            if self._pcontext is not None:
                env = self._pcontext.envs[worker.local_rank]
                env.update(RANK=str(worker.global_rank), ROLE_RANK=str(worker.global_rank), WORLD_SIZE=str(world),
                           ROLE_WORLD_SIZE=str(world))
        self._exit_barrier_timeout = 0

    def hand_over(self) -> None:
        """Leave the running ranks to the next endpoint's agent (the store was lost): this agent neither stops nor
        watches them any more, whatever its thread (maybe blocked in a call to the lost store) does."""
        self.move.handed_over = True

    def handed_over(self) -> bool:  # and its ranks run on
        return self.move.handed_over and self.running()

    def adopt(self, previous: SupervisedAgent, group: str, env: dict[str, str]) -> None:
        """Take over the running ranks of `previous` (its endpoint's store was lost) instead of meeting the others
        and starting ranks: they recover in process at this endpoint's store, their keys under `group`; `env`:
        what a rank started later (a replacement) is told instead of the old store."""
        self._pcontext, self._worker_group = previous._pcontext, previous._worker_group
        self._worker_group.spec = self.spec  # this endpoint's rendezvous
        self._remaining_restarts = previous._remaining_restarts
        self._exit_barrier_timeout = previous._exit_barrier_timeout
        self.meeting = previous.meeting.moved(group)
        for worker_env in self._pcontext.envs.values():
            worker_env.update(env, **{ROUND_ENV: group})
        self._fast_close(self._pcontext)
        self.move.adopted_at, self.move.pending = time.time(), True

    def leave_rendezvous(self) -> None:
        """Close the rendezvous for good (a preempted node leaves it open for its replacement instead, and a
        node outvoted in a partition for the majority)."""
        self.spec.rdzv_handler.shutdown()

    # ------------------------------------------------------------------ torchelastic's methods, overridden
    def _restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _rendezvous(self, worker_group) -> None:
        if self.door is not None:
            self.door.joined = None
        try:
            super()._rendezvous(worker_group)
            if self.door is not None:  # it met the others: a spare no more (a claim would find no ranks coming)
                self.door.leave()
        except SpareClaimed:
            if self._take_place(worker_group, self.door.take()):
                return
            super()._rendezvous(worker_group)  # the round moved on meanwhile: meet the others (the door is shut)
        self.meeting = Round.met(self.spec.rdzv_handler, worker_group, self.world_size(), self.spec.local_world_size)
        os.environ[ROUND_ENV] = self.meeting.name  # the ranks' (torchelastic starts them with os.environ and its own)

    @property
    def spare_claim(self) -> dict | None:
        """The claim the running group started on: a spare's ranks in a lost node's place (`_take_place`)."""
        return self.door.joined if self.door is not None else None

    def place_of(self, lost: list[int]) -> dict | None:
        """Where the ranks `lost` belong in the running group, for a spare to start them in their node's place
        (launch.spares): None unless they are exactly one node's."""
        g = self._worker_group
        if frozenset(lost) not in self.meeting.ranks.values() or g.group_rank is None:
            return None
        return {"round": self.meeting.name, "ranks": sorted(lost), "group_rank": min(lost) // len(lost),
                "group_world_size": g.group_world_size, "world": self.world_size(), "nproc": len(lost),
                "master_addr": g.master_addr, "master_port": g.master_port, "holdings": self.meeting.holdings()}

    def _take_place(self, worker_group, claim: dict | None) -> bool:
        """A spare claimed for a lost node: that node's ranks, the same global ranks and world size, in the
        running round and the recovery's generation, without a rendezvous. False when the round moved on."""
        store = spare_store(self.spec.rdzv_handler, claim["round"]) if claim else None
        if store is None or claim["nproc"] != self.spec.local_world_size:
            return False
        world = claim["world"]
        worker_group.workers = [Worker(local_rank=lr, global_rank=rank, role_rank=rank, world_size=world,
                                       role_world_size=world) for lr, rank in enumerate(claim["ranks"])]
        worker_group.store = self._store = store
        worker_group.group_rank, worker_group.group_world_size = claim["group_rank"], claim["group_world_size"]
        worker_group.master_addr, worker_group.master_port = claim["master_addr"], claim["master_port"]
        self.meeting, self.door.joined = Round.joined(claim["round"], claim.get("holdings", [])), claim
        os.environ.update({ROUND_ENV: claim["round"], GENERATION_ENV: str(claim["generation"])})
        keep_seat(self.spec.rdzv_handler)
        return True

    def _initialize_workers(self, worker_group) -> None:
        if self.move.pending:  # the ranks run already (`adopt`)
            self.move.pending = False
            worker_group.state = WorkerState.HEALTHY
            return
        super()._initialize_workers(worker_group)

    def _invoke_run(self, role: str = "default"):
        try:
            return super()._invoke_run(role)
        except Exception as e:
            if self.move.handed_over or (store_lost(e) and self.running() and self.hooks.keep_ranks_on_store_loss()):
                self.hand_over()
                self.move.store_error = e
                # PR_SET_PDEATHSIG kills a child when the *thread* that forked it ends: this one waits, for good.
                threading.Event().wait()
            raise

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if not self.move.handed_over:  # (the ranks are the next agent's)
            super()._shutdown(death_sig, timeout)

    def _start_workers(self, worker_group):
        if self.hooks.signalled():
            raise Stopping("signalled before the worker group started")
        attempt = self._restart_count()  # what torchelastic gives the ranks (stop_restarts() changes it later)
        self._exit_barrier_timeout = EXIT_BARRIER_S  # (`renumber` turned it off for a smaller world)
        self.hooks.before_start(attempt)
        try:
            pids = super()._start_workers(worker_group)
        finally:
            os.environ.pop(GENERATION_ENV, None)  # (a spare's ranks start in the recovery's generation: `_take_place`)
        self._fast_close(self._pcontext)
        self.hooks.after_start(attempt, pids)
        return pids

    def _fast_close(self, pcontext) -> None:
        """When one rank fails, torchelastic SIGTERMs the others and waits up to 30s. Those survivors
        are stuck in collectives with the dead rank (SIGTERM only reaches Python between C++ calls),
        so kill them at once, and remember which ranks were still alive: they are victims, not causes.
        During a preemption the ranks get the gentle signal and the grace period instead."""
        close = getattr(pcontext, "torch_close", pcontext.close)  # torchelastic's own (an adopted group's too)
        pcontext.torch_close = close
        self._victims = set()

        def close_now(death_sig=None, timeout: int = 30) -> None:
            pcontext.closing = True  # (the ranks it kills are not offered for replacement: `_replace_in_poll`)
            self._victims = {lr for lr, pid in pcontext.pids().items() if is_alive(pid)}
            if not self.hooks.signalled():
                death_sig, timeout = death_sig or signal.SIGKILL, min(timeout, SURVIVOR_GRACE_S)
            close(death_sig, timeout)
            for lr in self._victims:  # torchelastic reads their error files next: a torn one would raise
                drop_torn_error_file(pcontext.error_files[lr])

        pcontext.close = close_now
        self._replace_in_poll(pcontext)

    def _replace_in_poll(self, pcontext) -> None:
        """torchelastic's poll closes the whole group as soon as it finds a failed rank: what it finds is offered
        for replacement first (`_replace_dead`), in the same poll (a look of the agent's own before it left a
        window in which a rank that died restarted the group); the ranks replaced are not reported as failed."""
        capture = getattr(pcontext, "torch_capture", getattr(pcontext, "_capture_process_failures", None))
        if capture is None or not hasattr(pcontext, "_failures"):
            return
        pcontext.torch_capture = capture

        def capture_then_replace(done: set[int]) -> None:
            before = set(pcontext._failures)
            capture(done)
            found = {lr: f.exitcode for lr, f in pcontext._failures.items() if lr not in before}
            if found and not getattr(pcontext, "closing", False) and not self.hooks.signalled():
                for lr in self._replace_dead(self._worker_group, found):
                    pcontext._failures.pop(lr, None)
                    done.discard(lr)

        pcontext._capture_process_failures = capture_then_replace

    def _stop_workers(self, worker_group) -> None:
        # Survivors of a failure are blocked in collectives with a dead peer; a SIGSTOPped rank
        # ignores SIGTERM. Waiting for either only delays recovery: SIGKILL the process groups.
        self._shutdown(signal.SIGKILL, timeout=SURVIVOR_GRACE_S)

    def _restart_workers(self, worker_group) -> None:
        """Stop the group first, then back off, rendezvous and start. torchelastic restarts a healthy
        group only when a node waits to join (a membership change): the ranks are drained first, so
        that the new group loses no step."""
        membership = worker_group.state == WorkerState.HEALTHY
        if membership and (left := nodes_that_left(self.spec.rdzv_handler, self.meeting.nodes)):
            membership = False  # a failure elsewhere: the ranks here wait for ranks that are gone
            if not self.hooks.group_left(left):
                self._stop_workers(worker_group)
                raise NoRestartLeft()
            self._remaining_restarts = max(self._remaining_restarts - 1, 0)  # counted as torchelastic counts failures
        if membership:
            self.drain(self.drain_grace_s)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self._back_off(self.hooks.before_restart(self._restart_count(), membership))
        self._initialize_workers(worker_group)

    def _exit_barrier(self) -> None:
        if self._exit_barrier_timeout > 0:  # 0: the world got smaller in process; the lost nodes never come
            super()._exit_barrier()

    def _back_off(self, delay_s: float) -> None:
        if wait_until(self.hooks.signalled, delay_s, 0.1):
            raise Stopping("signalled during the backoff")

    def _monitor_workers(self, worker_group) -> RunResult:
        if self.move.handed_over:
            raise HandedOver("the ranks went to the agent of the next rendezvous endpoint")
        result = super()._monitor_workers(worker_group)  # (a failed rank offered for replacement first)
        exits = {}
        if result.state == WorkerState.FAILED:
            exits = {rank: rank_exit(rank, pf) for rank, pf in result.failures.items()}
        status = GroupStatus(result.state.name.lower(), exits, frozenset(self._victims))
        return RunResult(state=WorkerState.UNHEALTHY) if self.hooks.review(status) else result

    def _replace_dead(self, worker_group, dead: dict[int, int]) -> set[int]:
        """In-process recovery: offer the ranks that died (local rank -> exit code) to the supervisor, each process
        once, before torchelastic stops the whole group; start the replacements it asks for, alone, in place in
        torchelastic's process context. The local ranks replaced."""
        pcontext = self._pcontext
        handlers, offered = pcontext.subprocess_handlers, pcontext.__dict__.setdefault("offered", set())
        dead = {lr: code for lr, code in dead.items() if handlers[lr].proc.pid not in offered}
        if not dead:
            return set()
        offered |= {handlers[lr].proc.pid for lr in dead}
        exits = {}
        for lr, code in dead.items():
            drop_torn_error_file(pcontext.error_files[lr])
            failure = ProcessFailure(local_rank=lr, pid=handlers[lr].proc.pid, exitcode=code,
                                     error_file=pcontext.error_files[lr])
            exits[worker_group.workers[lr].global_rank] = rank_exit(worker_group.workers[lr].global_rank, failure)
        extra_env = self.hooks.replace_failed(exits)
        if extra_env is None:
            return set()
        for lr in dead:
            with contextlib.suppress(OSError):
                os.remove(pcontext.error_files[lr])  # the replacement's own, if it fails
            handlers[lr] = get_subprocess_handler(
                entrypoint=pcontext.entrypoint, args=pcontext.args[lr], env={**pcontext.envs[lr], **extra_env},
                stdout=pcontext.stdouts[lr], stderr=pcontext.stderrs[lr], local_rank_id=lr)
            worker_group.workers[lr].id = handlers[lr].proc.pid
        return set(dead)
