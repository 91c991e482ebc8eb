"""The collective side of checkpoints: `Checkpointer`, one per rank, whose every public method is a
collective call (all ranks call it, in the same order): save (sync or async), commit (agree that
every rank wrote its shards, then rank 0 commits), discover the newest usable step (every rank
verifies its share), and load (resharded to this world size). The files and rules it relies on are
in `commit` (no collectives), `format` (bytes on disk), `spool` and `staging`."""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from common import storage
from trainer.checkpoint import commit, writing
from trainer.checkpoint import format as shard_format
from trainer.checkpoint.commit import TrainState, step_dir
from trainer.checkpoint.format import SAVE_ERRORS, CheckpointError, CheckpointStorageError, IncompatibleCheckpointError
from trainer.checkpoint.spool import Spool
from trainer.checkpoint.staging import AsyncStager
from trainer.config import CheckpointConfig
from trainer.distributed.parallel import DistInfo
from trainer.runtime import fault

log = logging.getLogger("rekindle.checkpoint")


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Parameters registered under several names (tied embeddings): {other name: first name}, with the
    names `get_state_dict` uses (no activation-checkpoint or compile wrappers)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _check_shapes(metadata: Any, model_sd: dict, path: str) -> None:
    """Refuse a checkpoint whose model tensors have other shapes than this model's (a changed model
    config), naming them, before DCP fails on the first with a size mismatch."""
    wrong = []
    for name, tensor in model_sd.items():
        stored = metadata.state_dict_metadata.get(f"model.{name}")
        if isinstance(stored, TensorStorageMetadata) and tuple(stored.size) != tuple(tensor.shape):
            wrong.append(f"{name} is {list(stored.size)} there, {list(tensor.shape)} here")
    if wrong:
        raise IncompatibleCheckpointError(f"{path} holds another model ({'; '.join(wrong[:3])}"
                                          f"{f'; and {len(wrong) - 3} more' if len(wrong) > 3 else ''}): resume "
                                          "with the model settings it was trained with, or set another checkpoint.dir")


@dataclass
class _PendingSave:
    state: TrainState
    path: str
    future: Future  # this rank's {file: {size, checksum}} once its shards are written
    required: bool  # a failure raises (else: a warning, up to max_failed_saves in a row)


class _Collectives:
    """all_gather / broadcast / barrier of picklable objects; no-ops at world size 1."""

    def __init__(self, world: int) -> None:
        self.world = world

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _as_shared(e: Exception, doing: str) -> tuple[str, bool]:
    """An error raised on one rank, as (message, storage could not be used) for the others."""
    message = str(e) if isinstance(e, CheckpointError) else f"{doing}: {e!r}"
    return message, storage.caused_by_storage(e) is not None


def _raised(error: tuple[str, bool]) -> CheckpointError:
    message, unavailable = error
    return CheckpointStorageError(message) if unavailable else CheckpointError(message)


