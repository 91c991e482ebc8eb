"""The supervisor's multi-node part (`launch.supervisor` mixes it in): where this node meets the others,
moving down the `--rdzv-endpoint` list when the node hosting the store is lost, and whether the nodes of
its group still hear each other (`launch.liveness`), which turns a partition into a bounded verdict:

- this node cannot reach the store for `liveness.LOST_S`: its ranks are stopped, and it moves down the
  list (a new store must answer within `MOVE_WAIT_S`) or, the list spent, exits 75;
- the store answers but nodes of the group went silent (lost without a word, as a node that loses its
  power or its link: no connection is closed, so the ranks here sit in collectives with theirs until the
  collective timeout): with a strict majority of the group still answering, or exactly half of it at the
  last endpoint of the list (the silent half cannot move on to host a rival group: cut off, it exits 75),
  this side goes on at once. Left alone under MIN:MAX, its ranks are told to leave the collective and go
  on in process in a smaller world (launch.inprocess); otherwise, or when they do not within `TOLD_S`, the
  group restarts without the silent nodes. Without such a majority this node stops (exit 75), so that two
  sides of a partition never both train and commit."""

from __future__ import annotations

import logging
import os
import threading
import time

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from launch import rendezvous
from launch.agent import SupervisedAgent
from launch.failures import Failure
from launch.inprocess import tell_the_ranks
from launch.liveness import Liveness, goes_on
from launch.policy import Decision
from trainer.contract import COORD_STORE_ENV, EXIT_PREEMPTED

log = logging.getLogger(__name__)

MOVE_WAIT_S = 10.0  # how long a launcher moving down the list waits for the next endpoint's store to listen
# Ranks told that nodes went silent leave their collective within a few tenths of a second and go on in a
# smaller world soon after (launch.inprocess.NODE_LOST_S); not done by then: the group restarts.
TOLD_S = 5.0


