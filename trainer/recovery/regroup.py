"""In-process recovery's process groups: leave the groups of a failed generation, and form every one of
them again for the next generation under the same names.

Why this shape:
- Re-forming destroys every group and forms it again: the default group as `init_process_group` forms
  it, the others with `new_group`, in their first creation order, on a fresh store prefix per
  generation. torch resets its group counter when the default group is destroyed (for exactly this
  case), so each group gets its old name back: DeviceMesh and DTensor's collectives, which find groups
  by name, follow at once; the few objects that hold a group itself are given the new one
  (`trainer.recovery.inplace.rebind`, with FSDP2's in `trainer.distributed.torch_compat`). Registering a fresh
  backend on the old `ProcessGroup` objects does not work: torch keeps a group's first backend of a
  type (re-registration is a no-op on 2.13), so collectives would still run on the dead connections.
- Leaving: NCCL backends abort (`Backend.abort`, public). Gloo cannot abort a collective that is
  blocked in a read (its `abort` and `shutdown` return and the read stays blocked, measured on torch
  2.13), and a survivor blocked on another survivor never hears from the dead rank. So a rank leaves by
  shutting down its own gloo connections (the TCP sockets this module saw the groups open): its peers'
  reads fail at once, they leave in turn, and the failure reaches every rank in a few milliseconds.
- A lost node (`--nnodes MIN:MAX`): the launcher publishes a smaller world for the generation instead of
  waiting for replacements (`publish_smaller_world`); its survivors form the default group at their new
  ranks (`reform_smaller`) and build the rest of the run again (trainer.recovery.inplace).
- The store is the launcher's (the rendezvous store, `COORD_STORE_ENV`): it outlives any rank, rank
  0 included. Its keys and their layout are trainer.recovery.keys.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from common import net
from common.clock import wait_until
from common.timing import NOTICE_GRACE_S, POLL_S, STORE_PROBE_S, STUCK_S, WATCH_S, WATCH_STORE_S
from trainer.recovery import keys
from trainer.runtime import protocol
from trainer.runtime.protocol import COORD_STORE_ENV, HEARTBEAT_DIR_ENV, worker_group

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


class RejoinFailed(RuntimeError):
    """The ranks did not all come back within the bound: the launcher falls back to a full restart."""


@dataclass(frozen=True)
class SmallerWorld:
    """A generation that goes on without the ranks of a lost node: this rank's new rank and the new size."""

    rank: int
    world: int


def publish_smaller_world(store: dist.Store, generation: int, survivors: list[int]) -> dict[int, int]:
    """The launcher's side: the ranks of `survivors` go on as ranks 0..n-1 (in their order) in
    `generation`, unless another node's launcher published its world for `generation` first (one atomic
    compare-and-set: the survivors on every node meet in the same world). Returns the world that stands,
    old rank -> new rank; {} when what stands is a spare taking the lost node's place (`publish_spare`)."""
    ranks = {old: new for new, old in enumerate(sorted(survivors))}
    return _world(store.compare_set(keys.world_key(generation), "", json.dumps({"ranks": ranks})))


def publish_spare(store: dist.Store, generation: int, claim: dict) -> dict:
    """The launcher's side: a spare node (`claim`, launch.spares) starts the lost node's ranks in `generation`,
    the world the same, unless another launcher published a world for `generation` first (the same
    compare-and-set as `publish_smaller_world`). Returns what stands: {"spare": claim} or {"ranks": ...}."""
    return json.loads(store.compare_set(keys.world_key(generation), "", json.dumps({"spare": claim})))


def published_world(store: dist.Store, generation: int) -> dict | None:
    """What stands for `generation` ({"ranks": ...}: a smaller world; {"spare": ...}: a spare's ranks replace
    the lost ones), or None."""
    key = keys.world_key(generation)
    return json.loads(store.get(key)) if store.check([key]) else None


def _world(value: bytes | str) -> dict[int, int]:
    return {int(old): new for old, new in json.loads(value).get("ranks", {}).items()}


def smaller_world_published(store: dist.Store, generation: int) -> bool:
    """Whether a smaller world of `generation` was published (the launcher's side: the nodes that answered went
    on without the others)."""
    return store.check([keys.world_key(generation)])


