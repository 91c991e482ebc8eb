"""The launcher's recovery coordinator (launch.recovery.coordinator), driven directly: one row per transition,
each a state reached by events, one more event, and the actions and the state that must follow. No
processes: the coordinator has no I/O of its own."""

from __future__ import annotations

import dataclasses

import pytest

from common.exits import EXIT_USAGE
from common.timing import (
    HANG_DEFER_S,
    HANG_EXIT_WAIT_S,
    NODE_HANDLED_S,
    NODE_LOST_S,
    RECOVERY_BOUND_S,
    TOLD_S,
    UNAWARE_S,
)
from launch.failures import Failure, RankExit
from launch.policy import RestartPolicy
from launch.recovery.coordinator import RecoveryCoordinator
from launch.recovery.events import (
    Announce,
    CheckHangs,
    GroupFailed,
    GroupLeft,
    GroupStarted,
    HangFound,
    Kill,
    LetFail,
    Note,
    Observed,
    Preempted,
    PrintStacks,
    Proceed,
    PublishSmallerWorld,
    RanksExited,
    Record,
    Replace,
    Restart,
    SegmentStarted,
    Silence,
    Stop,
    Tick,
    WorldPublished,
)
from launch.recovery.states import HangKilled, Idle, Mode, Pending, Recorded
from trainer.runtime.protocol import HeartbeatRecord, RecoveryTimes, StartupTimes

T0 = 1000.0  # when the first failure is noticed
ONE_NODE = Mode(in_process=True, single_node=True)
SMALLER = Mode(in_process=True, single_node=False, smaller=True, min_nodes=1)  # --nnodes 1:N
NODES = Mode(in_process=True, single_node=False)  # --nnodes N
RESTARTS = Mode(in_process=False, single_node=False)


def beats(**phases: str) -> dict[int, HeartbeatRecord]:
    """Three ranks (pids 100-102) of generation 0, rank r in phases[f"r{r}"] (train by default)."""
    records = {}
    for rank in range(3):
        phase = phases.get(f"r{rank}", "train")
        recovery = RecoveryTimes(recovering=1, t_error=T0) if phase == "recover" else RecoveryTimes()
        records[rank] = HeartbeatRecord(pid=100 + rank, rank=rank, phase=phase, generation=0,
                                        startup=StartupTimes(t_first=T0 - 5), recovery=recovery)
    return records


def rank_died(rank: int = 1, code: int = -9, now: float = T0, **phases: str) -> RanksExited:
    cause = "signal" if code < 0 else "exit"
    failure = Failure(rank, cause, 5, exit_code=code, signal="SIGKILL" if code < 0 else None)
    return RanksExited({rank: RankExit(rank, rank, code, now)}, failure, beats(**phases), {0: 100, 1: 101, 2: 102},
                       now)


def every_rank_died() -> RanksExited:
    exits = {r: RankExit(r, r, -9, T0) for r in range(3)}
    return RanksExited(exits, Failure(0, "signal", 5, exit_code=-9), beats(), {0: 100, 1: 101, 2: 102}, T0)


def tick(now: float, handled: bool = False, silence: Silence | None = None, local=(0, 1, 2), **phases) -> Tick:
    return Tick(now, beats(**phases), 5, local, handled=lambda generation: handled, silence=silence, can_tell=True)


def gone_on(now: float) -> Tick:
    """The ranks here (0-2) went on into generation 1 already: in the smaller world another node's launcher
    published, read before this launcher looked."""
    moved = {r: dataclasses.replace(b, generation=1, recovery=RecoveryTimes(recovering=1, t_error=T0))
             for r, b in beats().items()}
    return Tick(now, moved, 5, (0, 1, 2), can_tell=True)


def hang(gone: bool = False, now: float = T0) -> HangFound:
    return HangFound(Failure(1, "hang", 5, message="rank 1 hung", key="rank 1 stopped train"), 101, gone, beats(), now)


def settled() -> Observed:
    return Observed({r: dataclasses.replace(b, generation=1) for r, b in beats().items()})


