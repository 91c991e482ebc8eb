"""The launcher's recovery coordinator: the one owner of every recovery decision on this node. A state
machine, with no I/O of its own: `handle(event)` takes what the supervisor saw (launch.recovery.events: a
rank exited, a hang verdict, nodes silent, a tick of the heartbeats) and returns the actions the supervisor
carries out (replace these ranks, kill this pid, restart the group, stop, record this in the ledger). The
restart policy (launch.policy) is asked here too, so that every failure is decided in one place.

States: `Idle` -> `Pending(generation)` (failed ranks replaced in process, or the ranks here going on in a
smaller world) -> `Idle` once every rank here finished a step in the new generation (settled), or -> a
full restart (fell back: a second failure, the recovery bound passed, a survivor that never noticed on a
lone node). Beside them: `HangKilled` (a hung rank killed alone, its exit on the way), `Recorded` (the
policy stopped an in-process recovery: the group's failure is in the ledger already), and `told` (the
ranks here were told to go on without silent nodes).

In-process recovery (`Mode.in_process`): a failed rank is replaced alone, in the next generation, by its
own node's launcher, which leads the recovery; the survivors keep their processes, on every node, and the
other nodes' launchers follow it (`Pending.followed`). Under `--nnodes MIN:MAX` (`Mode.smaller`) a node whose
every rank waits for ranks of other nodes whose launcher said nothing (NODE_LOST_S) has a spare start the
lost ranks, or sends its survivors on in a smaller world, as every other surviving node does (the first
launcher's world to be published stands); a live node's launcher says at once that it handles its ranks'
failure (`Announce`), and the others wait NODE_HANDLED_S for it at the rendezvous instead. Its clock is the
wall clock (`time.time()`): the heartbeat records it compares with carry wall times."""

from __future__ import annotations

