"""In-process recovery (fault.in_process, under `python -m launch`): when a peer rank is lost, this
rank keeps its process, its model, optimizer, data loader and compiled code. It leaves the failed
generation's process groups, waits (bounded) for the launcher's replacement of the lost rank, re-forms
the groups (trainer.recovery.regroup), restores the newest memory snapshot every rank has (at
most the step in flight is redone), and goes on. When a whole node is lost the launcher sends the
survivors on in a smaller world instead: they keep the process but build the run again for it
(`rebuild_smaller`), and restore the snapshot resharded.

A replacement rank starts as any rank does (`trainer.loop.train`), but joins the generation the
launcher names, and takes the run's settings from the survivors (`joining_setup`) instead of the
start-up collectives they are no longer in. Anything that goes wrong here ends the process: the
launcher then falls back to a full restart, and its ledger says why. What counts as a lost peer (the
trigger, in trainer.loop) is common.errors.peer_lost."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace

import torch.distributed as dist

from common.clock import wait_until
from common.errors import exception_chain
from common.timing import CONFIRM_S, MOVE_WAIT_S, RELEASE_AFTER_S
from trainer.checkpoint import CheckpointError
from trainer.distributed import torch_compat
from trainer.observability import logs
from trainer.recovery import keys
from trainer.recovery.regroup import Regroup, SmallerWorld
from trainer.resume import resume, start_meters
from trainer.run import Meters, Progress, Run, build, release
from trainer.runtime import fault, protocol

log = logs.get_logger()


def recover(run: Run, meters: Meters, progress: Progress,
            error: BaseException) -> tuple[Run, Progress, Meters]:
    """Survive a lost peer in place; returns the run (rebuilt when the world got smaller), the restored
    progress and fresh meters. Raises (ending the process, so that the launcher restarts the group) when
    it cannot."""
    regroup: Regroup = run.process.regroup
    t_error = time.time()
    generation = keys.next_generation(regroup.generation)
    first_line = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    log.warning("a peer rank was lost (%s): recovering in process, generation %d", first_line, generation)
    # The old generation's times go at once: a record read mid-recovery must not pass for a resumed one.
    run.process.heartbeat.record.update(t_first=0.0, t_load=0.0, t_loaded=0.0)
    run.process.heartbeat.beat("recover", t_error=t_error, recovering=generation)
    cut = regroup.leave()
    regroup.follow_move()  # the launcher moved the store already (its node lost without a word): the new one at once
    try:
        regroup.noticed(generation)
        # At once, before the slower work below: a launcher that sends the survivors on in a smaller world
        # counts the arrivals (launch.recovery.store), on every node.
        regroup.announce(generation, "survivor")
    except dist.DistError:  # the launcher's store: answered below
        pass
    forget_the_step(run)
    abandon_background_work(run)
    close_meters(meters)
    run.process.preemption.restart_agreement()
    t_left = time.time()
    arrived = meet(run, regroup, generation)
    if arrived is None:  # SIGTERM: no group to agree on an emergency checkpoint with
        fault.stop_now(f"SIGTERM during the in-process recovery of generation {generation}: no emergency "
                       f"checkpoint (the groups are not formed); the newest memory snapshot stays for the "
                       f"next launch", protocol.EXIT_PREEMPTED)
    t_joined = time.time()
    old_groups: list = []
    if isinstance(arrived, SmallerWorld):  # a node was lost: go on without it
        run = rebuild_smaller(run, regroup, generation, arrived)
        arrived = {}
    else:
        mapping = regroup.reform(generation)
        rebind(run, mapping)
        old_groups = list(mapping)
        del mapping
    release_elsewhere(error, old_groups)
    t_reformed = time.time()
    run.process.heartbeat.record.update(generation=generation)
    progress = resume(run)
    t_restored = time.time()
    meters = start_meters(run, progress)
    replaced = sorted(r for r, a in arrived.items() if a["who"] == "replacement")
    run.process.heartbeat.beat(None, in_process=True, generation=generation, t_error=t_error, t_left=t_left,
                               t_joined=t_joined, t_reformed=t_reformed, t_restored=t_restored, kept_pid=True,
                               replaced=replaced)
    log.info("in-process recovery: generation %d (world %d) with rank(s) %s replaced; resumed at step %d (%s): "
             "left the groups in %.3fs (%d connection(s) shut), waited %.3fs for the ranks, re-formed in %.3fs, "
             "restored in %.3fs", generation, run.info.world, replaced, progress.state.step, progress.resumed_tier,
             t_left - t_error, cut, t_joined - t_left, t_reformed - t_joined, t_restored - t_reformed)
    return run, progress, meters


def meet(run: Run, regroup: Regroup, generation: int) -> dict[int, dict] | SmallerWorld | None:
    """Say that this rank comes to `generation`, publish the setup, and wait for the others (or the smaller
    world), on the launcher's store. When that store is lost with its node, the launcher moves it to the
    next endpoint of its list and says so (trainer.runtime.protocol.write_store_moved): all of it once more
    there. A store lost with nowhere to move ends this rank (its launcher restarts the group)."""
    bound = run.cfg.fault.node_silence_s + CONFIRM_S + MOVE_WAIT_S  # the launcher's verdict, then the next store
    for moved in (False, True):
        try:
            if moved:
                regroup.noticed(generation)  # for the ranks on the new store
            regroup.announce(generation, "survivor")
            publish_setup(run, regroup, generation)
            return regroup.wait_for_all(generation, stop=lambda: run.process.preemption.received)
        except dist.DistError as e:  # the launcher's store: its node is lost with the rendezvous
            if moved or not regroup.follow_move(bound):
                fault.stop_now(f"the launcher's store stopped answering during the in-process recovery of generation "
                               f"{generation} ({type(e).__name__}: {str(e).splitlines()[0][:120]}), and it did not "
                               f"move within {bound:.0f}s: this rank cannot go on", protocol.EXIT_FAILED)
    return None


def release_elsewhere(error: BaseException, old_groups: list) -> None:
    """Let the failed generation's groups (and the frames of the collective that failed, which hold them) go
    on a thread of their own, later, not on the training thread. A gloo group's destructor waits for its
    worker threads, and one can stay blocked in a receive until the group's timeout (a peer's close queued
    behind unread data): the training thread would stop there, in the new generation, with its peers
    waiting in its first collective."""
    remains: list = [*old_groups]
    for link in exception_chain(error, suppressed=True):
        remains.append(link.__traceback__)
        link.__traceback__ = None
    threading.Thread(target=_release_later, args=(remains,), name="failed-generation", daemon=True).start()


def _release_later(remains: list) -> None:
    time.sleep(RELEASE_AFTER_S)
    remains.clear()


def rebuild_smaller(run: Run, regroup: Regroup, generation: int, world: SmallerWorld) -> Run:
    """The launcher published a smaller world for `generation` (a node was lost under --nnodes MIN:MAX):
    drop the run's model, optimizer, loader and tiers (built for the old world: FSDP2 shards by it), form
    the default group at this rank's new rank, and build the run again in this process (imports, compiled
    kernels' caches and the pid are kept). The state then comes from the memory tier resharded."""
    old = run.info
    log.warning("a node was lost: going on in process as rank %d of %d (was rank %d of %d)", world.rank,
                world.world, old.rank, old.world)
    release(run, None, clean=False)  # the old world's loader and tiers (its meters are closed already)
    regroup.reform_smaller(generation, world, old.backend, old.device)
    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.world))  # as a start in this world would see
    info = replace(old, rank=world.rank, world=world.world)
    logs.setup(rank=info.rank, verbose=info.is_main)
    run.process.heartbeat.renumber(world.rank)  # the launcher knows this rank by its new number too (agent.renumber)
    return build(run.cfg, info, run.process)  # its heartbeat, preemption flag, stall watch and regroup: the same


