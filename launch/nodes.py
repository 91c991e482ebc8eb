"""Multi-node membership, as one node's launcher sees it (`Membership`, composed into launch.supervisor):
the rendezvous endpoint in use (`--rdzv-endpoint` may list several, moved down when the node hosting the
store is lost), whether this node waits as a spare (and its door into a running group, launch.spares), and
whether the nodes of its group still hear each other (`launch.liveness`), which turns a partition into a
bounded verdict:

- this node cannot reach the store for `fault.node_silence_s` (`LOST_S` by default): its ranks are stopped,
  and it moves down the list (a new store must answer within `MOVE_WAIT_S`) or, the list spent, exits 75
  (`cut_off`);
- the store answers but nodes of the group went silent (lost without a word, as a node that loses its
  power or its link: no connection is closed): `silence` describes them, and the recovery coordinator
  (launch.recovery) decides whether this side goes on without them or stops."""

from __future__ import annotations

import logging
import time

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from common.clock import wait_until
from common.timing import LOST_S, MOVE_WAIT_S, SPARE_HOLD_S
from launch import rendezvous
from launch.ledger import Ledger
from launch.liveness import Liveness
from launch.recovery.events import Silence
from launch.recovery.store import StoreQuestions
from launch.spares import SpareDoor

log = logging.getLogger(__name__)


