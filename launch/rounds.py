"""What the launcher reads of torch's private c10d rendezvous state (`handler._state_holder.state`): the
round just met and its nodes (`round_of`), which global ranks each node holds (`ranks_by_node`), and which
nodes of a round came back to meet again (`nodes_that_left`); the keep-alive of a lost store's
rendezvous, stopped (`stop_keep_alive`); and a spare's way out of torch's join loop when a launcher claims
it for a lost node, seated in its place (`claimable`, `SpareClaimed`, `spare_store`, `keep_seat`;
launch.spares). With launch.agent, the only code that
touches torchelastic's internals: when a torch release moves them, each reader falls back to what it can
still say."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainer.contract import rendezvous_actions


@dataclass(frozen=True)
class Round:
    """The rendezvous round the running worker group met in: its name, the same on every node (the ranks name
    their coordination store's keys after it), its nodes, and which global ranks each node holds ({}: not
    known, `ranks_by_node`)."""

    name: str = ""
    nodes: frozenset = frozenset()
    ranks: dict = field(default_factory=dict)

    @classmethod
    def met(cls, handler, group, world: int, per_node: int) -> Round:
        name, nodes = round_of(handler, group)
        return cls(name, nodes, ranks_by_node(handler, world, per_node))

    def nodes_of(self, ranks: Iterable[int]) -> int | None:
        """How many nodes hold a rank of `ranks` (None when not known)."""
        ranks = set(ranks)
        return sum(1 for held in self.ranks.values() if held & ranks) if self.ranks else None

    def renumbered(self, ranks: dict[int, int], this_node) -> Round:
        """The round once its group went on in a smaller world (old global rank -> new): the nodes that hold no
        rank any more are no longer of it (this one only, when which ranks each node holds is not known)."""
        kept = {node: frozenset(ranks[r] for r in held if r in ranks) for node, held in self.ranks.items()}
        kept = {node: held for node, held in kept.items() if held}
        return Round(self.name, (frozenset(kept) | {this_node}) & self.nodes, kept)

    def holdings(self) -> list[list[int]]:
        """Which global ranks each node holds, as plain data (a spare's claim carries it)."""
        return [sorted(held) for held in self.ranks.values()]

    @classmethod
    def joined(cls, name: str, holdings: list[list[int]]) -> Round:
        """The round a spare joins in a lost node's place, as its claimant knew it: which ranks each node holds,
        the nodes by number (their identities are not the spare's to know). With it the spare's launcher can
        tell a later lost node's ranks, and claim a spare for them."""
        return cls(name, frozenset(), {i: frozenset(held) for i, held in enumerate(holdings)})

    def moved(self, name: str) -> Round:
        """The same group under another name (its keys on the store the job moved to)."""
        return Round(name, self.nodes, self.ranks)


def round_of(handler, group) -> tuple[str, frozenset]:
    """(name, nodes) of the rendezvous round just met, from torch's private rendezvous state; when torch
    moved it, the group's store address (a fresh port each round: the launcher turns torch's sharing of
    the rendezvous store off) and no nodes."""
    try:
        state = handler._state_holder.state
        return f"r{state.round}", frozenset(state.participants)
    except AttributeError:
        return f"{group.master_addr}:{group.master_port}", frozenset()


def ranks_by_node(handler, world: int, per_node: int) -> dict:
    """The nodes of the round just met -> their global ranks, from torch's private rendezvous state: a node
    of group rank g holds ranks g*n..g*n+n-1 when every node runs n ranks (torchelastic numbers them so);
    {} when the nodes run different numbers of ranks, or torch moved its state."""
    try:
        participants = handler._state_holder.state.participants
    except AttributeError:
        return {}
    if per_node * len(participants) != world:
        return {}
    return {node: frozenset(range(g * per_node, (g + 1) * per_node)) for node, g in participants.items()}


def nodes_that_left(handler, round_nodes: frozenset) -> list[str]:
    """Nodes of a round (`round_nodes`, from `round_of`) now waiting to meet again: their launcher restarted
    the group. From torch's private rendezvous state as the handler's last sync left it (`num_nodes_waiting`
    syncs); [] when torch moved it."""
    try:
        state = handler._state_holder.state
        left = (set(state.wait_list) | set(state.redundancy_list)) & round_nodes
    except AttributeError:
        return []
    return sorted(f"{node.addr}:{node.pid}" for node in left)


def stop_keep_alive(handler) -> None:
    """Stop the keep-alive thread of a rendezvous whose store was lost (it would warn every second for the rest
    of the run that the store does not answer); nothing when torch moved it. On a thread of its own: torch
    joins the keep-alive thread, which may be blocked in a call to a store that no longer answers."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if stop is not None:
        threading.Thread(target=stop, name="stop-keep-alive", daemon=True).start()


class SpareClaimed(Exception):
    """Raised in torch's join loop on a spare's agent thread: it left the redundancy list, claimed for a lost
    node's place (launch.spares)."""


def claimable(handler, door=None) -> None:
    """Wrap torch's rendezvous join loop: nodes left in the wait list of a round that filled without them are
    made spares (every job). With a `door` (launch.spares.SpareDoor), a claim takes this node out of the loop:
    it takes the lost node's seat in the round (`_Claimable._seat`) and `SpareClaimed` is raised. While it waits
    as a spare, torch's one-second pauses between looks are cut short by a claim, and when a node of the
    running round is gone it stays in the redundancy list for a while (`SpareDoor.hold`) instead of moving to
    the wait list. Nothing when torch moved its internals (a spare then joins at the next rendezvous only)."""
    try:
        actions, inner = rendezvous_actions(), handler._op_executor
    except (ImportError, AttributeError):
        return
    handler._op_executor = _Claimable(inner, door, actions)


class _Claimable:
    """torch's rendezvous operation executor, its state handlers asked about the door first."""

    def __init__(self, inner, door, actions) -> None:
        self._inner, self._door, self._actions = inner, door, actions

    def run(self, state_handler, deadline, update_deadline=None):
        return self._inner.run(self._wrap(state_handler), deadline, update_deadline)

    def _wrap(self, state_handler):
        actions, door = self._actions, self._door

        def handle(ctx, deadline):
            state = ctx.state
            if door is not None and door.claimed():
                return self._seat(ctx)
            if state.complete and state.wait_list and len(state.participants) >= ctx.settings.max_nodes:
                # Nodes left waiting for a round that filled without them (more nodes than MAX met after a
                # restart): torch would leave them in the wait list, where the running groups see a node waiting
                # and restart to let it in, and again, for ever. They are spares.
                state.redundancy_list |= state.wait_list
                state.wait_list.clear()
                return actions.KEEP_ALIVE
            action = state_handler(ctx, deadline)
            if door is None or ctx.node not in state.redundancy_list:
                return action
            door.open()  # (a no-op while registered; at once, not at the supervisor's next look, or torch would
            #              pause a second first)
            if not door.is_open:
                return action
            if action == actions.SYNC:  # the round is full: torch would pause a second
                door.unhold()
            elif not (action == actions.REMOVE_FROM_REDUNDANCY_LIST and state.complete and door.hold()):
                return action
            # Wait for a claim instead of torch's pause; or, a node of the running round gone (its keep-alive
            # expired), instead of moving to the wait list, which would restart the survivors' group: they may
            # claim this spare in process first. Then keep alive, as torch would.
            return self._seat(ctx) if door.wait(1.0) else actions.KEEP_ALIVE

        return handle

    def _seat(self, ctx):
        """Take the lost node's seat among the round's participants (its group rank), so that torch counts the
        round whole again (a node started later is a spare, not a node joining), and keep alive: the executor
        writes the state (and, when another node wrote first, reads it and asks again). Once seated, or when
        the round moved on, `SpareClaimed` ends the join loop."""
        state, claim = ctx.state, self._door.standing()
        if ctx.node in state.participants or f"r{state.round}" != claim["round"]:
            raise SpareClaimed("claimed for a lost node's place")
        for node in [n for n, rank in state.participants.items() if rank == claim["group_rank"]]:
            del state.participants[node]
            state.last_heartbeats.pop(node, None)
        state.redundancy_list.discard(ctx.node)
        state.wait_list.discard(ctx.node)
        state.participants[ctx.node] = claim["group_rank"]
        return self._actions.KEEP_ALIVE


def keep_seat(handler) -> None:
    """A spare seated in a lost node's place keeps its seat alive, as a node that met in the round does."""
    start = getattr(handler, "_start_heartbeats", None)
    if start is not None:
        start()


def spare_store(handler, name: str):
    """The store of rendezvous round `name` (its exit barrier's) for a spare taking a lost node's place in it;
    None when the handler's last look is of another round, or torch moved its internals."""
    try:
        if f"r{handler._state_holder.state.round}" != name:
            return None
        return handler._get_store()
    except AttributeError:
        return None
