"""Sharded checkpoints with torch.distributed.checkpoint (DCP) on local disk or any fsspec URL:
collective save with an atomic commit, verification with fallback, retention, async saves, resume.

Layout of one checkpoint:
  <dir>/step-00000120/   __<rank>_0.distcp + .metadata   model and optimizer (DCP), resharded on load
                         train_state.json                step, tokens, data state, RNG per rank, world, config hash
                         COMMIT.json                     written last by rank 0: every file with size + sha256
Protocol: every rank writes its shards and checksums them; success is agreed collectively; only
then rank 0 writes train_state.json and COMMIT.json. A step without a valid COMMIT.json is never
loaded. On resume every rank verifies its share of the files of the newest committed step; any
missing, truncated or corrupt file names itself in a warning and the previous commit is tried.
Steps are deleted only after a newer one is committed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import re
import signal
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as CheckpointException_
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer import ckpt_storage as storage
from trainer.parallel import DistInfo

STEP_DIR = re.compile(r"^step-(\d{8})$")
COMMIT = "COMMIT.json"
TRAIN_STATE = "train_state.json"
# DCP's CheckpointException derives from BaseException, not Exception.
_SAVE_ERRORS = (Exception, CheckpointException_)
CRASH_ENV = "REKINDLE_CRASH_AT"  # fault injection for tests: "<point>@<step>[:rank]", the process SIGKILLs itself


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used."""


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data: dict[str, Any] | None = None
    world: int = 1
    config_sha256: str = ""
    rng: list[str] = field(default_factory=list)  # torch CPU RNG state per rank, base64


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step:08d}"