class Membership:
    """Where this node meets the others and who of its group still answers. The supervisor calls `meet` for
    each endpoint it meets at, `watch` once the store is known, `joined` for each group started, and asks
    `cut_off`, `silence` and `note_spare`."""

    def __init__(self, endpoints: list[str], ledger: Ledger, multi_node: bool, silence_s: float = LOST_S) -> None:
        self.endpoints, self.ledger, self.multi_node = endpoints or [""], ledger, multi_node
        self.silence_s = silence_s  # a node, or the store, not heard for this long is lost (fault.node_silence_s)
        self.endpoint = "127.0.0.1"  # the rendezvous endpoint in use
        self.at = 0  # its index in the list
        self.liveness: Liveness | None = None
        self._spare_since: float | None = None  # since when this node waits as a spare (None: it does not)
        self._store = StoreQuestions()
        self.door: SpareDoor | None = None  # this spare's way into a running group in a lost node's place

    @property
    def last_endpoint(self) -> bool:
        """Whether the endpoint in use is the last of the list: nobody can move on from it."""
        return self.at + 1 >= len(self.endpoints)

    def meet(self, at: int) -> str:
        """Meet at the `at`-th endpoint; returns it ('' alone). Past the first, waits for its store to listen
        (RendezvousConnectionError after MOVE_WAIT_S)."""
        self.at, endpoint = at, self.endpoints[at]
        self.endpoint = endpoint or "127.0.0.1"
        if at:
            _wait_for_store(endpoint, MOVE_WAIT_S)
        return endpoint

    def move_down(self) -> None:
        """The store at the endpoint in use is lost with its node: go on at the next one."""
        listed = self.endpoints
        log.info(f"the rendezvous endpoint {listed[self.at]} stopped answering (the node hosting it is lost, or "
                 f"this one cut off): moving to {listed[self.at + 1]}, the next one of --rdzv-endpoint")
        self.ledger.event("rendezvous_lost", endpoint=listed[self.at], next=listed[self.at + 1])

    def watch(self, store_at: str) -> None:
        """Start hearing the other nodes through the store at `store_at` (several nodes only)."""
        if self.multi_node:
            self.liveness = Liveness(store_at, self.ledger.node, lost_s=self.silence_s).start()

    def stop(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
        if self.door is not None:
            self.door.close()

    def door_for(self, spec, store_at: str, in_process: bool) -> SpareDoor | None:
        """The door a spare of this node would take into a running group, in process, in a lost node's place
        (several nodes, in-process recovery, a coordination store); opened once this node waits as a spare."""
        if self.door is not None:
            self.door.close()
        self.door = None
        if self.multi_node and in_process and store_at:
            self.door = SpareDoor(store_at, spec.rdzv_handler.get_run_id(), self.ledger.node, spec.local_world_size,
                                  hold_s=self.silence_s + SPARE_HOLD_S)
        return self.door

    def joined(self, agent, generation: int = 0) -> None:
        """Watch the nodes of the group just started (or of the world it went on in after a lost node); a spare
        joining says so (in process: in a lost node's place, in that recovery's generation)."""
        claim = agent.spare_claim if generation == 0 else None
        generation = claim["generation"] if claim else generation
        if self.liveness is not None and (group := agent.group()) is not None:
            name, rank, size = group
            self.liveness.join(f"{name}/g{generation}", rank, size)
        if (generation == 0 or claim) and self._spare_since is not None:
            waited, self._spare_since = time.time() - self._spare_since, None
            how = f" in process, as rank(s) {claim['ranks']} of generation {generation}" if claim else ""
            log.info(f"this spare joins the job{how} after waiting {waited:.1f}s")
            self.ledger.event("spare_joined", waited_s=round(waited, 1), in_process=bool(claim),
                              **({"generation": generation, "ranks": claim["ranks"]} if claim else {}))

    def note_spare(self, agent) -> None:
        """Between groups: say that this node waits as a spare, once each time it does (at the start, or left out
        of a round after a restart; its door opens from torch's join loop, launch.rounds.claimable)."""
        if self._spare_since is None and agent.waiting_as_spare():
            self._spare_since = time.time()
            how = "in process, in the place of the next node lost" if agent.door else "at the next rendezvous"
            log.info(f"the job has its --nnodes MAX nodes: this node waits as a spare (its fork server ready) and "
                     f"joins {how}")
            self.ledger.event("spare_waiting", endpoint=self.endpoint, in_process=agent.door is not None)

    def cut_off(self) -> RendezvousConnectionError | None:
        """The store has not answered for `silence_s`: the error that ends this meeting as a lost store (the
        caller stops the ranks here); None while it answers."""
        quiet = self.liveness.cut_off() if self.liveness is not None else 0.0
        if not quiet:
            return None
        log.info(f"the rendezvous store at {self.endpoint} has not answered for {quiet:.0f}s: this node is cut "
                 f"off from it, or its node is lost; stopping the ranks here")
        self.ledger.event("partition", cut_off=self.ledger.node, endpoint=self.endpoint, quiet_s=round(quiet, 1))
        return RendezvousConnectionError(f"the rendezvous store at {self.endpoint} did not answer for {quiet:.0f}s")

    def handled(self, agent, generation: int, unknown: bool = True) -> bool:
        """Whether another node's launcher said it handles the failure before `generation` (its node lives);
        `unknown` when the store cannot be asked."""
        return self._store.handled(agent, generation, self.liveness, unknown)

    def left_behind(self, agent, generation: int) -> bool:
        """Whether the other nodes went on without this one in a smaller world of `generation`."""
        return self._store.left_behind(agent, generation, self.liveness)

    def silence(self, agent) -> Silence | None:
        """The nodes of the running group that stopped answering while the store answers; None when none."""
        silent = self.liveness.silent() if self.liveness is not None else []
        group = agent.group() if silent else None
        if group is None:
            return None
        return Silence(silent=tuple(silent), group_size=group[2], last_endpoint=self.last_endpoint,
                       last_heard=self.liveness.last_heard(silent), lost_s=self.liveness.lost_s)


def _wait_for_store(endpoint: str, timeout_s: float) -> None:
    """Wait until something listens at `endpoint` (the node moving there first hosts it); a node that can
    bind the address hosts it itself and does not wait. RendezvousConnectionError after `timeout_s`."""
    host, _ = parse_rendezvous_endpoint(endpoint, default_port=rendezvous.DEFAULT_PORT)
    if rendezvous.local_address(host) is not None:
        return
    if not wait_until(lambda: rendezvous.listening(endpoint, 1.0), timeout_s, interval_s=0.2):
        raise RendezvousConnectionError(f"no rendezvous store at {endpoint} within {timeout_s:.0f}s")