def recovering(now: float = T0 + 0.1, handled: bool = True) -> Observed:
    """The ranks here (global ranks 0-2) recovering into generation 1, which this launcher did not start;
    `handled`: another node's launcher said it handles that failure."""
    return Observed(beats(r0="recover", r1="recover", r2="recover"), now=now, ranks={0: 0, 1: 1, 2: 2},
                    handled=lambda generation: handled and generation == 1)


def published(why: str = "") -> WorldPublished:
    return WorldPublished(1, T0, {0: 100, 1: 101, 2: 102}, (3, 4, 5), why, 5)


ALONE = Silence(("node-b",), 2, True, T0 - 6, 5.0)  # half the group, at the last endpoint: goes on
MINORITY = Silence(("node-b", "node-c"), 3, False, T0 - 6, 5.0)
ONE_OF_THREE = Silence(("node-c",), 3, False, T0 - 6, 5.0)  # two nodes survive

# (name, mode, restart budget, events before, the event, the actions that follow, the state after)
ROWS = [
    ("a rank exits: replaced alone in the next generation", ONE_NODE, 3, [], rank_died(),
     [Record, Proceed, Announce, SegmentStarted, Replace], Pending),
    ("every rank of the node exits: nobody to recover with", ONE_NODE, 3, [], every_rank_died(),
     [Note, LetFail], Idle),
    ("bad input: the usual path", ONE_NODE, 3, [], rank_died(code=EXIT_USAGE), [LetFail], Idle),
    ("a second failure during the recovery falls back", ONE_NODE, 3, [rank_died()], rank_died(rank=2),
     [Note, LetFail], Pending),
    ("the group's failure after a fallback is recorded", ONE_NODE, 3, [rank_died(), rank_died(rank=2)],
     GroupFailed(Failure(2, "signal", 5)), [Record, Proceed], Pending),
    ("a second failure that reached torchelastic first: the fallback said, then recorded", ONE_NODE, 3,
     [rank_died()], GroupFailed(Failure(2, "signal", 5)), [Note, Record, Proceed], Pending),
    ("a full restart forgets the recovery", ONE_NODE, 3, [rank_died(), rank_died(rank=2)], GroupStarted(), [], Idle),
    ("the recovery settles once every rank stepped in its generation", ONE_NODE, 3, [rank_died()], settled(),
     [Note], Idle),
    ("a recovery within its bound waits, the watchdog told to leave its ranks alone", ONE_NODE, 3, [rank_died()],
     tick(T0 + 1, r0="recover", r2="recover"), [CheckHangs], Pending),
    ("the recovery bound passed: stacks, then a full restart", ONE_NODE, 3, [rank_died()],
     tick(T0 + RECOVERY_BOUND_S + 1, r0="recover", r2="recover"), [Note, PrintStacks, Record, Proceed, Restart], Idle),
    ("a survivor that never noticed is killed, to be replaced too", ONE_NODE, 3, [rank_died()],
     tick(T0 + UNAWARE_S, r0="recover"), [Note, Kill, CheckHangs], Pending),
    ("no survivor noticed on a lone node: a full restart", ONE_NODE, 3, [rank_died()], tick(T0 + UNAWARE_S),
     [Note, PrintStacks, Record, Proceed, Restart], Idle),
    ("a hung rank is killed alone", ONE_NODE, 3, [], hang(), [Note, Kill], HangKilled),
    ("its exit is awaited, not judged again", ONE_NODE, 3, [hang()], tick(T0 + HANG_EXIT_WAIT_S / 2), [], HangKilled),
    ("its exit starts its replacement", ONE_NODE, 3, [hang()], rank_died(), [Record, Proceed, Announce,
                                                                              SegmentStarted, Replace], Pending),
    ("a hung survivor during the recovery: a full restart", ONE_NODE, 3, [rank_died()], hang(),
     [Record, Proceed, Restart], Pending),
    ("a vanished rank is no hang to kill", ONE_NODE, 3, [], hang(gone=True), [Record, Proceed, Restart], Idle),
    ("SIGTERM during the recovery: left to the ranks, still settled", ONE_NODE, 3, [rank_died()], Preempted(), [],
     Pending),
    ("the budget spent: the policy stops, the failure recorded once", ONE_NODE, 0, [], rank_died(),
     [Record, Stop, LetFail], Recorded),
    ("...and the group's failure is not recorded again", ONE_NODE, 0, [rank_died()], GroupFailed(Failure(1, "signal",
                                                                                                       5)), [], Idle),
    ("several nodes: a rank exits: its launcher replaces it alone, telling the others it leads", NODES, 3, [],
     rank_died(), [Record, Proceed, Announce, SegmentStarted, Replace], Pending),
    ("several nodes: a hung rank is killed alone", NODES, 3, [], hang(), [Note, Kill], HangKilled),
    ("several nodes: bad input restarts the group, the others told it is handled", SMALLER, 3, [],
     rank_died(code=EXIT_USAGE), [Announce, LetFail], Idle),
    ("several nodes: the others went on without this node: it rejoins through the rendezvous", NODES, 3, [],
     dataclasses.replace(rank_died(), left_behind=True), [Note, LetFail], Idle),
    ("several nodes: a vanished rank restarts the group, announced", SMALLER, 3, [], hang(gone=True),
     [Announce, Record, Proceed, Restart], Idle),
    ("several nodes, no in-process: the group restarts", RESTARTS, 3, [], rank_died(), [LetFail], Idle),
    ("the ranks here recover into a generation another node's launcher started: followed", NODES, 3, [],
     recovering(), [SegmentStarted], Pending),
    ("...not before that launcher said it handles it (a rank here raising: this launcher leads)", NODES, 3, [],
     recovering(handled=False), [], Idle),
    ("...the watchdog told to leave them alone", NODES, 3, [recovering()], tick(T0 + 1, r0="recover", r1="recover",
                                                                                 r2="recover"), [CheckHangs], Pending),
    ("...not while a rank here has exited (the recovery is from it: its exit is on the way)", NODES, 3, [],
     dataclasses.replace(recovering(), exited=True), [], Idle),
    ("...settled, and recorded here", NODES, 3, [recovering()], settled(), [Note], Idle),
    ("...past NODE_HANDLED_S: still followed (RECOVERY_BOUND_S bounds it)", SMALLER, 3, [recovering()],
     tick(T0 + NODE_HANDLED_S + 1, handled=True, r0="recover", r1="recover", r2="recover"), [CheckHangs], Pending),
    ("...its leader's node silent: a restart without it", SMALLER, 3, [recovering()],
     tick(T0 + 1, silence=ALONE, r0="recover", r1="recover", r2="recover"), [Note, Record, Proceed, Restart],
     Pending),
    ("...a failure here meanwhile falls back", NODES, 3, [recovering()], rank_died(rank=2), [Note, LetFail], Pending),
    ("...past the recovery bound: a full restart", NODES, 3, [recovering()],
     tick(T0 + RECOVERY_BOUND_S + 1, r0="recover", r1="recover", r2="recover"),
     [Note, PrintStacks, Record, Proceed, Restart], Idle),
    ("...the same generation seen again: followed once", NODES, 3, [recovering(), settled()], recovering(), [], Idle),
    ("every rank here waits for ranks of a silent node: publish a smaller world", SMALLER, 3, [],
     tick(T0 + NODE_LOST_S + 0.01, r0="recover", r1="recover", r2="recover"), [PublishSmallerWorld], Idle),
    ("...or went on already in the world another node's launcher published: taken here too", SMALLER, 3, [],
     gone_on(T0 + NODE_LOST_S + 0.01), [PublishSmallerWorld], Idle),
    ("...not yet when their launcher said it handles them", SMALLER, 3, [],
     tick(T0 + NODE_LOST_S + 0.01, handled=True, r0="recover", r1="recover", r2="recover"), [CheckHangs], Idle),
    ("...until NODE_HANDLED_S", SMALLER, 3, [],
     tick(T0 + NODE_HANDLED_S, handled=True, r0="recover", r1="recover", r2="recover"), [PublishSmallerWorld], Idle),
    ("the smaller world published: the survivors go on in process", SMALLER, 3, [], published(),
     [Record, Proceed, SegmentStarted, Note], Pending),
    ("the smaller world refused: a full restart", SMALLER, 3, [], published("a node is waiting to join"),
     [Note, Record, Proceed, Restart], Idle),
    ("a lost node: the ranks here are told to go on without it", SMALLER, 3, [], tick(T0, silence=ALONE),
     [Note, Note, Announce, CheckHangs], Idle),
    ("told, within TOLD_S: nothing more", SMALLER, 3, [tick(T0, silence=ALONE)], tick(T0 + 1, silence=ALONE),
     [CheckHangs], Idle),
    ("told, not gone on by TOLD_S: a restart without the silent node", SMALLER, 3, [tick(T0, silence=ALONE)],
     tick(T0 + TOLD_S, silence=ALONE), [Record, Proceed, Restart], Idle),
    ("a node silent, two survivors: each tells its ranks to go on without it", SMALLER, 3, [],
     tick(T0, silence=ONE_OF_THREE), [Note, Note, Announce, CheckHangs], Idle),
    ("...the other survivor's world taken first (its ranks told already): no restart", SMALLER, 3, [published()],
     tick(T0 + 1, silence=ONE_OF_THREE), [Note, CheckHangs], Pending),
    ("...and nothing more within TOLD_S", SMALLER, 3, [published(), tick(T0 + 1, silence=ONE_OF_THREE)],
     tick(T0 + 1 + TOLD_S / 2, silence=ONE_OF_THREE), [CheckHangs], Pending),
    ("a minority of a partition stops", SMALLER, 3, [], tick(T0, silence=MINORITY), [Note, Stop, Restart], Idle),
    ("a node of the group restarted it: a failure here too", RESTARTS, 3, [], GroupLeft(("node-b",), 5),
     [Record, Proceed], Idle),
]


