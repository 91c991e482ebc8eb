"""What the recovery coordinator (`launch.recovery.coordinator`) takes and gives: events in (a rank
exited, a hang verdict, nodes silent, a world published, a tick of the heartbeats) and actions out (replace
these ranks, kill this pid, restart the group, stop, record this). Plain frozen data: the supervisor builds
the events from what it sees and carries the actions out; the unit tests build both by hand."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from launch.failures import Failure, RankExit
from launch.policy import Decision
from trainer.contract import HeartbeatRecord

Beats = dict[int, HeartbeatRecord]  # this node's heartbeat records of the running attempt, by global rank


# ---------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class GroupStarted:
    """A worker group starts afresh (a full restart, or the first start: generation 0), or a spare's ranks start
    in a lost node's place in the running group (`generation`: its recovery's); nothing pending."""

    generation: int = 0


@dataclass(frozen=True)
class RanksExited:
    """Ranks of the running group exited while the others still run (before torchelastic stops the group).
    `failure`/`traceback`: the root cause among `exits` (launch.failures.from_exits); `running`: this node's
    ranks by local rank -> trainer pid; `left_behind`: the other nodes went on without this one (a smaller
    world of the generation it would recover into is published)."""

    exits: dict[int, RankExit]
    failure: Failure
    beats: Beats
    running: dict[int, int]
    now: float
    traceback: str = ""
    left_behind: bool = False


@dataclass(frozen=True)
class GroupFailed:
    """torchelastic stopped the group for a failure (`failure`, the root cause of its exits)."""

    failure: Failure
    traceback: str = ""


@dataclass(frozen=True)
class Observed:
    """This node's heartbeat records, read at a monitor interval (whatever the group's state), when, the
    running group's ranks here (local rank -> global rank), whether the process of one of those records
    had exited when looked at after reading them (its exit is yet to be reported), and `handled(generation)`:
    whether another node's launcher said it handles the failure before `generation` (asked only when needed)."""

    beats: Beats
    now: float = 0.0
    ranks: dict[int, int] = field(default_factory=dict)
    exited: bool = False
    handled: Callable[[int], bool] = field(default=lambda generation: False, compare=False)


@dataclass(frozen=True)
class Preempted:
    """A signal asks this node to stop: no recovery is started any more."""


@dataclass(frozen=True)
class Silence:
    """Nodes of the group that stopped answering at the store (`silent`) while it answers this node, in a
    group of `group_size` nodes; `last_endpoint`: the endpoint in use is the last of the list; `last_heard`:
    when (wall clock) the newest of them was last heard; `lost_s`: the silence that makes a node lost."""

    silent: tuple[str, ...]
    group_size: int
    last_endpoint: bool
    last_heard: float
    lost_s: float


@dataclass(frozen=True)
class Tick:
    """A look at the heartbeats, and at the other nodes, while the group is healthy. `local_ranks`: the
    global ranks of this node; `step`: the step in flight; `handled(generation)`: whether another node's
    launcher said it handles the failure before `generation` (asked of the store only when needed)."""

    now: float
    beats: Beats
    step: int
    local_ranks: tuple[int, ...] = ()
    handled: Callable[[int], bool] = field(default=lambda generation: False, compare=False)
    silence: Silence | None = None  # nodes of the group gone silent (launch.nodes)
    can_tell: bool = False  # the ranks here can be told to go on without them (they have a coordination store)


@dataclass(frozen=True)
class HangFound:
    """The watchdog's verdict on a rank of this node (`failure`: launch.failures.from_hang); `gone`: its
    process had vanished already; `waiting`: it sleeps (in a collective or I/O: likely held up by a rank
    elsewhere); `node`: this node's rank in the group."""

    failure: Failure
    pid: int
    gone: bool
    beats: Beats
    now: float
    waiting: bool = False
    node: int = 0


@dataclass(frozen=True)
class WorldPublished:
    """The answer to `PublishSmallerWorld`: the lost ranks, why the survivors cannot go on in process ('' when
    they go on), and the spare node that starts the lost ranks in their node's place ('': a smaller world)."""

    generation: int
    noticed: float
    kept: dict[int, int]
    lost: tuple[int, ...]
    why: str
    step: int
    world: int = 0  # the smaller world's size
    spare: str = ""


@dataclass(frozen=True)
class GroupLeft:
    """`nodes` of the running group left it to meet again (a failure there) while the ranks here run on."""

    nodes: tuple[str, ...]
    step: int


# ---------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Replace:
    """Start these ranks again alone, with `env`, in `generation`; the other ranks keep their processes.
    `again`: survivors killed for never noticing the failure, started into the recovery under way."""

    env: dict[str, str]
    generation: int
    replaced: tuple[int, ...]
    kept_pids: tuple[int, ...]
    noticed: float
    again: bool = False


@dataclass(frozen=True)
class LetFail:
    """Let torchelastic stop and restart the whole group (the failure is recorded when it does)."""


@dataclass(frozen=True)
class Record:
    """Put this failure in the ledger (`path`: how it is recovered: restart | in-process)."""

    failure: Failure
    traceback: str = ""
    path: str = "restart"


@dataclass(frozen=True)
class Proceed:
    """The restart policy lets the run go on: `line` says how; `delay_s` of backoff before a full restart."""

    line: str
    delay_s: float = 0.0


@dataclass(frozen=True)
class Stop:
    """The restart policy (or a partition verdict) stops the job here: `decision` carries the exit code.
    `outvoted`: this node is the minority of a partition, or set aside (it leaves the rendezvous open);
    `failure`: the failure decided on, if any."""

    decision: Decision
    outvoted: bool = False
    failure: Failure | None = None


@dataclass(frozen=True)
class Note:
    """A line for the log and, with `event`, a ledger event with `fields`."""

    line: str = ""
    event: str = ""
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Kill:
    """SIGKILL this rank's process group (a hung rank, or a survivor that never noticed the failure)."""

    rank: int
    pid: int


@dataclass(frozen=True)
class PrintStacks:
    """Have these ranks print their Python stacks (before they are killed): where they were stuck."""

    beats: Beats
    why: str


@dataclass(frozen=True)
class Announce:
    """Tell the ranks' store that `generation` starts (the ranks leave the failed one); `handled`: and the
    other nodes' launchers that this node handles its own ranks' failure (it lives)."""

    generation: int
    handled: bool = True


@dataclass(frozen=True)
class PublishSmallerWorld:
    """Every rank here waits for ranks nobody replaces: publish the smaller world of `generation` on the
    ranks' store, then report back with `WorldPublished`."""

    generation: int
    noticed: float
    beats: Beats


@dataclass(frozen=True)
class SegmentStarted:
    """A new segment of the attempt in the ledger: the failed ranks replaced, or (`smaller`) the ranks here
    going on in a smaller world, in process, in `generation`, since `noticed`."""

    noticed: float
    generation: int
    smaller: bool = False


@dataclass(frozen=True)
class CheckHangs:
    """Ask the watchdog for a hung rank, leaving alone the ranks of `ignore` (pids a recovery waits for);
    report one with `HangFound`."""

    ignore: frozenset[int]
    beats: Beats
    now: float


@dataclass(frozen=True)
class Restart:
    """Turn the running group into a failed one: torchelastic restarts it (or ends, when stopped)."""


Action = (Replace | LetFail | Record | Proceed | Stop | Note | Kill | PrintStacks | Announce | PublishSmallerWorld
          | SegmentStarted | CheckHangs | Restart)
Event = GroupStarted | RanksExited | GroupFailed | Observed | Preempted | Tick | HangFound | WorldPublished | GroupLeft
