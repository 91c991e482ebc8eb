"""What the memory tier's ranks exchange (trainer.checkpoint.memory describes the tier): the peer copies
sent to the buddy on the next node after each snapshot, and at restore the plan every rank agrees on
and the parts sent to the ranks that do not hold their own; for a snapshot of another world size (a
smaller world after a lost node), the newest that the nodes hold between them (`reshard_plan`) and the
parts sent to the ranks whose node lacks them (`share_parts`). Collective: every rank calls these."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.memory_slots import Elsewhere, Found, head_of, keep_part, read_part


def exchange(own: tuple[Path, Path] | None, peer: tuple[Path, Path], buddy: int, source: int, group: Any) -> None:
    """Send this rank's part, (bin, header) `own` (None: it could not be written), to rank `buddy`, and
    keep the part rank `source` sends as the peer copy `peer`."""
    payload = read_part(*own) if own is not None else (b"", b"")
    peer[1].unlink(missing_ok=True)  # the copy of an older step goes, whether a new one comes or not
    header, data = send_recv(payload, buddy, source, group)
    if header:
        keep_part(*peer, header, data)


def plan(found: Iterable[tuple[int, int]], world: int) -> tuple[int | None, dict[int, int]]:
    """The newest step of which every rank's part is held by some rank, given the (rank, step) parts
    each rank holds (`found`, this rank's), and who gives each rank its part ({rank: holder}; the rank
    itself where it holds it)."""
    everyone: list[Any] = [sorted(found)]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, sorted(found))
    holders: dict[tuple[int, int], list[int]] = {}
    for holder, keys in enumerate(everyone):
        for part, step in keys:
            holders.setdefault((part, step), []).append(holder)
    steps = {step for _, step in holders}
    usable = [s for s in steps if all((p, s) in holders for p in range(world))]
    if not usable:
        return None, {}
    step = max(usable)
    return step, {p: p if p in holders[(p, step)] else min(holders[(p, step)]) for p in range(world)}


def fetch(rank: int, step: int, givers: dict[int, int], found: Found, into: tuple[Path, Path]) -> tuple[Path, dict]:
    """Every part whose rank does not hold it is sent by its holder; this rank keeps the one it receives
    as its own part of `step`, at `into` (bin, header). Returns this rank's part (bin, header)."""
    for part, giver in sorted(givers.items()):
        if giver == part:
            continue
        if rank == giver:
            binary = found[(part, step)][0]
            send_recv(read_part(binary, head_of(binary)), part, None, None)
        elif rank == part:
            header, data = send_recv((b"", b""), None, giver, None)
            found[(part, step)] = (into[0], keep_part(*into, header, data))
    return found[(rank, step)]


def send_recv(payload: tuple[bytes, bytes], to: int | None, source: int | None, group: Any) -> tuple[bytes, bytes]:
    """Send `payload` (header, data) to rank `to` and receive one from rank `source` (either may be
    None), on `group` (None: the default group). Empty header: nothing this time."""
    header, data = payload
    works, sizes = [], torch.zeros(2, dtype=torch.int64)
    if to is not None:
        out = torch.tensor([len(header), len(data)], dtype=torch.int64)
        works.append(dist.isend(out, to, group=group))
    if source is not None:
        works.append(dist.irecv(sizes, source, group=group))
    for w in works:
        w.wait()
    works = []
    if to is not None and header:
        blob = torch.frombuffer(bytearray(header + data), dtype=torch.uint8)
        works.append(dist.isend(blob, to, group=group))
    received = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    if source is not None and int(sizes[0]):
        works.append(dist.irecv(received, source, group=group))
    for w in works:
        w.wait()
    if source is None or not int(sizes[0]):
        return b"", b""
    raw = received.numpy().tobytes()
    return raw[:int(sizes[0])], raw[int(sizes[0]):]


def reshard_plan(elsewhere: Elsewhere, world: int) -> tuple[int, int] | None:
    """(old world, step) of the newest snapshot of another world size of which every part is held on some
    rank's node (`elsewhere`: this node's parts by (world, step)), or None."""
    mine = sorted((w, s, sorted(parts)) for (w, s), parts in elsewhere.items())
    everyone: list[Any] = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    held: dict[tuple[int, int], set[int]] = {}
    for keys in everyone:
        for w, s, parts in keys:
            held.setdefault((w, s), set()).update(parts)
    complete = [(s, w) for (w, s), parts in held.items() if parts == set(range(w))]
    if not complete:
        return None
    step, old_world = max(complete)
    return old_world, step


def share_parts(rank: int, world: int, old_world: int, parts: dict, into: Path) -> dict:
    """Every part of the `old_world`-rank snapshot that a rank's node lacks (its peers' nodes hold it: the
    survivors of a lost node on several nodes) is sent to that rank by the lowest rank that holds it, and
    kept in `into`. Returns this rank's parts ({old rank: (bin, header)}), now every one of them."""
    everyone: list[Any] = [sorted(parts)]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, sorted(parts))
    parts = dict(parts)
    for part in range(old_world):
        giver = next(r for r, held in enumerate(everyone) if part in held)
        for taker in (r for r, held in enumerate(everyone) if part not in held):
            if rank == giver:
                send_recv(read_part(parts[part][0], head_of(parts[part][0])), taker, None, None)
            elif rank == taker:
                into.mkdir(parents=True, exist_ok=True)
                binary = into / f"part-{part}.bin"
                parts[part] = (binary, keep_part(binary, head_of(binary), *send_recv((b"", b""), None, giver, None)))
    return parts