def _crash_point(point: str, step: int, rank: int) -> None:
    spec = os.environ.get(CRASH_ENV, "")
    if not spec:
        return
    where, _, at = spec.partition("@")
    at_step, _, at_rank = at.partition(":")
    if where == point and int(at_step) == step and (not at_rank or int(at_rank) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when no_dist=True: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _own_files(path: str, rank: int) -> dict[str, dict]:
    """Size and sha256 of the shard files this rank wrote."""
    fs, p = storage.filesystem(path)
    out = {}
    for entry in fs.ls(p, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(f"__{rank}_") and name.endswith(".distcp"):
            out[name] = {"size": int(entry["size"]), "sha256": storage.sha256_file(fs, entry["name"])}
    return out


@dataclass
class _PendingSave:
    state: TrainState
    path: str
    future: Future  # resolves to this rank's {file: {size, sha256}} once its shards are written
    started: float


class Checkpointer:
    """Saves and restores model + optimizer + train state; one instance per rank, all calls collective."""

    def __init__(self, root: str, info: DistInfo, keep: int = 2, keep_every: int = 0, async_: bool = False,
                 on_commit: Callable[[int], None] | None = None) -> None:
        self.root, self.info, self.keep, self.keep_every, self.async_ = root, info, keep, keep_every, async_
        self.on_commit = on_commit  # called on rank 0 with the step once its COMMIT.json is written
        self._pending: _PendingSave | None = None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if async_ else None
        # Async saves run their collectives in a background thread: give them their own group, or
        # gloo aborts on mismatched collectives with the training thread.
        self._group = dist.new_group(backend="gloo") if async_ and info.world > 1 else None
        self.last_blocking_s = 0.0

    # ------------------------------------------------------------------ save
    def save(self, state: TrainState, model: nn.Module, optimizer, blocking: bool = True) -> str:
        """Write step `state.step`. Blocking: returns once committed. Async: returns after staging."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        path = step_dir(self.root, state.step)
        state = TrainState(**{**asdict(state), "rng": self._gather(_rng_state())})
        if self.info.is_main:
            self._clear_uncommitted(path)
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        _crash_point("shards", state.step, self.info.rank)
        if self.async_ and not blocking:
            with _quiet_single_process():
                write = dcp.async_save(sd, storage_writer=storage.writer(path), process_group=self._group,
                                       no_dist=self.info.world == 1)
            future = self._hasher.submit(lambda: (write.result(), _own_files(path, self.info.rank))[1])
            self._pending = _PendingSave(state, path, future, start)
            self.last_blocking_s = time.perf_counter() - start
            return path
        error = ""
        try:
            with _quiet_single_process():
                dcp.save(sd, storage_writer=storage.writer(path), no_dist=self.info.world == 1)
            files = _own_files(path, self.info.rank)
        except _SAVE_ERRORS as e:  # reported collectively below, then raised on every rank
            error, files = f"rank {self.info.rank}: {type(e).__name__}: {e}", {}
        self._commit(state, path, files, error)
        self.last_blocking_s = time.perf_counter() - start
        return path

    def poll(self) -> None:
        """Once per training step: finish a background save when every rank's write is done.
        An error in any rank's background write is raised on every rank here, within one step."""
        if self._pending is None:
            return
        done = self._pending.future.done()
        failed = done and self._pending.future.exception() is not None
        flags = torch.tensor([int(failed), int(not done)])
        if self.info.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] or not flags[1]:
            self._finish_pending()

    def wait(self) -> None:
        """Block until a background save (if any) is committed or has failed (collective)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.future.result()
            self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        try:
            files, error = pending.future.result(), ""
        except _SAVE_ERRORS as e:
            files, error = {}, f"rank {self.info.rank}: background save failed: {type(e).__name__}: {e}"
        self._commit(pending.state, pending.path, files, error)

    def _commit(self, state: TrainState, path: str, files: dict, error: str) -> None:
        """Collective: agree that every rank wrote its shards, then rank 0 commits."""
        results = self._gather((error, files))
        errors = [e for e, _ in results if e]
        if not errors and self.info.is_main:
            _crash_point("commit", state.step, self.info.rank)
            try:
                self._write_commit(state, path, {k: v for _, f in results for k, v in f.items()})
                self.prune()
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank 0: writing {COMMIT} failed: {type(e).__name__}: {e}")
        if not errors and self.info.is_main and self.on_commit:
            self.on_commit(state.step)
        errors = self._broadcast(errors)
        if errors:
            raise CheckpointError(f"checkpoint step {state.step} at {path} was not committed: " + "; ".join(errors))

    def _write_commit(self, state: TrainState, path: str, files: dict) -> None:
        fs, p = storage.filesystem(path)
        with fs.open(f"{p}/{TRAIN_STATE}", "w") as f:
            json.dump(asdict(state), f, indent=1)
        for name in (".metadata", TRAIN_STATE):
            files[name] = {"size": int(fs.size(f"{p}/{name}")), "sha256": storage.sha256_file(fs, f"{p}/{name}")}
        commit = {"step": state.step, "time": time.time(), "world": self.info.world, "files": files}
        with fs.open(f"{p}/{COMMIT}", "w") as f:  # last: the step exists from here on
            json.dump(commit, f, indent=1)

    # ------------------------------------------------------------------ discover, verify, load
    def committed_steps(self) -> list[int]:
        fs, p = storage.filesystem(self.root)
        if not fs.exists(p):
            return []
        steps = []
        for entry in fs.ls(p, detail=False):
            m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m and fs.exists(f"{entry.rstrip('/')}/{COMMIT}"):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _verify_share(self, step: int) -> str:
        """Check this rank's share of the committed files; returns a problem description or ''."""
        path = step_dir(self.root, step)
        fs, p = storage.filesystem(path)
        try:
            commit = json.loads(fs.cat_file(f"{p}/{COMMIT}"))
            files = sorted(commit["files"].items())
        except (FileNotFoundError, ValueError, KeyError, AttributeError) as e:
            return f"{path}/{COMMIT} is unreadable or corrupt ({type(e).__name__})"
        for i, (name, want) in enumerate(files):
            if i % self.info.world != self.info.rank:
                continue
            full = f"{p}/{name}"
            if not fs.exists(full):
                return f"{path}/{name} is missing"
            size = int(fs.size(full))
            if size != want["size"]:
                return f"{path}/{name} is {size} bytes, committed with {want['size']} (truncated?)"
            if storage.sha256_file(fs, full) != want["sha256"]:
                return f"{path}/{name} fails its checksum (corrupt)"
        if self.info.is_main:
            try:
                storage.load_metadata(fs.cat_file(f"{p}/.metadata"))
            except (storage.UnsafeCheckpointError, FileNotFoundError, pickle.UnpicklingError, EOFError) as e:
                return f"{path}/.metadata is unusable: {e}"
        return ""

    def discover_latest(self) -> int | None:
        """Newest committed step that verifies on every rank; the same answer on every rank."""
        candidates = self._broadcast(list(reversed(self.committed_steps())) if self.info.is_main else None)
        for step in candidates:
            problems = [p for p in self._gather(self._verify_share(step)) if p]
            if not problems:
                return step
            if self.info.is_main:
                print(f"[checkpoint] warning: step {step} is unusable, falling back: {problems[0]}", flush=True)
        return None

    def load(self, step: int, model: nn.Module, optimizer) -> TrainState:
        """Load model and optimizer (resharded to this world size) and the train state of `step`."""
        path = step_dir(self.root, step)
        fs, p = storage.filesystem(path)
        storage.load_metadata(fs.cat_file(f"{p}/.metadata"))  # refuses code before DCP reads anything
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        with _quiet_single_process():
            dcp.load(sd, storage_reader=storage.reader(path), no_dist=self.info.world == 1)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        state = TrainState(**json.loads(fs.cat_file(f"{p}/{TRAIN_STATE}")))
        if state.world == self.info.world and len(state.rng) == self.info.world:
            rng = base64.b64decode(state.rng[self.info.rank])
            torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
        return state

    # ------------------------------------------------------------------ retention
    def prune(self) -> list[int]:
        """Rank 0: keep the newest `keep` committed steps (and multiples of keep_every); delete the rest,
        and uncommitted leftovers older than the newest commit (crashed saves)."""
        steps = self.committed_steps()
        doomed = [s for s in steps[: -self.keep] if not (self.keep_every and s % self.keep_every == 0)]
        fs, root = storage.filesystem(self.root)
        for step in doomed:
            _, p = storage.filesystem(step_dir(self.root, step))
            fs.rm(f"{p}/{COMMIT}")  # uncommit first: a half-deleted step is then never loaded
            fs.rm(p, recursive=True)
        if steps:
            for entry in fs.ls(root, detail=False):
                m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
                if m and int(m.group(1)) < steps[-1] and int(m.group(1)) not in steps:
                    fs.rm(entry, recursive=True)
        return doomed

    def _clear_uncommitted(self, path: str) -> None:
        fs, p = storage.filesystem(path)
        if fs.exists(p) and not fs.exists(f"{p}/{COMMIT}"):
            fs.rm(p, recursive=True)

    # ------------------------------------------------------------------ collectives (world 1: no-ops)
    def _gather(self, obj: Any) -> list[Any]:
        if self.info.world == 1:
            return [obj]
        out: list[Any] = [None] * self.info.world
        dist.all_gather_object(out, obj)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self.info.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _barrier(self) -> None:
        if self.info.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