def forget_the_step(run: Run) -> None:
    """Drop what the interrupted step left: FSDP2's per-iteration state (modules left unsharded, a
    prefetch or reduce-scatter in flight: the next step would skip or add collectives the replacement
    rank runs, and the ranks would deadlock), and the step's partial gradients."""
    reset = getattr(run.model, "reset_iter_state", None)  # public since torch 2.13
    if reset is None:
        raise torch_compat.TorchVersionError("in-process recovery needs FSDPModule.reset_iter_state "
                                             "(torch 2.13 or newer)")
    reset()
    torch_compat.drop_fsdp_unsharded_grads(run.model)
    run.optimizer.zero_grad(set_to_none=True)


def rebind(run: Run, mapping: dict) -> None:
    """Hand the re-formed groups to what holds a group itself: FSDP2, the async stager, the memory tier."""
    torch_compat.rebind_fsdp_groups(run.model, mapping)
    run.checkpointer.rebind_groups(mapping)
    if run.memory is not None:
        run.memory.rebind_groups(mapping)


def abandon_background_work(run: Run) -> None:
    """The failed generation's background saves: a snapshot in flight finishes or fails (its peer copy
    fails fast, the connections being shut); an async checkpoint is dropped uncommitted."""
    if run.memory is not None:
        run.memory.wait()
    run.checkpointer.abandon()


def close_meters(meters: Meters) -> None:
    """Close the instruments of the failed generation (they are started afresh at the restored step)."""
    for close in (lambda: meters.metrics.close(False), meters.comm and meters.comm.close):
        if close:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the recovery matters more than a last record
                log.warning("while recovering: %s: %s", type(e).__name__, e)


def publish_setup(run: Run, regroup: Regroup, generation: int) -> None:
    """What a replacement needs from the start-up collectives it missed: the memory tier's run id and
    interval; and the peak FLOP/s MFU is measured against (on a CPU, measured at a launcher's first start: a
    spare's first rank would spend half a second measuring while its peers wait). Every survivor writes the
    same value; the replacement reads it (`joining_setup`)."""
    memory = run.memory
    setup = {"run_id": memory.setup.run_id if memory is not None else None,
             "every": memory.every if memory is not None else 0,
             "measuring": memory is not None and memory.measuring, "peak": run.flops.peak}
    regroup.store.set(keys.setup_key(generation), json.dumps(setup))


def joining_setup(regroup: Regroup) -> dict:
    """The survivors' `publish_setup` for the generation this replacement joins (bounded wait)."""
    key = keys.setup_key(regroup.generation)
    if not wait_until(lambda: regroup.store.check([key]), regroup.timeout_s, 0.002):
        raise CheckpointError(f"in-process recovery: no survivor published the run's setup within "
                              f"{regroup.timeout_s:.0f}s")
    return json.loads(regroup.store.get(key))
