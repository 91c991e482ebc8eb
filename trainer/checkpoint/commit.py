"""The commit protocol's files, with no collectives: step directories, `train_state.json`,
`COMMIT.json` (written last: every file with size and checksum, plus a checksum of its own content),
verification of a share of a step's files, listing the committed steps, and retention (prune).
Every function here is called by one process on its own (rank 0, or any rank for its own share, or
a tool such as the exporter or the launcher); the collective side is `checkpointer.Checkpointer`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from common import storage
from trainer.checkpoint.format import CheckpointStorageError, load_metadata

STEP_DIR = re.compile(r"^step-(\d{8})$")
COMMIT = "COMMIT.json"
TRAIN_STATE = "train_state.json"
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")

log = logging.getLogger("rekindle.checkpoint")


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data: dict[str, Any] | None = None
    world: int = 1
    config_sha256: str = ""
    rng: list[str] = field(default_factory=list)  # torch CPU RNG state per rank, base64
    tied: dict[str, str] = field(default_factory=dict)  # parameter name -> the name it shares its tensor with
    model: dict[str, Any] = field(default_factory=dict)  # the model's arguments (ModelArgs); {} before they were kept
    config: dict[str, Any] = field(default_factory=dict)  # the run config (Config.to_dict); {} before it was kept
    health: dict[str, Any] = field(default_factory=dict)  # the step checks' history (trainer.health); {}: none yet


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step:08d}"


def _step_of(entry: str) -> int | None:
    m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def _commit_digest(commit: dict) -> str:
    body = {k: v for k, v in commit.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(commit: dict) -> dict:
    """`commit` with the checksum of its own content added (as COMMIT.json stores it)."""
    return {**commit, "sha256": _commit_digest(commit)}


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


def read_train_state(path: str) -> TrainState:
    fs, p = storage.filesystem(path)
    return TrainState(**json.loads(fs.cat_file(f"{p}/{TRAIN_STATE}")))


def write_commit(root: str, path: str, state: TrainState, files: dict, world: int) -> None:
    """Commit step `path` (rank 0, once every rank's shards are written): train_state.json, then
    COMMIT.json, both durably. `files`: what the ranks wrote, `.metadata` included (rank 0's writer
    hashed it)."""
    fs, p = storage.filesystem(path)
    body = json.dumps(asdict(state), indent=1).encode()
    storage.write_durably(f"{path}/{TRAIN_STATE}", body)
    files[TRAIN_STATE] = {"size": len(body), storage.CHECKSUM: storage.checksum_bytes(body)}
    if ".metadata" not in files:  # not seen being written (a writer that bypasses the hashing): read it
        full = f"{p}/.metadata"
        files[".metadata"] = {"size": int(fs.size(full)), storage.CHECKSUM: storage.checksum_file(fs, full)}
    commit = seal({"step": state.step, "time": time.time(), "world": world, "files": files})
    storage.write_durably(f"{path}/{COMMIT}", json.dumps(commit, indent=1).encode())  # last: the step exists
    if storage.is_local(root):
        storage.fsync_dir(storage.filesystem(root)[1])  # ... and its directory too, before prune() deletes


def committed_steps(root: str) -> list[int]:
    """The steps under `root` that have a COMMIT.json (not verified), oldest first. Unreachable storage
    raises CheckpointError naming the URL."""
    fs, p = storage.filesystem(root)
    with storage.unreachable_as(CheckpointStorageError, f"cannot reach checkpoint storage {root}"):
        if not fs.exists(p):
            return []
        steps = []
        for entry in fs.ls(p, detail=False):
            step = _step_of(entry)
            if step is not None and fs.exists(f"{entry.rstrip('/')}/{COMMIT}"):
                steps.append(step)
    return sorted(steps)


# ---------------------------------------------------------------------- verification
def verifying_rank(name: str, index: int, world: int) -> int:
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
    with storage.unreachable_as(CheckpointStorageError, f"cannot read checkpoint storage at {path}"):
        return _verify_files(path, rank, world, None if storage.is_local(path) else spool)


def _verify_files(path: str, rank: int, world: int, spool: str | None) -> str:
    fs, p = storage.filesystem(path)
    try:
        files = sorted(read_commit(path)["files"].items())
    except FileNotFoundError:
        return f"{path}/{COMMIT} is missing"
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        return f"{path}/{COMMIT} is unreadable or corrupt ({type(e).__name__}: {e})"
    for i, (name, want) in enumerate(files):
        if verifying_rank(name, i, world) != rank:
            continue
        try:
            problem = _verify_file(fs, p, path, name, want, spool and os.path.join(spool, name))
        except OSError as e:
            if storage.storage_error(e):
                raise
            problem = f"{path}/{name} is unreadable ({type(e).__name__}: {e})"  # e.g. EIO: a bad sector
        if problem:
            return problem
    if rank == 0:
        try:
            load_metadata(fs.cat_file(f"{p}/.metadata"))
        except Exception as e:  # noqa: BLE001 - any failure to parse means unusable
            if storage.storage_error(e):
                raise
            return f"{path}/.metadata is unusable: {type(e).__name__}: {e}"
    return ""


def _verify_file(fs, p: str, path: str, name: str, want: dict, local: str | None) -> str:
    """One committed file of `path` (`p` within `fs`): '' if its size and checksum match `want`, else
    the problem. With `local`, the bytes are also copied there (and removed if they do not match)."""
    full, shown = f"{p}/{name}", f"{path}/{name}"
    if not fs.exists(full):
        return f"{shown} is missing"
    size = int(fs.size(full))
    if size != want["size"]:
        return f"{shown} is {size} bytes, committed with {want['size']} (truncated?)"
    algorithm = next((a for a in storage.CHECKSUMS if a in want), None)
    if algorithm is None:
        return f"{path}/{COMMIT} has no checksum for {name}"
    digest = None
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
        return f"{shown} fails its checksum (corrupt)"
    return ""


# ---------------------------------------------------------------------- retention
def prune(root: str, newest: int, keep: int, keep_every: int = 0, unusable: frozenset[int] = frozenset()) -> list[int]:
    """Right after committing step `newest`: of the committed steps up to `newest`, keep the newest
    `keep` (`newest` among them) and the multiples of keep_every, and delete the rest; delete the
    newer steps found `unusable` (a timeline the run fell back past and abandoned), and uncommitted
    leftovers older than `newest` (crashed saves). Newer committed steps not known to be unusable are
    left alone. Returns the deleted committed steps."""
    steps = committed_steps(root)
    ours = [s for s in steps if s <= newest]
    doomed = [s for s in ours[:-keep] if not (keep_every and s % keep_every == 0)]
    abandoned = [s for s in steps if s > newest and s in unusable]
    fs, p_root = storage.filesystem(root)
    for step in doomed + abandoned:
        _, p = storage.filesystem(step_dir(root, step))
        fs.rm(f"{p}/{COMMIT}")  # uncommit first: a half-deleted step is then never loaded
        fs.rm(p, recursive=True)
        if step in abandoned:
            log.info("deleted step %d: it did not verify, and this run committed step %d instead", step, newest)
    for entry in fs.ls(p_root, detail=False):
        step = _step_of(entry)
        if step is not None and step < newest and step not in steps:
            fs.rm(entry, recursive=True)
    return doomed + abandoned


def clear_uncommitted(path: str) -> None:
    """Delete the step directory `path` if it holds no COMMIT.json (a crashed save of the same step)."""
    fs, p = storage.filesystem(path)
    if fs.exists(p) and not fs.exists(f"{p}/{COMMIT}"):
        fs.rm(p, recursive=True)
