"""What torchrun's agent with the supervisor's hooks (launch.agent) shares with the supervisor: the hooks it
calls (`Hooks`), what it reports of the running group (`GroupStatus`), its part in a move down the endpoint
list (`Move`), and the exceptions that end its thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from launch.failures import RankExit


@dataclass(frozen=True)
class GroupStatus:
    """The running worker group as the agent sees it at one monitor interval."""

    state: str  # healthy | failed | succeeded (torchelastic's WorkerState, lower case)
    exits: dict[int, RankExit] = field(default_factory=dict)  # failed ranks by global rank (state failed)
    victims: frozenset[int] = frozenset()  # local ranks still alive when the group was torn down


class Hooks(Protocol):
    """What the agent asks of the supervisor. Called on the agent's thread."""

    def signalled(self) -> bool:
        """A signal asked this node to stop: close ranks gently, start no new group."""

    def hard_stop(self) -> bool:
        """A second signal: stop waiting for the ranks."""

    def before_start(self, attempt: int) -> None:
        """A worker group with restart count `attempt` is about to start."""

    def after_start(self, attempt: int, pids: dict[int, int]) -> None:
        """It started: local rank -> pid."""

    def before_restart(self, attempt: int, membership: bool) -> float:
        """The old group is stopped (after a failure, or for a `membership` change); returns the
        seconds to back off before the rendezvous."""

    def review(self, status: GroupStatus) -> bool:
        """Every monitor interval; True declares a running group unhealthy (it is restarted)."""

    def group_left(self, nodes: list[str]) -> bool:
        """`nodes` of the running group left it to meet again (their launcher restarted it: a failure there)
        while the ranks here still run: True restarts the group here too, as a failure; False stops (the
        restart policy says so)."""

    def keep_ranks_on_store_loss(self) -> bool:
        """The store was lost while the group runs: True keeps the ranks for the next endpoint's agent (`adopt`)."""

    def replace_failed(self, exits: dict[int, RankExit]) -> dict[str, str] | None:
        """Ranks of the running group failed (`exits`, by global rank) while the others still run: the
        environment to start their replacements with (in-process recovery: only they restart), or None
        to let torchelastic stop and restart the whole group."""


class Stopping(Exception):
    """Raised on the agent's thread when a signal arrived between worker groups: start nothing more."""


@dataclass
class Move:
    """An agent's part in a move down the endpoint list: it handed its ranks to the next endpoint's agent (and
    why), or adopted another agent's (when; `pending` until its first look skips starting them)."""

    handed_over: bool = False
    store_error: BaseException | None = None
    adopted_at: float | None = None
    pending: bool = False
    coord_store: str = ""  # the ranks' store (host:port) its rendezvous set, before any move


class HandedOver(Exception):
    """Raised on the agent's thread once its ranks went to the next endpoint's agent: it touches them no more."""


class NoRestartLeft(Exception):
    """Raised on the agent's thread when the group broke and the restart policy says stop."""