class Checkpointer:
    """Saves and restores model + optimizer + train state; one instance per rank. Collective (every
    rank calls them, in the same order): save, poll, wait, list_committed, discover_latest, load."""

    def __init__(self, root: str, info: DistInfo, settings: CheckpointConfig | None = None, *,
                 on_event: Callable[..., None] | None = None, stalls: storage.StallWatch | None = None) -> None:
        self.root, self.info = root, info
        # What it reads of the settings: every, keep, keep_every, async_, max_failed_saves, and the shard
        # format of the steps it writes (format: "raw" | "dcp"; a step of either is loaded).
        self.settings = settings or CheckpointConfig()
        # Called on rank 0 with (event name, **fields): "commit" once a step's COMMIT.json is written, failed
        # saves, fallbacks.
        self.on_event = on_event
        self.failed_in_a_row = 0
        self._all = _Collectives(info.world)
        self._stager = AsyncStager(info.device, info.world) if self.settings.async_ else None
        self._pending: _PendingSave | None = None
        self._save_s = 0.0
        self._spool = Spool()
        self._unusable: set[int] = set()  # committed steps that failed to verify (deleted once one is newer)
        self._stalls = stalls or storage.StallWatch(0, lambda _: None)  # bounds the waits on the storage

    @property
    def last_blocking_s(self) -> float:
        """Time the last save() held the caller, plus any wait of optimizer.step() for its async copy."""
        return self._save_s + (self._stager.waited_s if self._stager else 0.0)

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, final: bool) -> bool:
        """Every `checkpoint.every` steps (0: never) and at the final step."""
        every = self.settings.every
        return bool(every and step % every == 0) or final

    def save(self, state: TrainState, model: nn.Module, optimizer, blocking: bool = True,
             required: bool = True) -> str | None:
        """Write step `state.step`. Blocking: returns once committed. Async: returns once the copy of
        the state has started; `optimizer.step()` waits for the copy to finish. A save that is not
        `required` may fail `max_failed_saves` times in a row: each failure is a warning on every rank
        (and a `checkpoint_failed` event), its partial files are deleted, and training goes on. Returns
        the step's path, or None when a blocking save failed that way."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        if self._stager is not None:
            self._stager.waited_s = 0.0  # what an earlier save's copy held up is not this save's
        path = step_dir(self.root, state.step)
        state = TrainState(**{**asdict(state), "rng": self._all.gather(_rng_state()), "tied": tied_parameters(model)})
        if self.info.is_main:
            commit.clear_uncommitted(path)
        self._all.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        injected = fault.write_fault(state.step, self.info.rank)
        if self._stager is not None and not blocking:
            future = self._stager.submit(sd, optimizer, lambda copy, group: self._write(copy, path, injected, group))
            self._pending = _PendingSave(state, path, future, required)
            self._save_s = time.perf_counter() - start
            return path
        error, unavailable = "", False
        try:
            files = self._write(sd, path, injected, None)
        except SAVE_ERRORS as e:  # reported collectively below, then raised on every rank
            error, files = shard_format.describe_error(e, self.info.rank), {}
            unavailable = storage.caused_by_storage(e) is not None
        committed = self._commit(state, path, files, error, required, unavailable)
        self._save_s = time.perf_counter() - start
        return path if committed else None

    def _write(self, sd: dict, path: str, injected, group) -> dict[str, dict]:
        """DCP-write this rank's shards; returns {file: {size, checksum}} of the files it wrote."""
        writer = writing.writer(path, injected, self.settings.format)
        with self._stalls.guard("writing a checkpoint", path):
            with shard_format.quiet_single_process():
                dcp.save(sd, storage_writer=writer, process_group=group, no_dist=self.info.world == 1)
            fs, p = storage.filesystem(path)
            for name, info in writer.digests.items():  # a stat, not a re-read: catches short writes
                if int(fs.size(f"{p}/{name}")) != info["size"]:
                    raise OSError(f"{path}/{name} is {fs.size(f'{p}/{name}')} bytes after writing {info['size']}")
        return dict(writer.digests)

    def poll(self) -> None:
        """Once per training step: finish a background save when every rank's write is done.
        An error in any rank's background write is raised on every rank here, within one step."""
        if self._pending is None:
            return
        done = self._pending.future.done()
        failed = done and self._pending.future.exception() is not None
        flags = torch.tensor([int(failed), int(not done)], device=self.info.device)  # NCCL: a GPU tensor
        if self.info.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] or not flags[1]:
            self._finish_pending()

    def wait(self) -> None:
        """Block until a background save (if any) is committed or has failed (collective)."""
        if self._pending is not None:
            with contextlib.suppress(*SAVE_ERRORS):
                self._pending.future.result()
            self._finish_pending()

    def abandon(self, timeout_s: float = 30.0) -> None:
        """In-process recovery: drop a background save of the failed generation without committing it
        (local: its collectives fail fast once the groups' connections are shut; bounded)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.future.result(timeout=timeout_s)

    def rebind_groups(self, mapping: dict) -> None:
        """In-process recovery: the async stager's group, re-formed (trainer.recovery.regroup)."""
        if self._stager is not None and self._stager.group is not None:
            self._stager.group = mapping[self._stager.group]

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        try:
            files, error, unavailable = pending.future.result(), "", False
        except SAVE_ERRORS as e:
            files, error = {}, f"background save failed: {shard_format.describe_error(e, self.info.rank)}"
            unavailable = storage.caused_by_storage(e) is not None
        self._commit(pending.state, pending.path, files, error, pending.required, unavailable)

    def _commit(self, state: TrainState, path: str, files: dict, error: str, required: bool = True,
                unavailable: bool = False) -> bool:
        """Agree that every rank wrote its shards, then rank 0 commits; an error reaches every rank (as
        CheckpointStorageError when some rank could not use the storage: it may come back)."""
        results = self._all.gather((error, files, unavailable))
        errors = list(dict.fromkeys(e for e, _, _ in results if e))  # a DCP error reaches every rank: say it once
        unavailable = any(u for _, _, u in results)
        if not errors and self.info.is_main:
            fault.crash_point("commit", state.step, self.info.rank)
            try:
                with self._stalls.guard("committing a checkpoint", path):
                    commit.write_commit(self.root, path, state, {k: v for _, f, _ in results for k, v in f.items()},
                                        self.info.world)
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank 0: committing failed: {type(e).__name__}: {e}")
                unavailable = storage.caused_by_storage(e) is not None
            else:
                self._after_commit(state.step)
        errors, unavailable = self._all.broadcast((errors, unavailable))
        if not errors:
            self.failed_in_a_row = 0
            return True
        message = f"checkpoint step {state.step} at {path} was not committed: " + "; ".join(errors)
        self.failed_in_a_row += 1
        if required or self.failed_in_a_row > self.settings.max_failed_saves:
            log.error("%s", message)  # on every rank (the others say which rank they are)
            raise (CheckpointStorageError if unavailable else CheckpointError)(message)
        log.warning("%s (%d of %d failed saves in a row allowed; training goes on from the previous commit)",
                    message, self.failed_in_a_row, self.settings.max_failed_saves)
        if self.info.is_main:
            self._event("checkpoint_failed", step=state.step, error="; ".join(errors))
            with contextlib.suppress(Exception):  # the partial step must not keep the disk full
                commit.clear_uncommitted(path)
        return False

    def _event(self, name: str, **fields: Any) -> None:
        """Rank 0: record an event; a failure to record it is a warning, never a failed save."""
        if self.on_event is not None:
            try:
                self.on_event(name, **fields)
            except Exception as e:  # noqa: BLE001
                log.warning("could not record the %s event: %s: %s", name, type(e).__name__, e)

    def _after_commit(self, step: int) -> None:
        """Rank 0, once `step` is committed: prune and record it. Neither may fail the save (nor keep
        rank 0 from the broadcast that follows)."""
        def prune() -> None:
            commit.prune(self.root, step, self.settings.keep, self.settings.keep_every, frozenset(self._unusable))
            self._unusable.difference_update([s for s in self._unusable if s >= step])  # gone, or re-saved

        for what, then in (("deleting old steps", prune),
                           ("recording the commit", lambda: self.on_event and self.on_event("commit", step=step))):
            try:
                then()
            except Exception as e:  # noqa: BLE001
                log.warning("step %d is committed, but %s failed: %s: %s", step, what, type(e).__name__, e)

    # ------------------------------------------------------------------ discover, verify, load
    def list_committed(self) -> list[int]:
        """`commit.committed_steps` of rank 0, on every rank; or CheckpointError on every rank (not a
        collective timeout) when listing fails."""
        listing = None
        if self.info.is_main:
            try:
                listing = (None, commit.committed_steps(self.root))
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                listing = (_as_shared(e, f"listing {self.root}"), [])
        error, steps = self._all.broadcast(listing)
        if error:
            raise _raised(error)
        return steps

    def discover_latest(self) -> int | None:
        """Newest committed step that verifies on every rank; the same answer on every rank."""
        error = None
        for step in reversed(self.list_committed()):
            try:
                problem = self._verify_share(step)
            except Exception as e:  # noqa: BLE001 - storage unreachable (or a bug): stop on every rank
                problem, error = "", _as_shared(e, f"verifying step {step}")
            results = self._all.gather((problem, error))
            error = next((e for _, e in results if e), None)
            problems = [p for p, _ in results if p]
            if error:
                break
            if not problems:
                return step
            self._unusable.add(step)
            if self.info.is_main:
                log.warning("step %d is unusable, falling back: %s", step, problems[0])
                self._event("fallback", step=step, problem=problems[0])
        self._spool.drop()
        if error:
            raise _raised(error)
        return None

    def _verify_share(self, step: int) -> str:
        """Verify this rank's share of `step`; for a remote checkpoint the verified files stay in the
        spool until `load` reads them (one download per file, and the bytes loaded are the bytes verified)."""
        self._spool.drop()
        spool = None if storage.is_local(self.root) else self._spool.open(step)
        return commit.verify(step_dir(self.root, step), self.info.rank, self.info.world, spool)

    def load(self, step: int, model: nn.Module, optimizer,
             check: Callable[[TrainState], None] | None = None) -> TrainState:
        """Load model and optimizer (resharded to this world size) and the train state of `step`.
        `check` is given the train state before any tensor is read, and may refuse it by raising."""
        path = step_dir(self.root, step)
        state = commit.read_train_state(path)
        if check is not None:
            check(state)
        fs, p = storage.filesystem(path)
        metadata = shard_format.load_metadata(fs.cat_file(f"{p}/.metadata"))  # refuses code before DCP reads
        model_sd, optim_sd = get_state_dict(model, optimizer)
        _check_shapes(metadata, model_sd, path)
        sd = {"model": model_sd, "optim": optim_sd}
        try:
            shard_format.load_state(sd, path, self.info.world == 1, self._spool.files(step))
        finally:
            self._spool.drop()
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if state.world == self.info.world and len(state.rng) == self.info.world:
            rng = base64.b64decode(state.rng[self.info.rank])
            torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
        return state

    def close(self, wait: bool = True) -> None:
        """Release the spool and the background writer (local: no collective). `wait=False` (after an
        error) does not wait for a background write, which may be stuck in a collective with a dead peer."""
        self._spool.drop()
        if self._stager is not None:
            self._stager.close(wait)