class Meeting:
    """Mixed into the Supervisor (it provides opts, cfg, policy, zygote, inproc, ledger, agent, watchdog,
    attempt, _run_agent, _wait_for, _on_failure, _last_step, and the fields set here)."""

    liveness: Liveness | None = None
    _endpoint = ""  # the rendezvous endpoint in use (--rdzv-endpoint may list several)
    _spare_since: float | None = None  # when this node was first seen waiting as a spare
    _outvoted = False  # this node stopped as the minority of a partition: it leaves the rendezvous open
    _last_endpoint = True  # the endpoint in use is the last of the list: nobody can move on from it
    _told: float | None = None  # when the ranks here were told that nodes went silent (to go on in process)

    def _note_spare(self) -> None:
        """On the main thread, between groups: say once that this node waits as a spare."""
        if self._spare_since is None and not self.ledger.attempts and self.agent.waiting_as_spare():
            self._spare_since = time.time()
            log.info("the job has its --nnodes MAX nodes: this node waits as a spare (its fork server ready) and "
                     "joins at the next rendezvous after a node is lost")
            self.ledger.event("spare_waiting", endpoint=self._endpoint)

    def _note_joined(self) -> None:
        """The first group this launcher starts: a spare joining says so."""
        if self._spare_since is not None and len(self.ledger.attempts) == 1:
            waited = time.time() - self._spare_since
            log.info(f"this spare joins the job after waiting {waited:.1f}s")
            self.ledger.event("spare_joined", waited_s=round(waited, 1))

    def _meet_at(self, at: int) -> bool:
        """Run worker groups with the rendezvous at the `at`-th endpoint until the job ends here; True when
        it ended because that endpoint's store stopped answering (its node is lost, or this one cut off)."""
        o = self.opts
        endpoint = rendezvous.endpoints(o.rdzv_endpoint)[at] if o.rdzv_endpoint else ""
        self._endpoint = endpoint or "127.0.0.1"
        self._last_endpoint = at + 1 >= len(rendezvous.endpoints(o.rdzv_endpoint) if o.rdzv_endpoint else [""])
        try:
            if at:
                _wait_for_store(endpoint, MOVE_WAIT_S)
            spec, hosted = rendezvous.worker_spec(o, self.cfg.run.name, self.cfg.run.dir,
                                                  self.policy.max_restarts - self.policy.restarts,
                                                  warm=self.zygote is not None, endpoint=endpoint)
        except Exception as e:  # noqa: BLE001 - the next endpoint's node may be lost too
            self._error = e
            log.info(f"cannot meet at {endpoint}: {type(e).__name__}: {e}")
            return rendezvous.store_lost(e)
        if o.max_nodes > 1:
            self.liveness = Liveness(os.environ[COORD_STORE_ENV], self.ledger.node).start()
        if not (self.inproc.enabled or self.inproc.smaller):  # (the rendezvous handler names its store for the ranks)
            os.environ.pop(COORD_STORE_ENV, None)
        self.agent = SupervisedAgent(spec, self, drain_grace_s=self.cfg.fault.preempt_grace_s)
        self.ledger.event("rendezvous", endpoint=self._endpoint, index=at, hosted=hosted)
        thread = threading.Thread(target=self._run_agent, args=(self.agent,), name="elastic-agent", daemon=True)
        thread.start()
        try:
            self._wait_for(thread)
        finally:
            if self.liveness is not None:
                self.liveness.stop()
        return self.preempt_at is None and self._error is not None and rendezvous.store_lost(self._error)

    def _move_down(self, listed: list[str], at: int) -> int:
        """The store at endpoint `at` is lost with its node: go on at the next one (the group restarts there,
        from the newest state). Returns its index."""
        self._error, self._interrupted = None, (time.time(), "rendezvous host lost")
        self.agent = None  # the old agent's thread may still be blocked in a call to the lost store: not ours
        log.info(f"the rendezvous endpoint {listed[at]} stopped answering (the node hosting it is lost, or this "
                 f"one cut off): moving to {listed[at + 1]}, the next one of --rdzv-endpoint")
        self.ledger.event("rendezvous_lost", endpoint=listed[at], next=listed[at + 1])
        return at + 1

    def _join_liveness(self, generation: int = 0) -> None:
        """Watch the nodes of the group just started (or of the smaller world it went on in)."""
        if self.liveness is not None and (group := self.agent.group()) is not None:
            name, rank, size = group
            self.liveness.join(f"{name}/g{generation}", rank, size)

    def _cut_off(self) -> bool:
        """On the main thread: the store has not answered for liveness.LOST_S. Stop the ranks and end this
        meeting as a lost store (the agent's thread may be blocked in a call to it for a minute more)."""
        quiet = self.liveness.cut_off() if self.liveness is not None and self._error is None else 0.0
        if not quiet:
            return False
        log.info(f"the rendezvous store at {self._endpoint} has not answered for {quiet:.0f}s: this node is cut "
                 f"off from it, or its node is lost; stopping the ranks here")
        self.ledger.event("partition", cut_off=self.ledger.node, endpoint=self._endpoint, quiet_s=round(quiet, 1))
        self.agent.kill()
        self._error = RendezvousConnectionError(f"the rendezvous store at {self._endpoint} did not answer for "
                                                f"{quiet:.0f}s")
        return True

    def group_left(self, nodes: list[str]) -> bool:
        """The agent's hook: nodes of the group restarted it (a failure there) while the ranks here ran on,
        blocked in collectives with ranks that are gone. A failure here too: the group restarts at once,
        without the drain a node joining gets (SIGTERM and the grace period for an emergency checkpoint,
        which those collectives never let the ranks commit). False when the restart policy stops."""
        self._on_failure(Failure(0, "node", self._last_step() + 1, key="node restarted the group",
                                 message=f"node(s) {', '.join(nodes)} left the worker group to meet again (a failure "
                                         f"there): the ranks here wait for ranks that are gone"), "")
        return self._decision is None

    def _silent_nodes(self) -> bool:
        """In review: nodes of the group went silent. True restarts the group without them (or, without a
        majority answering, ends this node: exit 75); False when nothing is to be done, or the ranks here
        were told to go on without them in process (launch.inprocess's lost node takes it from there)."""
        silent = self.liveness.silent() if self.liveness is not None else []
        group = self.agent.group() if silent else None
        if group is None:
            self._told = None
            return False
        if self._told is not None and time.monotonic() - self._told < TOLD_S:
            return False
        size = group[2]
        live = size - len(silent)
        if self._told is None:
            self.ledger.event("partition", silent=silent, live=live, group_size=size)
        if not goes_on(live, size, self._last_endpoint):
            reason = (f"this node is cut off: only {live} of the group's {size} node(s) answer (not a majority; "
                      f"silent: {', '.join(silent)}): stopping without committing, launch again to resume")
            self._decision = Decision(False, exit_code=EXIT_PREEMPTED, reason=reason)
            self._outvoted = True  # the majority goes on (closing it would end the job on every node)
            self.agent.stop_restarts()
            log.info(reason)
            return True
        if self._told is None and live == 1 and self._tell_the_ranks(silent):
            return False
        why = " (the ranks here did not leave their collectives when told)" if self._told is not None else ""
        self._on_failure(Failure(0, "node", self._last_step() + 1, key="node silent",
                                 message=f"the launcher(s) of {', '.join(silent)} stopped answering for "
                                         f"{self.liveness.lost_s:.0f}s: cut off or lost{why}"), "")
        return True

    def _tell_the_ranks(self, silent: list[str]) -> bool:
        """This node alone answers: under MIN:MAX down to one node, with no recovery under way, tell the ranks
        here that their generation failed (they leave the collectives they wait in with the silent nodes'
        ranks, and wait for ranks nobody replaces: a lost node, launch.inprocess). True when told."""
        if not self.inproc.smaller or self.opts.min_nodes > 1 or self.inproc.pending is not None \
                or not os.environ.get(COORD_STORE_ENV):
            return False
        beats = self.watchdog.beats(self.attempt)
        generation = max([self.inproc.generation, *(b.get("generation", 0) for b in beats.values())]) + 1
        log.info(f"the launcher(s) of {', '.join(silent)} stopped answering for {self.liveness.lost_s:.0f}s (lost, or "
                 f"cut off): telling the ranks here to leave generation {generation - 1} and go on without them")
        tell_the_ranks(os.environ[COORD_STORE_ENV], self.agent.run_id(), self.agent.round(), generation)
        self._told, self.inproc.silent_since = time.monotonic(), self.liveness.last_heard(silent)
        return True


def _wait_for_store(endpoint: str, timeout_s: float) -> None:
    """Wait until something listens at `endpoint` (the node moving there first hosts it); a node that can
    bind the address hosts it itself and does not wait. RendezvousConnectionError after `timeout_s`."""
    host, _ = parse_rendezvous_endpoint(endpoint, default_port=rendezvous.DEFAULT_PORT)
    if rendezvous.local_address(host) is not None:
        return
    deadline = time.monotonic() + timeout_s
    while not rendezvous.listening(endpoint, 1.0):
        if time.monotonic() > deadline:
            raise RendezvousConnectionError(f"no rendezvous store at {endpoint} within {timeout_s:.0f}s")
        time.sleep(0.2)
