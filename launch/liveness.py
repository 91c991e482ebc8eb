"""Whether the launchers of a multi-node job still hear each other, through the rendezvous store: each
launcher counts up a key of its own there every `INTERVAL_S`, and reads the counters of the other
launchers of its worker group. Two verdicts, each after `lost_s` of silence (fault.node_silence_s; `LOST_S`
by default):

- `cut_off()`: this launcher's own store connection has not answered (a partition around this node, or
  the node hosting the store is lost). Its ranks sit in collectives that never end; the launcher stops
  them and moves down the endpoint list or exits 75 (launch.supervisor). The silence must also be seen
  for `CONFIRM_S`: a node that was paused (a frozen VM) wakes with an old last answer and gets a new one
  within a pass; the others, which went on without it meanwhile, take it back at the next rendezvous.
- `silent()`: the store answers, but the counter of another launcher of the group stopped (that node is
  cut off, or lost without a word). The ranks here wait in collectives with its ranks, which then fail
  only at the collective timeout: the launcher goes on without that node at once, or stops, as
  `goes_on` says (launch.nodes).

Why the store: it is the one place every node reaches, and torch's own keep-alives are private to its
rendezvous. A counter, not a timestamp: the nodes' clocks need not agree. The thread uses one
connection of its own with a short timeout and never reconnects: a store that stopped answering once is
treated as gone (reconnecting would print torch's C++ errors, with stack frames, on every try)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from common.timing import CONFIRM_S, INTERVAL_S, LOST_S

KEY = "rekindle/alive/{node}"
MEMBER_KEY = "rekindle/members/{group}/{rank}"  # group: the worker group's rendezvous round (SupervisedAgent.round)


def goes_on(live: int, size: int, last_endpoint: bool) -> bool:
    """Whether the `live` nodes of a group of `size` that still answer at the store go on without the
    silent ones: a strict majority does; exactly half does only at the last endpoint of the list (the
    silent half, cut off from it, has nowhere to move on to and exits 75); else this side stops, so that
    two sides of a partition never both train."""
    return live * 2 > size or (live * 2 == size and last_endpoint)


class Liveness:
    """One launcher's side: `start` on the rendezvous store at `where` (host:port), `join` each new worker
    group, ask `cut_off` and `silent`, `stop` at the end."""

    def __init__(self, where: str, node: str, interval_s: float = INTERVAL_S, lost_s: float = LOST_S) -> None:
        self.node, self.interval_s, self.lost_s = node, interval_s, lost_s
        self._lock = threading.Lock()
        self._group: tuple[str, int, int] | None = None  # (group id, this node's rank, group size)
        self._members: dict[int, str] = {}  # group rank -> node, as they appear
        self._heard: dict[str, tuple[str, float]] = {}  # node -> (its counter, when it last changed, our clock)
        self._answered = time.monotonic()  # the store's last answer
        self._quiet_seen: float | None = None  # when cut_off() first found the store quiet for lost_s
        self._last_asked = 0.0  # cut_off()'s last call
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(where,), name="liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, group: str, rank: int, size: int) -> None:
        """A new worker group (`group`: its rendezvous round, unique per meeting): watch its other nodes."""
        with self._lock:
            self._group, self._members = (group, rank, size), {}

    def cut_off(self) -> float:
        """Seconds the store has not answered, once that is `lost_s` or more and has stayed so for `CONFIRM_S`
        of this caller's asking (else 0). A process that was paused (a VM frozen for seconds, SIGSTOP) wakes
        with a stale last answer: its liveness thread gets a fresh one within a pass, before that."""
        now = time.monotonic()
        quiet = now - self._answered
        if quiet < self.lost_s:
            self._quiet_seen = None
            return 0.0
        if self._quiet_seen is None or now - self._last_asked > CONFIRM_S:  # not asked meanwhile: a pause
            self._quiet_seen = now
        self._last_asked = now
        return quiet if now - self._quiet_seen >= CONFIRM_S else 0.0

    def answering(self) -> bool:
        """Whether the store answered within two intervals: a new connection to it will not wait in vain."""
        return time.monotonic() - self._answered < 2 * self.interval_s

    def silent(self) -> list[str]:
        """The other nodes of the current group whose counter has not moved for `lost_s` (the store answering)."""
        now = time.monotonic()
        if now - self._answered > self.interval_s * 4:  # our own view is stale: no verdict on others
            return []
        with self._lock:
            return sorted(node for node in self._members.values() if node != self.node and node in self._heard
                          and now - self._heard[node][1] >= self.lost_s)

    def last_heard(self, nodes: list[str]) -> float:
        """When (wall clock) the newest of `nodes`' counters last moved, as this launcher heard it: the
        earliest their loss can have been noticed (now, when none was ever heard)."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            heard = [self._heard[node][1] for node in nodes if node in self._heard]
        return wall - (now - max(heard)) if heard else wall

    # ------------------------------------------------------------------ the thread
    def _run(self, where: str) -> None:
        host, _, port = where.rpartition(":")
        try:
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.interval_s * 4))
        except Exception:  # noqa: BLE001 - unreachable from the start: cut_off() says so in time
            return
        count = 0
        while not self._stop.wait(self.interval_s):
            try:
                count += 1
                store.set(KEY.format(node=self.node), str(count))
                self._register(store)
                self._listen(store)
            except Exception:  # noqa: BLE001 - a store that stopped answering: cut_off() says so in time
                return
            self._answered = time.monotonic()

    def _register(self, store: TCPStore) -> None:
        with self._lock:
            group = self._group
        if group is None:
            return
        name, rank, size = group
        store.set(MEMBER_KEY.format(group=name, rank=rank), self.node)
        found = {}
        for r in range(size):
            key = MEMBER_KEY.format(group=name, rank=r)
            if r not in self._members and store.check([key]):
                found[r] = store.get(key).decode()
        with self._lock:
            if self._group == group:
                self._members.update(found)

    def _listen(self, store: TCPStore) -> None:
        with self._lock:
            nodes = [n for n in self._members.values() if n != self.node]
        if not nodes:
            return
        for node in nodes:
            key = KEY.format(node=node)
            counter = store.get(key).decode() if store.check([key]) else ""
            if counter and self._heard.get(node, ("", 0.0))[0] != counter:
                self._heard[node] = (counter, time.monotonic())  # as read: a slow pass must not age it
