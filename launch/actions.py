"""How the supervisor carries out the recovery coordinator's actions (launch.recovery.events): the only
place where a decision of the coordinator touches the world (the agent, the ranks' processes, the store,
the ledger, the log). Two actions ask the world a question and hand the answer back to the coordinator as
an event: `CheckHangs` (the watchdog's verdict) and `PublishSmallerWorld` (the store's answer)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.exclusion import add_this_host
from common.process import kill_group
from launch import failures
from launch.recovery import store
from launch.recovery.events import (
    Action,
    Announce,
    CheckHangs,
    HangFound,
    Kill,
    LetFail,
    Note,
    PrintStacks,
    Proceed,
    PublishSmallerWorld,
    Record,
    Replace,
    Restart,
    SegmentStarted,
    Stop,
    WorldPublished,
)
from launch.watchdog import print_stacks

if TYPE_CHECKING:
    from launch.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Carried:
    """What the agent's hook returns: the replacements' environment (None: a full restart), and whether a
    running group is to be restarted."""

    env: dict[str, str] | None = None
    restart: bool = False


def carry_out(s: Supervisor, actions: list[Action]) -> Carried:
    """Carry out `actions` in order (and those the answers to `CheckHangs` and `PublishSmallerWorld` bring)."""
    env, restart = None, False
    for a in actions:
        if isinstance(a, Replace):
            env = a.env
            if a.again:
                log.info(f"in-process recovery: starting rank(s) {list(a.replaced)} again too")
            else:
                log.info(f"in-process recovery, generation {a.generation}: starting rank(s) {list(a.replaced)} "
                         f"again; the other ranks keep their processes (pids {list(a.kept_pids)} here)")
        elif isinstance(a, LetFail):
            env = None
        elif isinstance(a, Restart):
            restart = True
        elif isinstance(a, (CheckHangs, PublishSmallerWorld)):
            more = carry_out(s, _ask(s, a))
            env, restart = more.env or env, more.restart or restart
        else:
            _do(s, a)
    return Carried(env, restart)


def _do(s: Supervisor, a: Action) -> None:
    """One action that answers nothing back."""
    if isinstance(a, Record):
        f = a.failure
        record = s.ledger.failure(attempt=s.attempt, rank=f.rank, cause=f.cause, step=f.step, exit_code=f.exit_code,
                                  signal=f.signal, message=f.message, traceback=a.traceback, path=a.path)
        log.info(f"failure: {f.describe()}" + (f"\n{a.traceback}" if a.traceback else ""))
        s.ledger.interrupted = (record["time"], "failure")
    elif isinstance(a, Proceed):
        log.info(a.line)
    elif isinstance(a, Stop):
        s.ending.decision = a.decision
        s.ending.outvoted = s.ending.outvoted or a.outvoted  # the majority goes on: this node leaves it open
        s.agent.stop_restarts()
        if a.decision.set_aside:  # its ranks failed too often (a rank found faulty names the node itself)
            host, path = add_this_host(s.cfg.run.dir)
            s.ledger.event("node_excluded", host=host, rank=a.failure.rank, step=a.failure.step, file=path,
                           why=a.decision.reason.splitlines()[-1], by="launcher")
        log.info(a.decision.reason)
    elif isinstance(a, Note):
        if a.line:
            log.info(a.line)
        if a.event == "in_process_done":  # and which endpoint hosts the store after it
            s.ledger.event(a.event, **a.fields, store=s.members.endpoint)
        elif a.event:
            s.ledger.event(a.event, **a.fields)
    elif isinstance(a, Kill):
        kill_group(a.pid)
    elif isinstance(a, PrintStacks):
        print_stacks(a.beats, a.why)
    elif isinstance(a, Announce):
        store.announce(s.agent, a.generation, handled=a.handled)
    elif isinstance(a, SegmentStarted):
        s.ledger.attempt_started(s.attempt, a.noticed, "failure", path="in-process")
        if a.smaller:
            s.members.joined(s.agent, a.generation)
    else:
        raise TypeError(f"no way to carry out {a!r}")


def _ask(s: Supervisor, a: CheckHangs | PublishSmallerWorld) -> list[Action]:
    """The world's answer to a question the coordinator asked, handed back to it as an event."""
    if isinstance(a, CheckHangs):
        hang = s.watchdog.check(s.attempt, a.now, ignore=a.ignore)
        if hang is None:
            return []
        failure = failures.from_hang(hang, s.cfg.checkpoint_dir)
        group = s.agent.group()
        return s.coordinator.handle(HangFound(failure=failure, pid=hang.pid, gone=hang.state == "gone", beats=a.beats,
                                              now=a.now, waiting=hang.state == "waiting",
                                              node=group[1] if group else 0))
    kept = dict(enumerate(sorted(b.pid for b in a.beats.values())))  # by pid (the ranks here may be renumbered)
    answer = store.smaller_world(s.agent, a.generation, s.opts.min_nodes, waited_s=time.time() - a.noticed,
                                 last_endpoint=s.members.last_endpoint)
    if answer is None:  # the ranks here are on their way: asked again at the next look
        return []
    lost, why, spare = answer
    return s.coordinator.handle(WorldPublished(generation=a.generation, noticed=a.noticed, kept=kept, lost=tuple(lost),
                                               why=why, step=s.last_step() + 1, world=s.agent.world_size(),
                                               spare=spare))
