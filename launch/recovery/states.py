"""The recovery coordinator's states (launch.recovery.coordinator), and the mode that says which recoveries
a node's launcher may make. Plain data: only the coordinator creates and changes them.

    Idle -> Pending(generation) -> Idle (settled) | a full restart (fell back)
    (Pending is `followed` on the other nodes of a multi-node job: the recovery another node leads)
    HangKilled: a hung rank killed alone, its exit on the way; Recorded: the policy stopped an in-process
    recovery, its failure recorded; Told (beside them): the ranks here told to go on without silent nodes
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launch.failures import Failure


@dataclass(frozen=True)
class Mode:
    """What this node's launcher may do: replace failed ranks in process (`in_process`, on any number of
    nodes), send a lost node's survivors on in a smaller world (`smaller`: --nnodes MIN:MAX), down to
    `min_nodes`."""

    in_process: bool
    single_node: bool
    smaller: bool = False
    min_nodes: int = 1

    @property
    def uses_store(self) -> bool:
        """Whether the ranks need the coordination store (either kind of in-process recovery)."""
        return self.in_process or self.smaller


@dataclass(frozen=True, slots=True)
class Idle:
    """No recovery under way."""


@dataclass(slots=True)
class Pending:
    """A recovery under way: its generation, when its failure was noticed, the ranks replaced, the survivors
    on this node (local rank -> pid), the failed ranks' trainer pids (their heartbeats are stale), the ranks
    of a lost node (the world got smaller; or a `spare` started them), the survivors killed for never noticing
    the failure, whether
    another node's launcher leads it (`followed`: its rank failed; the ranks here all survive), and whether a
    second failure made it give way (`fell_back`)."""

    generation: int
    noticed: float
    replaced: list[int]
    kept: dict[int, int] = field(default_factory=dict)
    dead_pids: frozenset[int] = frozenset()
    lost: list[int] = field(default_factory=list)
    unaware: set[int] = field(default_factory=set)
    followed: bool = False
    fell_back: bool = False  # a second failure made it give way to a full restart (said once)
    spare: str = ""  # the spare node that started the lost node's ranks (the world kept its size)


@dataclass(frozen=True, slots=True)
class HangKilled:
    """A hung rank was killed alone at `at`: its exit is on its way to the agent, as `failure`."""

    failure: Failure
    at: float


@dataclass(frozen=True, slots=True)
class Recorded:
    """The restart policy stopped an in-process recovery: the group's failure, when it comes, is recorded."""


@dataclass(frozen=True, slots=True)
class Told:
    """The ranks here were told at `at` to leave their generation: nodes `silent` since `since` are lost."""

    at: float
    since: float
    silent: str = ""  # their launchers, as the ledger names them


State = Idle | Pending | HangKilled | Recorded