from common.exits import EXIT_FAULTY, EXIT_PREEMPTED, EXIT_STORAGE, EXIT_USAGE
from common.timing import (
    HANG_DEFER_S,
    HANG_EXIT_WAIT_S,
    NODE_HANDLED_S,
    NODE_LOST_S,
    RECOVERY_BOUND_S,
    TOLD_S,
    UNAWARE_S,
)
from launch.failures import Failure
from launch.liveness import goes_on
from launch.policy import Decision, RestartPolicy
from launch.recovery.events import (
    Action,
    Announce,
    Beats,
    CheckHangs,
    Event,
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
from launch.recovery.states import HangKilled, Idle, Mode, Pending, Recorded, State, Told
from trainer.contract import GENERATION_ENV, HeartbeatRecord, next_generation


class RecoveryCoordinator:
    """Events in (`handle`), actions out. The supervisor asks it two questions besides: which heartbeat
    speaks for the node (`representative`) and which pids the watchdog leaves alone (`unjudged_pids`)."""

    def __init__(self, mode: Mode, policy: RestartPolicy) -> None:
        self.mode, self.policy = mode, policy
        self.generation = 0  # the newest generation this node's ranks were asked to join
        self.state: State = Idle()
        self.told: Told | None = None
        self.backoff_s = 0.0  # how long the next full restart backs off (the restart policy's word)
        self.deferred: tuple[tuple[int, int], float] | None = None  # a waiting rank's verdict put off: key, since
        # Preempted (a SIGTERM): nothing more is started or judged (no ticks); a recovery under way is the ranks'.
        self._handlers = {GroupStarted: self._started, RanksExited: self._exited, GroupFailed: self._failed,
                          Observed: self._observed, Preempted: lambda e: [], Tick: self._tick,
                          HangFound: self._hang, WorldPublished: self._published, GroupLeft: self._left}

    def handle(self, event: Event) -> list[Action]:
        return self._handlers[type(event)](event)

    # ------------------------------------------------------------------ questions
    @property
    def pending(self) -> Pending | None:
        return self.state if isinstance(self.state, Pending) else None

    def unjudged_pids(self) -> frozenset[int]:
        """Pids the watchdog must not judge while a recovery is under way: its failed ranks, and its survivors,
        which wait for the replacement (UNAWARE_S and RECOVERY_BOUND_S bound them). A survivor of a hung rank
        has not finished a step for as long as the hung one: judged too, it would turn the recovery of a
        SIGSTOPped rank into a full restart whenever its verdict came before its own notice."""
        p = self.pending
        return p.dead_pids | frozenset(p.kept.values()) if p is not None else frozenset()

    def representative(self, beats: Beats) -> HeartbeatRecord | None:
        """The heartbeat that speaks for this node in the ledger: its lowest rank of the current generation,
        a survivor's while a recovery is under way (older records are of ranks not yet re-formed)."""
        current = {r: b for r, b in beats.items() if b.generation >= self.generation}
        p = self.pending
        kept = [r for r, b in current.items() if p is None or b.pid in p.kept.values()]
        return current[min(kept or current)] if current else None

    def take_backoff(self) -> float:
        """The backoff before the full restart about to happen (then none until the policy says so again)."""
        backoff, self.backoff_s = self.backoff_s, 0.0
        return backoff

    def next_generation(self, beats: Beats) -> int:
        """The generation a recovery from now starts: past the newest this node's ranks or this launcher knew."""
        return next_generation(self.generation, (b.generation for b in beats.values()))

    # ------------------------------------------------------------------ events
    def _started(self, e: GroupStarted) -> list[Action]:
        self.generation, self.state, self.told = e.generation, Idle(), None
        return []

    def _exited(self, e: RanksExited) -> list[Action]:
        p = self.pending
        if p is not None and e.exits and set(e.exits) <= p.unaware:  # the survivors it had killed: start them too
            p.replaced = sorted({*p.replaced, *e.exits})
            p.kept = {lr: pid for lr, pid in p.kept.items() if lr not in {x.local_rank for x in e.exits.values()}}
            p.dead_pids = p.dead_pids | {e.beats[r].pid for r in e.exits if r in e.beats}
            return [Replace(env={GENERATION_ENV: str(p.generation)}, generation=p.generation,
                            replaced=tuple(sorted(e.exits)), kept_pids=tuple(sorted(p.kept.values())),
                            noticed=p.noticed, again=True)]
        failure = self.state.failure if isinstance(self.state, HangKilled) else e.failure
        self.state = Idle() if isinstance(self.state, HangKilled) else self.state
        if not self.mode.in_process:
            return [*self._restarting(e.beats, failure), LetFail()]
        if p is not None:
            return [*self._second_failure(p, failure.rank), LetFail()]
        if failure.exit_code in (EXIT_USAGE, EXIT_PREEMPTED, EXIT_STORAGE, EXIT_FAULTY) or failure.cause in (
                "preemption", "storage"):
            return [*self._restarting(e.beats, failure), LetFail()]
        if e.left_behind:  # it rejoins through the rendezvous, as a node joining
            return [*self._fallback("the other nodes went on without this one while it was silent", failure.rank),
                    LetFail()]
        failed_local = {x.local_rank for x in e.exits.values()}
        kept = {lr: pid for lr, pid in e.running.items() if lr not in failed_local}
        if self.mode.single_node and not kept:
            return [*self._fallback("every rank failed: nobody is left to recover with", failure.rank), LetFail()]
        verdict = self._decide(failure, e.traceback, "in-process")
        if isinstance(verdict[-1], Stop):
            self.generation, self.state, self.told = 0, Recorded(), None
            return [*verdict, LetFail()]
        generation = self.next_generation(e.beats)
        dead = frozenset(e.beats[r].pid for r in e.exits if r in e.beats)
        self.generation = generation
        self.state = Pending(generation=generation, noticed=e.now, replaced=sorted(e.exits), kept=kept, dead_pids=dead)
        return [*verdict, Announce(generation), SegmentStarted(noticed=e.now, generation=generation),
                Replace(env={GENERATION_ENV: str(generation)}, generation=generation, replaced=tuple(sorted(e.exits)),
                        kept_pids=tuple(sorted(kept.values())), noticed=e.now)]

    def _failed(self, e: GroupFailed) -> list[Action]:
        if isinstance(self.state, Recorded):
            self.state = Idle()
            return []
        p = self.pending  # a rank that died after the agent's poll for replacements reaches torchelastic first
        second = self._second_failure(p, e.failure.rank) if p is not None and not p.fell_back else []
        return [*second, *self._decide(e.failure, e.traceback, "restart")]

    def _second_failure(self, p: Pending, rank: int) -> list[Action]:
        """The fallback, said once, for a failure during the pending recovery `p`."""
        p.fell_back = True
        return self._fallback(f"a second failure (rank {rank}) during the in-process recovery of generation "
                              f"{p.generation}", rank)

    def _observed(self, e: Observed) -> list[Action]:
        """Follow a recovery that another node's launcher leads (`_follow`); settle the pending recovery once
        every rank of this node has finished a step in its generation."""
        segment = self._follow(e)
        p = self.pending
        ready = [b for b in e.beats.values() if p is not None and b.generation >= p.generation and b.startup.t_first]
        if p is None or not e.beats or len(ready) < len(e.beats):
            return segment
        self.state = Idle()
        kept = sorted(p.kept.values())
        return [*segment, Note(event="in_process_done", fields=dict(
            generation=p.generation, replaced=p.replaced, kept_pids=kept, led=not p.followed, spare=p.spare,
            kept_ranks=sorted(r for r, b in e.beats.items() if b.pid in kept)))]

    def _follow(self, e: Observed) -> list[Action]:
        """Several nodes: the ranks here recover into a generation this launcher did not start, and another
        node's launcher said it handles the failure before it (its rank failed, and it replaces it). Follow
        that recovery as this node's own: the watchdog leaves the ranks here alone while they wait,
        RECOVERY_BOUND_S bounds it (and the silence of the leader's node), a failure here meanwhile falls
        back to a full restart, and its segment and end are in the ledger. Not while a rank here has exited
        (the ranks here recover from it: its exit is on its way, and this launcher leads)."""
        if not self.mode.in_process or self.mode.single_node or not isinstance(self.state, Idle) or e.exited:
            return []
        newer = [b for b in e.beats.values() if max(b.generation, b.recovery.recovering) > self.generation]
        generation = max((max(b.generation, b.recovery.recovering) for b in newer), default=0)
        if not newer or not e.handled(generation):
            return []
        self.generation = generation
        noticed = min((b.recovery.t_error for b in newer if b.recovery.t_error), default=e.now)
        pids = {r: b.pid for r, b in e.beats.items()}
        kept = {lr: pids[rank] for lr, rank in e.ranks.items() if rank in pids}
        self.state = Pending(generation=generation, noticed=noticed, replaced=[], kept=kept, followed=True)
        self.policy.failed_elsewhere()
        return [SegmentStarted(noticed=noticed, generation=generation)]

    def _tick(self, e: Tick) -> list[Action]:
        if e.silence is None:
            self.told = None
        else:
            silent = self._silent(e.silence, e)
            if any(isinstance(action, Restart) for action in silent):
                return silent
            return [*silent, *self._recover(e)]
        return self._recover(e)

    def _recover(self, e: Tick) -> list[Action]:
        if stuck := self._overdue(e.now):
            return self._fall_back_stuck(*stuck, e.beats, e.step)
        unaware = self._unaware(e)
        if stuck := self._stuck_unaware(unaware):
            return self._fall_back_stuck(*stuck, e.beats, e.step)
        kills = self._kill_unaware(unaware)
        if (lost := self._lost_node(e)) is not None:
            return [*kills, lost]
        if isinstance(self.state, HangKilled) and e.now - self.state.at < HANG_EXIT_WAIT_S:
            return kills  # the hung rank was SIGKILLed alone: its exit is on its way to the agent
        return [*kills, CheckHangs(ignore=self.unjudged_pids(), beats=e.beats, now=e.now)]

    def _hang(self, e: HangFound) -> list[Action]:
        if self._defer(e):
            return []
        if self.mode.in_process and self.pending is None and not e.gone:
            # In process: kill the hung rank alone; its replacement is started as for a crash.
            self.state = HangKilled(failure=e.failure, at=e.now)
            return [Note(f"{e.failure.describe()}: killing it (pid {e.pid})"), Kill(rank=e.failure.rank, pid=e.pid)]
        return [*self._restarting(e.beats, e.failure), *self._decide(e.failure, "", "restart"), Restart()]

    def _defer(self, e: HangFound) -> bool:
        """Several nodes, in process: a verdict on a rank that only waits is put off HANG_DEFER_S x (1 + this node's
        rank in the group). The rank holding it up is likely on another node, stopped or spinning, and that node
        kills it at once: judged everywhere at once, each node would kill its waiting rank too, and the recovery
        fall back to a full restart. Staggered, a hang where every rank only waits is judged, by one node first."""
        if not self.mode.in_process or self.mode.single_node or not e.waiting or self.pending is not None:
            return False
        key = (e.pid, e.failure.step)
        if self.deferred is None or self.deferred[0] != key:
            self.deferred = (key, e.now)
        return e.now - self.deferred[1] < HANG_DEFER_S * (1 + e.node)

    def _silent(self, s: Silence, e: Tick) -> list[Action]:
        """Nodes of the group went silent: every surviving node tells its ranks to leave their collectives, and
        they are lost as a node lost with a word is (`_lost_node`: a spare, or a smaller world); else a restart
        without them. Stop when this side is not a majority."""
        if self.told is not None and e.now - self.told.at < TOLD_S:
            return []
        size, silent, live = s.group_size, ", ".join(s.silent), s.group_size - len(s.silent)
        notes = [] if self.told is not None else [Note(event="partition", fields=dict(
            silent=list(s.silent), live=live, group_size=size))]
        if not goes_on(live, size, s.last_endpoint):
            reason = (f"this node is cut off: only {live} of the group's {size} node(s) answer (not a majority; "
                      f"silent: {silent}): stopping without committing, launch again to resume")
            return [*notes, Stop(Decision(False, exit_code=EXIT_PREEMPTED, reason=reason), outvoted=True), Restart()]
        if self.told is None and isinstance(self.state, Pending) and (self.state.lost or self.state.spare):
            self.told = Told(at=e.now, since=s.last_heard, silent=silent)  # sent on by another node's launcher
            return notes
        if self.told is None and e.can_tell and self.mode.smaller and self.pending is None:
            generation = self.next_generation(e.beats)
            self.told = Told(at=e.now, since=s.last_heard, silent=silent)
            return [*notes, Note(f"the launcher(s) of {silent} stopped answering for {s.lost_s:.0f}s (lost, or cut "
                                 f"off): telling the ranks here to leave generation {generation - 1} and go on "
                                 f"without them"), Announce(generation, handled=False)]
        why = " (the ranks here did not leave their collectives when told)" if self.told is not None else ""
        failure = Failure(0, "node", e.step, key="node silent", message=(
            f"the launcher(s) of {silent} stopped answering for {s.lost_s:.0f}s: cut off or lost{why}"))
        return [*notes, *self._decide(failure, "", "restart"), Restart()]

    def _published(self, e: WorldPublished) -> list[Action]:
        """A spare starts a lost node's ranks, or its survivors go on in a smaller world; else a restart."""
        lost = list(e.lost)
        silent = f" (the launcher(s) of {self.told.silent} silent)" if self.told and self.told.silent else ""
        failure = Failure(lost[0] if lost else 0, "node", e.step, key="node lost", message=f"rank(s) {lost} of another "
                          f"node stopped answering{silent}: the node is lost" if lost else f"a peer left: {e.why}")
        fallback = self._fallback(e.why, failure.rank) if e.why else []
        verdict = self._decide(failure, "", "restart" if e.why else "in-process")
        if e.why or isinstance(verdict[-1], Stop):
            return [*fallback, *verdict, Restart()]
        self.generation, self.told = e.generation, None
        self.state = Pending(generation=e.generation, noticed=e.noticed, replaced=[], kept=dict(e.kept),
                             lost=[] if e.spare else lost, spare=e.spare)
        what = (f"the spare {e.spare} starts rank(s) {lost} in their node's place" if e.spare else
                f"the {len(e.kept)} rank(s) here go on in a world of {e.world or len(e.kept)} without rank(s) {lost}")
        return [*verdict, SegmentStarted(noticed=e.noticed, generation=e.generation, smaller=True),
                Note(f"in-process recovery, generation {e.generation}: {what}")]

    def _left(self, e: GroupLeft) -> list[Action]:
        nodes = ", ".join(e.nodes)
        return self._decide(Failure(0, "node", e.step, key="node restarted the group", message=(
            f"node(s) {nodes} left the worker group to meet again (a failure there): the ranks here wait for "
            f"ranks that are gone")), "", "restart")

    # ------------------------------------------------------------------ the parts
    def _decide(self, failure: Failure, traceback: str, path: str) -> list[Action]:
        """Record the failure and ask the restart policy: [Record, Proceed | Stop]."""
        decision = self.policy.decide(failure)
        if not decision.restart:
            return [Record(failure, traceback=traceback, path=path),  # a faulty node leaves the rendezvous open
                    Stop(decision, outvoted=decision.exit_code == EXIT_FAULTY, failure=failure)]
        what = ("going on in process" if failure.cause == "node" and path == "in-process" else
                f"restarting {'the failed rank(s) alone' if path == 'in-process' else 'the worker group'}")
        line = f"{what} (restart {self.policy.restarts} of {self.policy.max_restarts})"
        self.backoff_s = decision.delay_s if path == "restart" else 0.0
        return [Record(failure, traceback=traceback, path=path), Proceed(line, delay_s=self.backoff_s)]

    def _restarting(self, beats: Beats, failure: Failure | None = None) -> list[Action]:
        """Several nodes (`smaller`): this launcher restarts its group for a failure of its own ranks; the others
        hear it and wait for the group at the rendezvous, instead of going on without this node after NODE_LOST_S
        and restarting again. Not when this node is set aside (a faulty rank, or too many failures): it is lost."""
        aside = failure is not None and (failure.exit_code == EXIT_FAULTY or self.policy.sets_aside(failure))
        return [Announce(self.next_generation(beats))] if self.mode.smaller and not aside else []

    @staticmethod
    def _fallback(why: str, rank: int) -> list[Action]:
        return [Note(f"in-process recovery not possible: {why}; restarting the whole worker group",
                     event="in_process_fallback", fields=dict(why=why, rank=rank))]

    def _fall_back_stuck(self, rank: int, why: str, beats: Beats, step: int) -> list[Action]:
        """The recovery under way cannot finish: the ranks it waited for in vain print their stacks, and the
        whole group restarts."""
        waited = {r: b for r, b in beats.items() if b.phase != "recover"}
        failure = Failure(rank, "hang", step, message=why, key="in-process recovery stuck")
        return [*self._fallback(why, rank), PrintStacks(beats=waited, why="did not come to the recovery"),
                *self._decide(failure, "", "restart"), Restart()]

    def _overdue(self, now: float) -> tuple[int, str] | None:
        """(the rank it replaced, why) once the pending recovery has taken longer than RECOVERY_BOUND_S."""
        p = self.pending
        if p is None or now - p.noticed <= RECOVERY_BOUND_S:
            return None
        self.state = Idle()
        return (p.replaced or p.lost or [0])[0], (f"the in-process recovery of generation {p.generation} did not "
                                                  f"finish within {RECOVERY_BOUND_S:.0f}s")

    def _unaware(self, e: Tick) -> dict[int, int]:
        """The survivors here (rank -> pid) still training in the failed generation UNAWARE_S after the
        failure was noticed, not reported yet."""
        p = self.pending
        if p is None or p.lost or e.now - p.noticed < UNAWARE_S:
            return {}
        kept = set(p.kept.values())
        return {rank: b.pid for rank, b in e.beats.items()
                if b.pid in kept and rank not in p.unaware and b.phase != "recover"
                and b.generation < p.generation and b.recovery.recovering < p.generation}

    def _stuck_unaware(self, found: dict[int, int]) -> tuple[int, str] | None:
        """On one node, none of the survivors noticed (`found`: `_unaware`): the recovery cannot go on."""
        p = self.pending
        if not found or not self.mode.single_node or set(found.values()) != set(p.kept.values()):
            return None
        self.state = Idle()
        return p.replaced[0], f"no rank noticed the failure of generation {p.generation - 1} within {UNAWARE_S:.0f}s"

    def _kill_unaware(self, found: dict[int, int]) -> list[Action]:
        """Kill the survivors that never noticed (`found`: `_unaware`): they are replaced in the same
        generation (each once)."""
        p = self.pending
        if not found:
            return []
        p.unaware |= set(found)
        p.dead_pids = p.dead_pids | set(found.values())  # the watchdog does not judge them meanwhile
        actions: list[Action] = []
        for rank, pid in found.items():
            actions += [Note(f"rank {rank} (pid {pid}) still trains in the failed generation {UNAWARE_S:.0f}s after "
                             f"the failure (blocked where no error reaches it): killing it, to start it again too",
                             event="in_process_unaware", fields=dict(rank=rank, pid=pid, generation=self.generation)),
                        Kill(rank=rank, pid=pid)]
        return actions

    def _lost_node(self, e: Tick) -> PublishSmallerWorld | None:
        """Every rank of this node has been recovering for NODE_LOST_S (NODE_HANDLED_S when the lost ranks'
        launcher said it handles their failure), with no failure of this node's under way: their node is lost.
        The ranks here may have gone on already, in the smaller world another node's launcher published (they
        read it before this launcher looked): it is taken then (`PublishSmallerWorld` finds it published)."""
        if not self.mode.smaller or self.pending is not None or not e.local_ranks:
            return None
        waiting = list(e.beats.values())  # this node's ranks: the heartbeat directory is this launcher's
        if len(waiting) < len(e.local_ranks) or not all(
                b.recovery.recovering > self.generation
                and (b.phase == "recover" or b.generation >= b.recovery.recovering) for b in waiting):
            return None
        noticed = min(b.recovery.t_error or e.now for b in waiting)
        generation = max(b.recovery.recovering for b in waiting)
        waited = e.now - noticed
        if waited < NODE_LOST_S or (waited < NODE_HANDLED_S and e.handled(generation)):
            return None
        since = min(noticed, self.told.since) if self.told else noticed
        return PublishSmallerWorld(generation=generation, noticed=since, beats=e.beats)