def announce_failure(store: dist.Store, generation: int, by: str = "launcher", handled: bool = False) -> None:
    """A rank died and `generation` starts (said `by` the launcher, or by a rank that noticed): a rank that has
    not noticed leaves (its watch thread, `Regroup._watch`). `handled`: said by the failed ranks' launcher,
    which replaces them or restarts its group: their node lives (`failure_handled`)."""
    if handled:
        store.set(keys.handled_key(generation), by)
    store.set(keys.failed_key(generation), by)


def failure_handled(store: dist.Store, generation: int) -> bool:
    """Whether the launcher of the ranks that failed before `generation` said it handles their failure (the
    launchers' side: their node is not lost)."""
    return store.check([keys.handled_key(generation)])


def arrived_ranks(store: dist.Store, generation: int, world: int) -> list[int]:
    """The ranks that announced themselves for `generation` (the launcher's side)."""
    return [r for r in range(world) if store.check([keys.arrived_key(generation, r)])]


def coordination_store(where: str, run_id: str, group: str, timeout_s: float) -> dist.Store:
    """The store the ranks of one worker group (`group`: its rendezvous round, `protocol.worker_group`)
    coordinate on, at `where` (host:port)."""
    host, _, port = where.rpartition(":")
    client = dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s))
    return dist.PrefixStore(keys.store_prefix(run_id, group), client)


