"""Spares that join a running job in process. A spare node's launcher waits in the rendezvous's redundancy
list (the job has its --nnodes MAX nodes) and registers on the ranks' coordination store (`SpareDoor`).
When a node of the job is lost, a surviving node's launcher claims it (`claim`) and publishes it as the
recovery's world (trainer.recovery.regroup.publish_spare). The spare's agent then leaves the redundancy list
(launch.rounds.claimable) and starts the lost node's ranks in that generation, with their global ranks and
the world size unchanged: they join as replacements and restore the lost node's state from its peer copies,
so the run stays bit-identical to an uninterrupted one.

Keys, under the job's prefix on the store (group `spares`):

    count        how many spares ever registered (each takes the next index)
    <i>          the spare's node and ranks per node (json)
    <i>/claim    the claim (json; "" once released), written by the one launcher that claims it
    <i>/ack      the spare saw the claim (its launcher lives)
    <i>/gone     the spare left (it joined a group, or ended), or did not answer a claim

A claim stands only when the world published for its generation names it: a launcher that lost the race to
publish releases its claim, and the spare waits again."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

from common.clock import wait_until
from common.net import listening_at
from common.timing import SPARE_ACK_S, SPARE_CONFIRM_S, SPARE_POLL_S, STORE_ASK_S, STORE_PROBE_S
from trainer.contract import coordination_store, published_world

log = logging.getLogger(__name__)

GROUP = "spares"
COUNT = "count"


def _claim_key(index: int) -> str:
    return f"{index}/claim"


def _text(claim: dict) -> str:
    return json.dumps(claim, sort_keys=True)


class SpareDoor:
    """A spare's side: `open` registers it (whenever it waits in the redundancy list) and watches for a claim
    on a thread of its own; the agent's thread, in torch's join loop, asks `claimed`, `wait` and `hold`, then
    `take`s the claim. `leave` (it joined a group through a rendezvous) and `close` (it ended) say it left: a
    registration lasts as long as its node waits as a spare, and the next wait registers it afresh."""

    def __init__(self, where: str, run_id: str, node: str, nproc: int, hold_s: float = 0.0) -> None:
        self.where, self.run_id, self.node, self.nproc = where, run_id, node, nproc
        self.hold_s = hold_s  # how long it stays a spare once a node of the running round is gone (`hold`)
        self._held_since: float | None = None
        self.index: int | None = None
        self._broken = False  # the store did not answer a registration: `open` tries no more
        self.joined: dict | None = None  # the claim its agent's running group started on (launch.agent)
        self._claim: dict | None = None
        self._claimed = threading.Event()
        self._stop = threading.Event()  # of the current registration (each `open` its own)
        self._stop.set()

    @property
    def is_open(self) -> bool:
        return self.index is not None and not self._stop.is_set()

    def open(self) -> None:
        """Register on the store, under a new index, and watch for a claim; nothing while registered (best
        effort: a store that does not answer leaves this node a spare of the old kind, which joins at the next
        rendezvous)."""
        if self.is_open or self._broken:
            return
        try:
            store = coordination_store(self.where, self.run_id, GROUP, STORE_ASK_S)
            index = store.add(COUNT, 1) - 1
            store.set(str(index), json.dumps({"node": self.node, "nproc": self.nproc}))
        except Exception as e:  # noqa: BLE001
            log.info(f"cannot register as an in-process spare ({type(e).__name__}: {e}): joining at the next "
                     f"rendezvous only")
            self._broken = True
            return
        self.index, self._stop = index, threading.Event()
        threading.Thread(target=self._watch, args=(store, index, self._stop), name="spare-door", daemon=True).start()

    def claimed(self) -> bool:
        return self._claimed.is_set()

    def hold(self) -> bool:
        """Whether to stay in the redundancy list though a node of the running round is gone: torch would move
        this spare to the wait list, and the survivors would drain and restart with it. For `hold_s` (the
        silence bound and a margin) the survivors may claim it in process instead."""
        now = time.monotonic()
        self._held_since = self._held_since or now
        return now - self._held_since < self.hold_s

    def unhold(self) -> None:
        """The running round is whole again: the next gone node gets its `hold_s` afresh."""
        self._held_since = None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a claim that stands; whether one came."""
        return self._claimed.wait(timeout_s)

    def standing(self) -> dict | None:
        """The claim that stands, not taken yet."""
        return self._claim

    def take(self) -> dict | None:
        """The claim that stands, once (the spare joins with it: it is a spare no more; said on the store on a
        thread of its own, off the way to the ranks' start)."""
        claim = self._claim
        self.leave()
        return claim

    def leave(self) -> None:
        """It joined a group: a spare no more until `open` registers it again (said on the store on a thread of
        its own, off the way to the ranks' start; a claim that comes meanwhile finds it gone)."""
        self._claim = None
        self._claimed.clear()
        if self.is_open:
            self._stop.set()
            threading.Thread(target=self._say_gone, args=(self.index,), name="spare-gone", daemon=True).start()

    def close(self) -> None:
        """Stop watching and say that this spare left (best effort)."""
        if self.is_open:
            self._stop.set()
            self._say_gone(self.index)

    def _say_gone(self, index: int) -> None:
        if not listening_at(self.where, STORE_PROBE_S):  # its host ended (a connection would print C++ frames)
            return
        with contextlib.suppress(Exception):
            coordination_store(self.where, self.run_id, GROUP, STORE_ASK_S).set(f"{index}/gone", "left")

    def _watch(self, store, index: int, stop: threading.Event) -> None:
        """Acknowledge a claim of registration `index` at once, and let it stand once the world of its
        generation names this spare; until `stop`."""
        key, rounds, since = _claim_key(index), {}, None
        while not stop.wait(SPARE_POLL_S):
            try:
                value = store.get(key) if store.check([key]) else b""
                if not value:
                    if since is not None:  # released: its launcher published another world
                        store.delete_key(f"{index}/ack")
                    since = None
                    continue
                claim = json.loads(value)
                if since is None:
                    store.set(f"{index}/ack", "1")
                    since = time.monotonic()
                where = claim["round"]
                rounds.setdefault(where, coordination_store(self.where, self.run_id, where, STORE_ASK_S))
                world = published_world(rounds[where], claim["generation"])
                if world is not None and world.get("spare", {}).get("index") == index:
                    self._claim = claim
                    self._claimed.set()
                    return
                if world is not None:  # another world stood: its claimant releases it, or this spare does
                    store.compare_set(key, value.decode(), "")
                elif time.monotonic() - since > SPARE_CONFIRM_S:
                    since = None  # never published: wait for the next claim
            except Exception as e:  # noqa: BLE001 - the store is gone: no claim can come
                first = (str(e).splitlines() or [""])[0]
                log.info(f"the spare's watch on the store ended: {type(e).__name__}: {first}")
                return