@pytest.mark.parametrize("name, mode, budget, before, event, actions, state", ROWS, ids=[row[0] for row in ROWS])
def test_transition(name, mode, budget, before, event, actions, state):
    coordinator = RecoveryCoordinator(mode, RestartPolicy(budget))
    for earlier in before:
        coordinator.handle(earlier)
    assert [type(a) for a in coordinator.handle(event)] == actions
    assert type(coordinator.state) is state


def test_a_replacement_joins_the_next_generation_and_the_watchdog_leaves_the_recovery_alone():
    coordinator = RecoveryCoordinator(ONE_NODE, RestartPolicy(3))
    replace = coordinator.handle(rank_died())[-1]
    assert replace.env == {"REKINDLE_GENERATION": "1"} and replace.replaced == (1,) and replace.kept_pids == (100, 102)
    assert coordinator.unjudged_pids() == {100, 101, 102}  # the failed rank's pid and the survivors'
    assert coordinator.representative({**beats(), 0: dataclasses.replace(beats()[0], generation=1)}).pid == 100


def test_a_survivor_killed_for_never_noticing_is_started_again_in_the_same_generation():
    coordinator = RecoveryCoordinator(ONE_NODE, RestartPolicy(3))
    coordinator.handle(rank_died())
    assert [type(a) for a in coordinator.handle(tick(T0 + UNAWARE_S / 2, r0="recover"))] == [CheckHangs]  # not yet
    kill = coordinator.handle(tick(T0 + UNAWARE_S, r0="recover"))[1]
    assert (kill.rank, kill.pid) == (2, 102)
    assert [type(a) for a in coordinator.handle(tick(T0 + UNAWARE_S + 1, r0="recover"))] == [CheckHangs]  # once
    again = coordinator.handle(rank_died(rank=2))
    assert [type(a) for a in again] == [Replace] and again[0].again and again[0].generation == 1
    assert coordinator.pending.replaced == [1, 2] and coordinator.pending.kept == {0: 100}