def _open_sockets() -> dict[str, int]:
    """inode -> one fd of each open socket of this process."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.setdefault(target, int(fd))
    return found


@dataclass(frozen=True)
class StoreHome:
    """Where the ranks' coordination store is: `where` (host:port), the job's rendezvous id, the name their
    keys live under (`group`), and the launcher's heartbeat directory, where it says when the store moved
    (its node was lost: trainer.runtime.protocol.read_store_moved)."""

    where: str
    run_id: str
    group: str
    directory: str = ""

    def moved(self) -> tuple[str, str] | None:
        """(store, group) the launcher moved the store to, when that is not here; None otherwise."""
        return protocol.read_store_moved(self.directory, self.where, self.group) if self.directory else None

    def listens(self) -> bool:
        return net.listening_at(self.where, STORE_PROBE_S)


@dataclass
class Regroup:
    """One rank's handle on in-process recovery (None of it applies at world size 1)."""

    store: dist.Store  # the launcher's store, under this worker group's prefix
    rank: int
    world: int
    generation: int = 0
    timeout_s: float = 60.0
    skip_ports: set[int] = field(default_factory=set)  # store connections are not the groups'
    home: StoreHome | None = None  # where `store` is (None: this rank cannot follow a move)
    _sockets: set[str] = field(default_factory=set)  # the current generation's group connections
    _recovering: bool = False  # this rank's own recovery (trainer.recovery.inplace) has begun
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the watch thread's leave() against it

    @classmethod
    def from_env(cls, rank: int, world: int, timeout_s: float) -> Regroup | None:
        """The handle when the launcher offers in-process recovery (None otherwise)."""
        where = os.environ.get(COORD_STORE_ENV, "")
        if not where or world < 2:
            return None
        home = StoreHome(where, os.environ.get(RUN_ID_ENV, ""), worker_group(), os.environ.get(HEARTBEAT_DIR_ENV, ""))
        store = coordination_store(where, home.run_id, home.group, timeout_s)
        skip = {int(where.rpartition(":")[2]), int(os.environ.get("MASTER_PORT", "0") or 0)}
        regroup = cls(store, rank, world, protocol.generation(), timeout_s, skip, home)
        watch_store = coordination_store(where, home.run_id, home.group, WATCH_STORE_S)  # the thread's own
        threading.Thread(target=regroup._watch, args=(watch_store,), name="regroup-watch", daemon=True).start()
        return regroup

    # ------------------------------------------------------------------ the store moving
    def follow_move(self, wait_s: float = 0.0) -> bool:
        """Use the store the launcher moved to (the node hosting the old one was lost with it), waiting up to
        `wait_s` for the launcher to say where; False when it said nothing."""
        home, said = self.home, []

        def moved() -> bool:
            said[:] = [home.moved()]
            return said[0] is not None

        if home is None or not wait_until(moved, wait_s, POLL_S):
            return False
        where, group = said[0]
        self.store = coordination_store(where, home.run_id, group, self.timeout_s)
        self.skip_ports.add(int(where.rpartition(":")[2]))
        self.home = StoreHome(where, home.run_id, group, home.directory)
        sys.stderr.write(f"[rekindle] rank {self.rank}: the coordination store moved to {where} (the node hosting "
                         f"the previous one was lost)\n")
        return True

    # ------------------------------------------------------------------ noticing a failure
    def noticed(self, generation: int) -> None:
        """This rank's recovery towards `generation` begins: say so to the ranks that have not noticed (the
        watch thread of each), and stop this rank's own watch thread from leaving on its behalf."""
        with self._lock:
            self._recovering = True
        announce_failure(self.store, generation, by=str(self.rank))

    def _watch(self, store: dist.Store | None) -> None:
        """The watch thread: another rank noticed a failure, or the launcher said the store moved (its node was
        lost, maybe without a word: no collective fails then), and this rank, NOTICE_GRACE_S later, has not
        noticed (gloo fails only the operations of the connection that broke: a rank blocked in a receive from
        a survivor can wait for the group's timeout): leave the generation here, once, which fails that
        receive. Still not recovering STUCK_S later: end this rank (exit 1) for its launcher to restart. Its
        store connection is its own, with a short timeout, made again only to a store that listens."""
        left: tuple[int, float] | None = None  # (the generation left for, when)
        at = self.home
        while True:
            time.sleep(WATCH_S)
            generation = self.generation + 1
            if left is not None and left[0] == generation:
                if not self._recovering and time.monotonic() - left[1] > STUCK_S:
                    from trainer.runtime.fault import stop_now

                    stop_now(f"rank {self.rank} left generation {generation - 1} {STUCK_S:.0f}s ago and its "
                             f"collective still has not failed (blocked where no error reaches it): ending this "
                             f"rank, for its launcher to start it again", 1)
                continue
            home = self.home
            if home is not None and home.moved() is not None:
                why = f"the coordination store moved (its node was lost) during generation {generation - 1}"
            else:
                if store is None or at != home:
                    if home is None or not home.listens():
                        continue
                    store, at = coordination_store(home.where, home.run_id, home.group, WATCH_STORE_S), home
                try:
                    if not store.check([keys.failed_key(generation)]):
                        continue
                except dist.DistError:  # the store is gone, or slow: asked again once it listens
                    store = None
                    continue
                why = f"another rank noticed the failure of generation {generation - 1}"
            time.sleep(NOTICE_GRACE_S)
            with self._lock:
                if not self._recovering and self.generation + 1 == generation:
                    cut = self.leave()
                    left = (generation, time.monotonic())
                    sys.stderr.write(f"[rekindle] rank {self.rank}: {why}, and this one had not noticed: left it "
                                     f"({cut} connection(s) shut)\n")

    # ------------------------------------------------------------------ the groups' connections
    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Count the TCP connections opened meanwhile as the groups' (wrap group creation in it)."""
        before = set(_open_sockets())
        try:
            yield
        finally:
            self._sockets |= set(_open_sockets()) - before

    def group_store(self, generation: int | None = None) -> dist.Store:
        """The store the groups of `generation` (default: the current one) form on."""
        return dist.PrefixStore(keys.generation_prefix(self.generation if generation is None else generation),
                                self.store)

    def leave(self) -> int:
        """Stop this rank's part in the current generation: abort NCCL backends, shut down the gloo
        connections (a blocked peer's read fails at once). Returns the connections shut down."""
        for pg in _groups():
            if pg.size() > 1:
                backend = pg._get_backend(torch.device("cuda")) if torch.cuda.is_available() else None
                if backend is not None:
                    backend.abort()
        cut = 0
        for inode, fd in _open_sockets().items():
            if inode not in self._sockets:
                continue
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) \
                        and _port(sock.getpeername()) not in self.skip_ports \
                        and _port(sock.getsockname()) not in self.skip_ports:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:
                pass  # already closed by the peer's end
            finally:
                sock.close()
        self._sockets.clear()
        return cut

    # ------------------------------------------------------------------ the next generation
    def announce(self, generation: int, who: str) -> None:
        """Say that this rank is on its way to `generation` (`who`: survivor | replacement)."""
        self.store.set(keys.arrived_key(generation, self.rank), json.dumps({"who": who, "pid": os.getpid(),
                                                                          "t": time.time()}))

    def wait_for_all(self, generation: int,
                     stop: Callable[[], bool] = lambda: False) -> dict[int, dict] | SmallerWorld | None:
        """Every rank's arrival record for `generation`; the smaller world the launcher published instead
        (a node was lost); None as soon as `stop()` (a SIGTERM); RejoinFailed after `timeout_s`."""
        arrivals = [keys.arrived_key(generation, r) for r in range(self.world)]
        world_key = keys.world_key(generation)
        spare = [False]  # a spare's ranks take the lost ones' places: they are waited for, as replacements

        def smaller() -> bool:
            world = None if spare[0] else published_world(self.store, generation)
            if world is None:
                return False
            spare[0] = "spare" in world
            return not spare[0]

        if not wait_until(lambda: self.store.check(arrivals) or stop() or smaller(), self.timeout_s, POLL_S):
            missing = [r for r, k in enumerate(arrivals) if not self.store.check([k])]
            raise RejoinFailed(f"in-process recovery: rank(s) {missing} did not come back within "
                               f"{self.timeout_s:.0f}s")
        if self.store.check(arrivals):
            return {r: json.loads(v) for r, v in enumerate(self.store.multi_get(arrivals))}
        if stop():
            return None
        ranks = _world(self.store.get(world_key))
        if self.rank not in ranks:
            raise RejoinFailed(f"in-process recovery: rank {self.rank} is not in the smaller world {ranks}")
        return SmallerWorld(ranks[self.rank], len(ranks))

    def reform(self, generation: int) -> dict[dist.ProcessGroup, dist.ProcessGroup]:
        """Destroy this process's groups and form them again for `generation` on `group_store(generation)`:
        the default group as `init_process_group` forms it, then every other group with `new_group`, in
        the order they were first made (a replacement rank, started afresh, makes them in that order
        too). Destroying every group resets torch's group counter, so each group gets its old name back
        and anything that finds groups by name (DeviceMesh, DTensor's collectives) finds the new one.
        Returns old group -> new group, for the objects that hold a group (`trainer.recovery.inplace` rebinds them)."""
        self.generation = generation
        timeout = timedelta(seconds=self.timeout_s)
        old = [(pg, pg.group_name, dist.get_process_group_ranks(pg), str(dist.get_backend(pg))) for pg in _groups()]
        dist.destroy_process_group()
        with self.tracking():
            nccl = old[0][3] == "nccl"
            dist.init_process_group(old[0][3], store=self.group_store(generation), rank=self.rank,
                                    world_size=self.world, timeout=timeout,
                                    device_id=torch.device("cuda", torch.cuda.current_device()) if nccl else None)
            mapping = {old[0][0]: dist.group.WORLD}
            for pg, _, ranks, backend in old[1:]:
                mapping[pg] = dist.new_group(ranks, backend=backend, timeout=timeout)
        self._recovering = False
        renamed = [(name, new.group_name) for (pg, name, _, _), new in zip(old, mapping.values(), strict=True)
                   if new.group_name != name]
        if renamed:
            raise RejoinFailed(f"in-process recovery: re-formed groups got other names than before: {renamed}")
        return mapping

    def reform_smaller(self, generation: int, world: SmallerWorld, backend: str, device: torch.device) -> None:
        """Destroy this process's groups and form the default group of `generation` in the smaller world
        (this rank's new rank and size); the others are made again by whatever makes them (trainer.run.build)."""
        self.generation, self.rank, self.world, self._recovering = generation, world.rank, world.world, False
        dist.destroy_process_group()
        with self.tracking():
            dist.init_process_group(backend, store=self.group_store(generation), rank=world.rank,
                                    world_size=world.world, timeout=timedelta(seconds=self.timeout_s),
                                    device_id=device if backend == "nccl" else None)


def _port(address) -> int:
    return address[1] if isinstance(address, tuple) and len(address) > 1 else -1


def _groups() -> list[dist.ProcessGroup]:
    """Every process group of this process in creation order (the default one first): the order every
    rank forms them in (a backend's creation waits for its peers' addresses)."""
    return list(dist.distributed_c10d._world.pg_names)
