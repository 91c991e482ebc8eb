"""Sharded checkpoints with torch.distributed.checkpoint (DCP) on local disk or any fsspec URL:
collective save with an atomic commit, verification with fallback, retention, async saves, resume.

Layout of one checkpoint:
  <dir>/step-00000120/   __<rank>_0.distcp + .metadata   model and optimizer (DCP), resharded on load; each
                                                         tensor chunk stored as its raw bytes (format:
                                                         ckpt_storage), objects torch.save'd
                         train_state.json                step, tokens, data state, RNG per rank, world, config
                                                         hash, tied parameter names
                         COMMIT.json                     written last by rank 0: every file with size + checksum
                                                         (xxh3-128), and a sha256 of COMMIT.json's own content
Protocol: every rank writes its shards (rank 0 also `.metadata`), hashing them as they are written;
success is agreed collectively; only then rank 0 writes train_state.json and COMMIT.json. A step
without a valid COMMIT.json is never loaded. On resume every rank verifies its share of the files of the newest
committed step (rank r the shard file of rank r, the one it loads at an unchanged world size); any
missing, truncated, corrupt or unreadable file names itself in a warning and the previous commit is
tried (unreachable storage is an error on every rank instead). A remote file is downloaded once:
verification copies it to a local spool directory while hashing it, and the load reads the copy.
Locally, train_state.json and COMMIT.json are written durably (temp file, fsync, rename, directory
fsync). Retention runs after each commit of step s: it keeps the newest `keep` steps up to s (and
keep_every multiples) and deletes the newer steps this run fell back past; a step is deleted only
after a newer one is committed, and a failure while deleting does not undo the commit.

Async saves (`async_=True, blocking=False`) return after a few milliseconds: a background thread
copies the state into a reused CPU buffer, then writes it. Until the copy is done the tensors must
not change, so the Checkpointer hooks `optimizer.step()` (the only thing in a training step that
changes them) to wait for it; forward and backward overlap with the copy.

Fault injection for tests, `REKINDLE_CRASH_AT="<point>@<step>[:rank]"`: `shards` SIGKILLs the rank
in the middle of writing its shard file, `commit` SIGKILLs rank 0 after every shard is written but
before COMMIT.json, `write-error` makes the shard write fail with ENOSPC (disk full).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException as CheckpointException_
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from data.shards import store_unreachable, unreachable_as
from trainer import ckpt_storage as storage
from trainer.ckpt_storage import CheckpointError
from trainer.parallel import DistInfo

__all__ = ["COMMIT", "TRAIN_STATE", "CheckpointError", "Checkpointer", "TrainState", "step_dir", "verify"]

STEP_DIR = re.compile(r"^step-(\d{8})$")
COMMIT = "COMMIT.json"
TRAIN_STATE = "train_state.json"
# DCP's CheckpointException derives from BaseException, not Exception.
_SAVE_ERRORS = (Exception, CheckpointException_)
CRASH_ENV = "REKINDLE_CRASH_AT"
_FAULT_AFTER_BYTES = 4096  # `shards` / `write-error` fire once this much of the shard file is written


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data: dict[str, Any] | None = None
    world: int = 1
    config_sha256: str = ""
    rng: list[str] = field(default_factory=list)  # torch CPU RNG state per rank, base64
    tied: dict[str, str] = field(default_factory=dict)  # parameter name -> the name it shares its tensor with


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step:08d}"


def _injected(point: str, step: int, rank: int) -> bool:
    spec = os.environ.get(CRASH_ENV, "")
    if not spec:
        return False
    where, _, at = spec.partition("@")
    at_step, _, at_rank = at.partition(":")
    return where == point and int(at_step) == step and (not at_rank or int(at_rank) == rank)


def _crash_point(point: str, step: int, rank: int) -> None:
    if _injected(point, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _write_fault(step: int, rank: int) -> storage.Fault | None:
    """The injected fault (if any) for this rank's shard write of `step`."""
    if _injected("shards", step, rank):
        def fault(written: int) -> None:
            if written >= _FAULT_AFTER_BYTES:
                os.kill(os.getpid(), signal.SIGKILL)
        return fault
    if _injected("write-error", step, rank):
        def fault(written: int) -> None:
            if written >= _FAULT_AFTER_BYTES:
                raise OSError(errno.ENOSPC, f"No space left on device (injected by {CRASH_ENV})")
        return fault
    return None


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when no_dist=True: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _describe(e: BaseException, rank: int) -> str:
    """One line for an error on `rank`. DCP's CheckpointException carries (exception, traceback) of the
    ranks that failed, and reaches every rank: name those ranks, not the one reporting it."""
    if isinstance(e, CheckpointException_) and e.failures:
        return "; ".join(_describe(f[0] if isinstance(f, tuple) else f, r) for r, f in sorted(e.failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


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


def _commit_digest(commit: dict) -> str:
    body = {k: v for k, v in commit.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_commit(path: str) -> dict:
    """COMMIT.json of the step at `path`, checked against its own checksum. Raises FileNotFoundError or
    ValueError (with the reason) if it is missing, unreadable or altered."""
    fs, p = storage.filesystem(path)
    commit = json.loads(fs.cat_file(f"{p}/{COMMIT}"))
    if not isinstance(commit, dict) or not isinstance(commit.get("files"), dict):
        raise ValueError("not a commit record")
    if commit.get("sha256") != _commit_digest(commit):
        raise ValueError("its content does not match its checksum")
    return commit


_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _verifier(name: str, index: int, world: int) -> int:
    """The rank that verifies file `name` (the index-th committed file): the shard file of rank r
    goes to rank r (mod world), so on a resume at the same world size each rank verifies the file it
    is about to load; the other files go round robin."""
    m = _SHARD_FILE.match(name)
    return (int(m.group(1)) if m else index) % world


def verify(path: str, rank: int = 0, world: int = 1, spool: str | None = None) -> str:
    """Check share `rank` of `world` of the files committed at `path` (sizes, checksums; rank 0 also
    parses `.metadata` safely). Returns a description of the first problem, or '' if none.

    With `spool` (a local directory) and a remote checkpoint, each file of the share is downloaded
    there once and checksummed on the way; the copies that verify stay there under their names, for
    the load to read instead of downloading them again. Without room for the copy, a file is checked
    remotely as without `spool`. A file that cannot be read (EIO) is a problem like a corrupt one;
    storage that cannot be reached at all raises CheckpointError (no step is usable or unusable then)."""
    with unreachable_as(CheckpointError, f"cannot read checkpoint storage at {path}"):
        return _verify_files(path, rank, world, spool)


def _verify_files(path: str, rank: int, world: int, spool: str | None) -> str:
    fs, p = storage.filesystem(path)
    spool = spool if storage.is_remote(path) else None
    try:
        files = sorted(read_commit(path)["files"].items())
    except FileNotFoundError:
        return f"{path}/{COMMIT} is missing"
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        return f"{path}/{COMMIT} is unreadable or corrupt ({type(e).__name__}: {e})"
    for i, (name, want) in enumerate(files):
        if _verifier(name, i, world) != rank:
            continue
        try:
            problem = _verify_file(fs, p, path, name, want, spool)
        except OSError as e:
            if store_unreachable(e):
                raise
            problem = f"{path}/{name} is unreadable ({type(e).__name__}: {e})"  # e.g. EIO: a bad sector
        if problem:
            return problem
    if rank == 0:
        try:
            storage.load_metadata(fs.cat_file(f"{p}/.metadata"))
        except Exception as e:  # noqa: BLE001 - any failure to parse means unusable
            if store_unreachable(e):
                raise
            return f"{path}/.metadata is unusable: {type(e).__name__}: {e}"
    return ""


def _verify_file(fs, p: str, path: str, name: str, want: dict, spool: str | None) -> str:
    """One committed file of `path` (`p` within `fs`): '' if its size and checksum match `want`, else the problem."""
    full = f"{p}/{name}"
    if not fs.exists(full):
        return f"{path}/{name} is missing"
    size = int(fs.size(full))
    if size != want["size"]:
        return f"{path}/{name} is {size} bytes, committed with {want['size']} (truncated?)"
    algorithm = next((a for a in storage.CHECKSUMS if a in want), None)
    if algorithm is None:
        return f"{path}/{COMMIT} has no checksum for {name}"
    digest, local = None, os.path.join(spool, name) if spool else None
    if local:
        try:
            digest = storage.checksum_file(fs, full, algorithm, copy_to=local)
        except storage.SpoolError:
            with contextlib.suppress(OSError):
                os.unlink(local)
    if digest is None:
        digest = storage.checksum_file(fs, full, algorithm)
    if digest != want[algorithm]:
        if local:
            with contextlib.suppress(OSError):
                os.unlink(local)
        return f"{path}/{name} fails its checksum (corrupt)"
    return ""


def load_state(sd: dict, path: str, no_dist: bool = True, local: dict[str, str] | None = None) -> None:
    """DCP-load the checkpoint at `path` into the tensors of `sd` (resharding as needed), unpickling
    nothing but plain data; `local`: verified local copies of remote files (see `verify`). A refused
    item raises UnsafeCheckpointError, other failures CheckpointError."""
    try:
        with _quiet_single_process():
            dcp.load(sd, storage_reader=storage.reader(path, local), planner=storage.SafeLoadPlanner(),
                     no_dist=no_dist)
    except CheckpointException_ as e:
        for cause in (f[0] if isinstance(f, tuple) else f for f in e.failures.values()):
            if isinstance(cause, storage.UnsafeCheckpointError):
                raise storage.UnsafeCheckpointError(str(cause)) from None
        raise CheckpointError(f"loading {path} failed: {_describe(e, 0)}") from None


_SPOOL_PREFIX = "rekindle-ckpt-"


def _spool_namespace() -> str:
    """`rekindle-ckpt-<pid namespace>-`: a pid is only meaningful inside its pid namespace
    (containers sharing one temp directory may each have a process 42)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{_SPOOL_PREFIX}{namespace}-"


def _spool_prefix(pid: int | None = None) -> str:
    """Name prefix of the spool directories of process `pid` (default: this one)."""
    return f"{_spool_namespace()}{os.getpid() if pid is None else pid}-"


def _sweep_spools() -> None:
    """Delete the spool directories of this pid namespace's processes that no longer exist (a rank
    killed while verifying)."""
    ours = _spool_namespace()
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            pid = entry.name.removeprefix(ours).split("-", 1)[0]
            if entry.name.startswith(ours) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: somebody else's process
        return True
    return True


@dataclass
class _PendingSave:
    state: TrainState
    path: str
    future: Future  # resolves to this rank's {file: {size, checksum}} once its shards are written
    started: float


class Checkpointer:
    """Saves and restores model + optimizer + train state; one instance per rank, all calls collective."""

    def __init__(self, root: str, info: DistInfo, keep: int = 2, keep_every: int = 0, async_: bool = False,
                 on_commit: Callable[[int], None] | None = None) -> None:
        self.root, self.info, self.keep, self.keep_every, self.async_ = root, info, keep, keep_every, async_
        self.on_commit = on_commit  # called on rank 0 with the step once its COMMIT.json is written
        self._pending: _PendingSave | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if async_ else None
        # Async saves run their collectives in a background thread: give them their own group, or
        # gloo aborts on mismatched collectives with the training thread.
        self._group = dist.new_group(backend="gloo") if async_ and info.world > 1 else None
        self._buffer: dict | None = None  # CPU copy of the state for async saves, reused
        self._staged = threading.Event()
        self._staged.set()
        self._hooks: dict[int, Any] = {}
        self.last_blocking_s = 0.0  # time the last save() held the caller, plus any wait for its copy
        self._spool: tuple[int, str, weakref.finalize] | None = None  # (step, dir, remover): verified copies
        self._unusable: set[int] = set()  # committed steps that failed to verify (deleted once one is newer)

    # ------------------------------------------------------------------ save
    def save(self, state: TrainState, model: nn.Module, optimizer, blocking: bool = True) -> str:
        """Write step `state.step`. Blocking: returns once committed. Async: returns once the copy of
        the state has started; `optimizer.step()` waits for the copy to finish."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        path = step_dir(self.root, state.step)
        state = TrainState(**{**asdict(state), "rng": self._gather(_rng_state()), "tied": tied_parameters(model)})
        if self.info.is_main:
            self._clear_uncommitted(path)
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        fault = _write_fault(state.step, self.info.rank)
        if self.async_ and not blocking:
            self._hook(optimizer)
            self._staged = threading.Event()
            future = self._writer.submit(self._stage_and_write, sd, path, fault, self._staged)
            self._pending = _PendingSave(state, path, future, start)
            self.last_blocking_s = time.perf_counter() - start
            return path
        error = ""
        try:
            files = self._write(sd, path, fault, None)
        except _SAVE_ERRORS as e:  # reported collectively below, then raised on every rank
            error, files = _describe(e, self.info.rank), {}
        self._commit(state, path, files, error)
        self.last_blocking_s = time.perf_counter() - start
        return path

    def _write(self, sd: dict, path: str, fault: storage.Fault | None, group) -> dict[str, dict]:
        """DCP-write this rank's shards; returns {file: {size, checksum}} of the files it wrote."""
        writer = storage.writer(path, fault)
        with _quiet_single_process():
            dcp.save(sd, storage_writer=writer, process_group=group, no_dist=self.info.world == 1)
        fs, p = storage.filesystem(path)
        for name, info in writer.digests.items():  # a stat, not a re-read: catches short writes
            if int(fs.size(f"{p}/{name}")) != info["size"]:
                raise OSError(f"{path}/{name} is {fs.size(f'{p}/{name}')} bytes after writing {info['size']}")
        return dict(writer.digests)

    def _stage_and_write(self, sd: dict, path: str, fault: storage.Fault | None, staged: threading.Event) -> dict:
        """Background thread: copy the live tensors into the CPU buffer, release the optimizer, write."""
        try:
            copy = self._stage(sd)
        finally:
            staged.set()  # on failure too: the error is raised on every rank by poll()
        return self._write(copy, path, fault, self._group)

    @torch.no_grad()
    def _stage(self, sd: dict) -> dict:
        if self._buffer is not None:
            try:
                return _copy_state_dict(sd, self._buffer)
            except Exception:  # noqa: BLE001 - the state's structure changed (e.g. CompanionMismatch): new buffer
                self._buffer = None
        self._buffer = _create_cpu_state_dict(sd, pin_memory=self.info.device.type == "cuda")
        return _copy_state_dict(sd, self._buffer)

    def _hook(self, optimizer) -> None:
        if id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(lambda *_: self.wait_staged())

    def wait_staged(self) -> None:
        """Block until the background copy of an async save is done (then the tensors may change)."""
        if not self._staged.is_set():
            start = time.perf_counter()
            self._staged.wait()
            self.last_blocking_s += time.perf_counter() - start

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
            with contextlib.suppress(*_SAVE_ERRORS):
                self._pending.future.result()
            self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        try:
            files, error = pending.future.result(), ""
        except _SAVE_ERRORS as e:
            files, error = {}, f"background save failed: {_describe(e, self.info.rank)}"
        self._commit(pending.state, pending.path, files, error)

    def _commit(self, state: TrainState, path: str, files: dict, error: str) -> None:
        """Collective: agree that every rank wrote its shards, then rank 0 commits."""
        results = self._gather((error, files))
        errors = list(dict.fromkeys(e for e, _ in results if e))  # a DCP error reaches every rank: say it once
        if not errors and self.info.is_main:
            _crash_point("commit", state.step, self.info.rank)
            try:
                self._write_commit(state, path, {k: v for _, f in results for k, v in f.items()})
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank 0: writing {COMMIT} failed: {type(e).__name__}: {e}")
            else:  # committed: what follows must not fail the save (nor keep rank 0 from the broadcast)
                for what, then in (("deleting old steps", lambda: self.prune(state.step)),
                                   ("recording the commit", lambda: self.on_commit and self.on_commit(state.step))):
                    try:
                        then()
                    except Exception as e:  # noqa: BLE001
                        print(f"[checkpoint] warning: step {state.step} is committed, but {what} failed: "
                              f"{type(e).__name__}: {e}", flush=True)
        errors = self._broadcast(errors)
        if errors:
            message = f"checkpoint step {state.step} at {path} was not committed: " + "; ".join(errors)
            print(f"[checkpoint] rank {self.info.rank}: error: {message}", flush=True)
            raise CheckpointError(message)

    def _write_commit(self, state: TrainState, path: str, files: dict) -> None:
        """`files`: what the ranks wrote, `.metadata` included (rank 0's DCP writer hashed it)."""
        fs, p = storage.filesystem(path)
        body = json.dumps(asdict(state), indent=1).encode()
        storage.write_durably(f"{path}/{TRAIN_STATE}", body)
        files[TRAIN_STATE] = {"size": len(body), storage.CHECKSUM: storage.checksum_bytes(body)}
        if ".metadata" not in files:  # not seen being written (a writer that bypasses the hashing): read it
            full = f"{p}/.metadata"
            files[".metadata"] = {"size": int(fs.size(full)), storage.CHECKSUM: storage.checksum_file(fs, full)}
        commit = {"step": state.step, "time": time.time(), "world": self.info.world, "files": files}
        commit["sha256"] = _commit_digest(commit)
        storage.write_durably(f"{path}/{COMMIT}", json.dumps(commit, indent=1).encode())  # last: the step exists
        if not storage.is_remote(self.root):
            storage.fsync_dir(storage.filesystem(self.root)[1])  # ... and its directory too, before prune() deletes

    # ------------------------------------------------------------------ discover, verify, load
    def committed_steps(self) -> list[int]:
        fs, p = storage.filesystem(self.root)
        with unreachable_as(CheckpointError, f"cannot reach checkpoint storage {self.root}"):
            if not fs.exists(p):
                return []
            steps = []
            for entry in fs.ls(p, detail=False):
                m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
                if m and fs.exists(f"{entry.rstrip('/')}/{COMMIT}"):
                    steps.append(int(m.group(1)))
        return sorted(steps)

    def _verify_share(self, step: int) -> str:
        """Verify this rank's share of `step`; for a remote checkpoint the verified files stay in a
        local spool directory until `load` reads them (one download per file, and the bytes loaded
        are the bytes verified)."""
        self._drop_spool()
        spool = None
        if storage.is_remote(self.root):
            _sweep_spools()
            with contextlib.suppress(OSError):  # no temp directory: verify remotely, load remotely
                spool = tempfile.mkdtemp(prefix=_spool_prefix())
        if spool:  # removed by load(), the next verification, close(), or at exit at the latest
            self._spool = (step, spool, weakref.finalize(self, shutil.rmtree, spool, True))
        return verify(step_dir(self.root, step), self.info.rank, self.info.world, spool)

    def _drop_spool(self) -> None:
        if self._spool is not None:
            self._spool[2]()
            self._spool = None

    def list_committed(self) -> list[int]:
        """Collective `committed_steps()`: rank 0 lists, every rank gets the list, or every rank raises
        CheckpointError (not left to a collective timeout) when listing fails."""
        listing = None
        if self.info.is_main:
            try:
                listing = ("", self.committed_steps())
            except Exception as e:  # noqa: BLE001 - said on every rank below
                listing = (str(e) if isinstance(e, CheckpointError) else f"listing {self.root}: {e!r}", [])
        error, steps = self._broadcast(listing)
        if error:
            raise CheckpointError(error)
        return steps

    def discover_latest(self) -> int | None:
        """Newest committed step that verifies on every rank; the same answer on every rank."""
        error = ""
        for step in reversed(self.list_committed()):
            try:
                problem = self._verify_share(step)
            except Exception as e:  # noqa: BLE001 - storage unreachable (or a bug): stop on every rank
                problem, error = "", str(e) if isinstance(e, CheckpointError) else f"verifying step {step}: {e!r}"
            results = self._gather((problem, error))
            error = next((e for _, e in results if e), "")
            problems = [p for p, _ in results if p]
            if error:
                break
            if not problems:
                return step
            self._unusable.add(step)
            if self.info.is_main:
                print(f"[checkpoint] warning: step {step} is unusable, falling back: {problems[0]}", flush=True)
        self._drop_spool()
        if error:
            raise CheckpointError(error)
        return None

    def load(self, step: int, model: nn.Module, optimizer) -> TrainState:
        """Load model and optimizer (resharded to this world size) and the train state of `step`."""
        path = step_dir(self.root, step)
        fs, p = storage.filesystem(path)
        storage.load_metadata(fs.cat_file(f"{p}/.metadata"))  # refuses code before DCP reads anything
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        local = {}
        if self._spool is not None and self._spool[0] == step:
            local = {name: os.path.join(self._spool[1], name) for name in os.listdir(self._spool[1])}
        try:
            load_state(sd, path, self.info.world == 1, local)
        finally:
            self._drop_spool()
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        state = TrainState(**json.loads(fs.cat_file(f"{p}/{TRAIN_STATE}")))
        if state.world == self.info.world and len(state.rng) == self.info.world:
            rng = base64.b64decode(state.rng[self.info.rank])
            torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
        return state

    # ------------------------------------------------------------------ retention
    def prune(self, newest: int) -> list[int]:
        """Rank 0, right after committing step `newest`: of the committed steps up to `newest`, keep
        the newest `keep` (`newest` among them) and the multiples of keep_every, and delete the rest;
        delete the newer steps this run found unusable and fell back past (a timeline it abandoned),
        and uncommitted leftovers older than `newest` (crashed saves). Newer committed steps it did
        not find unusable are left alone. Returns the deleted committed steps."""
        steps = self.committed_steps()
        ours = [s for s in steps if s <= newest]
        doomed = [s for s in ours[: -self.keep] if not (self.keep_every and s % self.keep_every == 0)]
        abandoned = [s for s in steps if s > newest and s in self._unusable]
        fs, root = storage.filesystem(self.root)
        for step in doomed + abandoned:
            _, p = storage.filesystem(step_dir(self.root, step))
            fs.rm(f"{p}/{COMMIT}")  # uncommit first: a half-deleted step is then never loaded
            fs.rm(p, recursive=True)
            if step in abandoned:
                print(f"[checkpoint] deleted step {step}: it did not verify, and this run committed step {newest} "
                      "instead", flush=True)
        self._unusable.difference_update([*abandoned, newest])  # a re-saved step is good again
        for entry in fs.ls(root, detail=False):
            m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m and int(m.group(1)) < newest and int(m.group(1)) not in steps:
                fs.rm(entry, recursive=True)
        return doomed + abandoned

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
        self._drop_spool()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._buffer = None