def test_a_hung_ranks_exit_is_recorded_as_the_hang_it_was():
    coordinator = RecoveryCoordinator(ONE_NODE, RestartPolicy(3))
    coordinator.handle(hang())
    record = coordinator.handle(rank_died())[0]
    assert record.failure.cause == "hang" and record.path == "in-process"


def test_a_second_failure_names_the_generation_it_interrupted():
    coordinator = RecoveryCoordinator(ONE_NODE, RestartPolicy(3))
    coordinator.handle(rank_died())
    note = coordinator.handle(rank_died(rank=2))[0]
    assert note.event == "in_process_fallback" and "second failure (rank 2)" in note.fields["why"]
    assert "generation 1" in note.fields["why"]


def test_a_followed_recovery_is_recorded_as_led_elsewhere_with_the_ranks_it_kept():
    coordinator = RecoveryCoordinator(NODES, RestartPolicy(3))
    coordinator.handle(recovering())
    assert coordinator.unjudged_pids() == {100, 101, 102} and coordinator.pending.noticed == T0
    (note,) = coordinator.handle(settled())
    assert note.event == "in_process_done" and note.fields == dict(generation=1, replaced=[], kept_pids=[100, 101, 102],
                                                                   led=False, kept_ranks=[0, 1, 2], spare="")
    assert coordinator.policy.restarts == 0  # another node's failure: counted by its launcher


