"""The memory tier's files on one node (trainer.checkpoint.memory describes the tier): the slots and their
names, writing a part (its tensors' bytes, then its header last), reading one, and the scan that keeps
only the parts that verify. No collectives, no torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import storage
from trainer.observability import logs

log = logs.get_logger("memory")

SLOTS = 3
IOV_MAX = 1024  # buffers per pwritev (Linux's limit)
VERSION = 1

Found = dict[tuple[int, int], tuple[Path, dict]]  # {(rank, step): (bin, header)} of the parts that verify
Elsewhere = dict[tuple[int, int], dict[int, tuple[Path, dict]]]  # {(world, step): {rank: (bin, header)}}


def slot_of(step: int, every: int) -> int:
    return step // max(every, 1) % SLOTS


def part_paths(directory: Path, slot: int, rank: int, peer: bool = False) -> tuple[Path, Path]:
    """(bin, header) of rank `rank`'s part in `slot`: its own, or the peer copy this node keeps of it."""
    base = f"{'peer-' if peer else ''}slot-{slot}.rank-{rank}"
    return directory / f"{base}.bin", directory / f"{base}.json"


def head_of(binary: Path) -> Path:
    return binary.parent / f"{binary.name.removesuffix('.bin')}.json"


def write_data(binary: Path, head: Path, views: list[memoryview], size: int) -> str:
    """Write a part's bytes (`size` in all) over its slot's .bin straight from their memory; returns their
    checksum. The slot's header goes first: from then until the new one is written (`write_header`), the
    slot is unusable."""
    head.unlink(missing_ok=True)
    fd = os.open(binary, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _write_all(fd, views)
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    digest = storage.new_digest()
    for view in views:
        digest.update(view)
    return digest.hexdigest()


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write the buffers one after another from offset 0, in as few system calls as the kernel allows."""
    at, views = 0, [v.cast("B") for v in views if v.nbytes]
    while views:
        batch = views[:IOV_MAX]
        done = os.pwritev(fd, batch, at)
        at += done
        while views and done >= views[0].nbytes:  # drop what was written whole; cut the one written in part
            done -= views[0].nbytes
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def write_header(head: Path, header: dict, tensors_json: str | None = None) -> None:
    """The header last, whole: the part exists once it is there. `tensors_json`: its "tensors" table,
    already encoded (the same from one snapshot to the next)."""
    if tensors_json is None:
        data = json.dumps(header)
    else:
        data = json.dumps({k: v for k, v in header.items() if k != "tensors"})[:-1] + f', "tensors": {tensors_json}}}'
    storage.atomic_write(head, data.encode())


def keep_part(binary: Path, head: Path, header: bytes, data: bytes) -> dict:
    """Keep a part another rank sent (its header's and its .bin's bytes) at (binary, head), the header
    last; returns the header."""
    head.unlink(missing_ok=True)
    binary.write_bytes(data)
    kept = json.loads(header)
    write_header(head, kept)
    return kept


def read_part(binary: Path, head: Path) -> tuple[bytes, bytes]:
    """(header, data) of a part, as its files hold them."""
    return head.read_bytes(), binary.read_bytes()


def scan(directory: Path, ranks: set[int], identity: dict) -> tuple[Found, list[str], Elsewhere]:
    """The complete parts in `directory` of `ranks` (own copies and peer copies) that verify against
    `identity` (the header's run_id, world, config_sha256), and why the others were passed over. Each one
    passed over is said, but for the parts of another world size: those of this run and config that
    verify, of every rank, come back apart ({(world, step): {rank: (bin, header)}}), for a reshard."""
    found: Found = {}
    elsewhere: Elsewhere = {}
    skipped: list[str] = []
    for head in sorted(directory.glob("*slot-*.rank-*.json")):
        part = int(head.name.removesuffix(".json").rsplit("-", 1)[1])
        binary = head.parent / f"{head.name.removesuffix('.json')}.bin"
        world = _world_of(head)
        if isinstance(world, int) and world != identity["world"]:
            problem, header = check_part(binary, head, part, {**identity, "world": world})
            skipped.append(f"world {world}, this run's is {identity['world']}")
            if problem:
                log.warning("memory snapshot %s (world %d) not used: %s", head, world, problem)
                continue
            parts = elsewhere.setdefault((world, header["step"]), {})
            if part not in parts or not head.name.startswith("peer-"):
                parts[part] = (binary, header)
            continue
        if part not in ranks:
            continue
        problem, header = check_part(binary, head, part, identity)
        if problem:
            log.warning("memory snapshot %s not used: %s", head, problem)
            skipped.append(problem)
            continue
        key = (part, header["step"])
        if key not in found or not head.name.startswith("peer-"):  # its own copy first
            found[key] = (binary, header)
    return found, skipped, elsewhere


def _world_of(head: Path) -> object:
    """The world size a part's header names (None when unreadable: `check_part` says why)."""
    try:
        return json.loads(head.read_text()).get("world")
    except (OSError, ValueError, AttributeError):
        return None


def check_part(binary: Path, head: Path, part: int, identity: dict) -> tuple[str, dict]:
    """('', header) when rank `part`'s part at (binary, head) is of `identity` and its bytes verify;
    else (the problem, {})."""
    try:
        header = json.loads(head.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable header ({e})", {}
    for key, want in (("version", VERSION), ("run_id", identity["run_id"]), ("world", identity["world"]),
                      ("rank", part)):
        if header.get(key) != want:
            return f"{key} {header.get(key)!r}, this run's is {want!r}", {}
    if header.get("config_sha256") != identity["config_sha256"]:
        return "written with another config", {}
    try:
        size = binary.stat().st_size
        if size != header["bytes"]:
            return f"{binary.name} is {size} bytes, its header says {header['bytes']}", {}
        digest = storage.new_digest()
        with open(binary, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    except OSError as e:
        return f"unreadable ({e})", {}
    if digest.hexdigest() != header["checksum"]:
        return f"{binary.name} fails its checksum", {}
    return "", header