def claim(where: str, run_id: str, place: dict) -> dict | None:
    """Claim a registered spare for the lost node `place` (its ranks and where they belong; see
    launch.agent.SupervisedAgent.place_of): the first spare, running as many ranks per node, not claimed yet and
    whose launcher acknowledges within SPARE_ACK_S. Returns the claim (`place` with the spare's index and node),
    or None when no spare answers."""
    store = coordination_store(where, run_id, GROUP, STORE_ASK_S)
    for index in range(store.add(COUNT, 0)):
        if store.check([f"{index}/gone"]) or not store.check([str(index)]):
            continue
        registered = json.loads(store.get(str(index)))
        if registered["nproc"] != place["nproc"]:
            continue
        mine = {**place, "index": index, "spare": registered["node"]}
        if store.compare_set(_claim_key(index), "", _text(mine)).decode() != _text(mine):
            continue  # claimed by another launcher
        if wait_until(lambda i=index: store.check([f"{i}/ack"]), SPARE_ACK_S, 0.01):
            return mine
        store.set(f"{index}/gone", "no answer")
        release(where, run_id, mine)
    return None


def release(where: str, run_id: str, mine: dict) -> None:
    """Give back a claim that does not stand (another world was published first): the spare waits again."""
    with contextlib.suppress(Exception):
        store = coordination_store(where, run_id, GROUP, STORE_ASK_S)
        store.compare_set(_claim_key(mine["index"]), _text(mine), "")