def test_a_smaller_world_counts_from_when_the_silent_node_was_last_heard():
    coordinator = RecoveryCoordinator(SMALLER, RestartPolicy(3))
    coordinator.handle(tick(T0, silence=ALONE))
    waiting = tick(T0 + NODE_LOST_S + 0.01, silence=ALONE, r0="recover", r1="recover", r2="recover")
    publish = coordinator.handle(waiting)[-1]
    assert isinstance(publish, PublishSmallerWorld) and publish.noticed == ALONE.last_heard

def test_a_waiting_ranks_verdict_on_several_nodes_is_put_off_by_node_rank_and_a_sure_one_is_not():
    """A rank that only waits is likely held up by a rank on another node, which that node's watchdog (its
    rank stopped or spinning) kills at once: judged at once on every node, each would kill its own waiting
    rank too. Node 1 puts it off 2 x HANG_DEFER_S, then kills; a new verdict starts the wait again."""
    def waiting(now: float, step: int = 5, pid: int = 101) -> HangFound:
        return dataclasses.replace(hang(now=now), pid=pid, waiting=True, node=1,
                                   failure=dataclasses.replace(hang().failure, step=step))

    coordinator = RecoveryCoordinator(NODES, RestartPolicy(3))
    assert coordinator.handle(waiting(T0)) == []
    assert coordinator.handle(waiting(T0 + 2 * HANG_DEFER_S - 0.1)) == []
    assert coordinator.handle(waiting(T0 + 2 * HANG_DEFER_S - 0.05, step=6)) == []  # another verdict: from now
    assert coordinator.handle(waiting(T0 + 3 * HANG_DEFER_S, step=6)) == []
    assert isinstance(coordinator.handle(waiting(T0 + 4 * HANG_DEFER_S, step=6))[-1], Kill)
    for mode, verdict in [(NODES, hang()), (ONE_NODE, dataclasses.replace(hang(), waiting=True))]:
        assert isinstance(RecoveryCoordinator(mode, RestartPolicy(3)).handle(verdict)[-1], Kill)  # at once


def test_a_node_whose_ranks_failed_too_often_is_set_aside_without_announcing_a_restart():
    """The policy's node-failure limit reached on a rank's crash: the failure recorded, a Stop that leaves the
    rendezvous open (outvoted) and carries the failure (its launcher names the node), and no Announce: the
    others take this node for lost instead of waiting for it at the rendezvous. A recovery of another node's
    failure, followed here, counts against the limit."""
    coordinator = RecoveryCoordinator(SMALLER, RestartPolicy(10, node_failure_limit=2, can_set_aside=True))
    assert Announce in [type(a) for a in coordinator.handle(rank_died(now=T0))]
    coordinator.handle(GroupStarted(generation=5))
    actions = coordinator.handle(rank_died(now=T0 + 60))
    assert [type(a) for a in actions] == [Record, Stop, LetFail]
    stop = actions[1]
    assert stop.outvoted and stop.decision.set_aside and stop.decision.exit_code == 5 and stop.failure.rank == 1

    followed = RecoveryCoordinator(SMALLER, RestartPolicy(10, node_failure_limit=2, can_set_aside=True))
    followed.policy.failed_elsewhere()  # as `_follow` counts each recovery of another node's failure
    followed.policy.failed_elsewhere()
    followed.handle(rank_died(now=T0))
    followed.handle(GroupStarted(generation=5))
    assert Stop not in [type(a) for a in followed.handle(rank_died(now=T0 + 60))]  # 2 here, 2 elsewhere
