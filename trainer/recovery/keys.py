"""Every key of in-process recovery on the ranks' coordination store (the launcher's rendezvous store,
`COORD_STORE_ENV`), and the generation arithmetic: the one spelling both sides use (the ranks here, the
launcher through trainer.contract). Torch-free.

Layout: a worker group's keys live under `rekindle/inproc/<rendezvous run id>/<round>/` (`store_prefix`;
the round is `protocol.worker_group`), each generation's under `g<generation>/` in it:

    g<N>/failed        a failure ended generation N-1: set by the first ranks to notice, or the launcher
    g<N>/handled       the failed ranks' launcher replaces them or restarts its group: their node lives
    g<N>/world         the launcher's smaller world for N (a node was lost): {"ranks": {old: new}}
    g<N>/arrived/<r>   rank r is on its way to N: {"who": survivor | replacement, "pid", "t"}
    g<N>/setup         what a replacement needs from the survivors: the memory tier's run id and interval
    g<N>/...           the process groups of N form on this prefix (`generation_prefix`)
"""

from __future__ import annotations

from collections.abc import Iterable


def store_prefix(run_id: str, group: str) -> str:
    """The prefix of one worker group's keys (`group`: its rendezvous round)."""
    return f"rekindle/inproc/{run_id}/{group}"


def generation_prefix(generation: int) -> str:
    """The prefix of one generation's keys, and of its process groups' store."""
    return f"g{generation}"


def failed_key(generation: int) -> str:
    """Set when the generation before `generation` failed (by whoever noticed first)."""
    return f"{generation_prefix(generation)}/failed"


def handled_key(generation: int) -> str:
    """Set by the failed ranks' launcher: it handles their failure (their node is not lost)."""
    return f"{generation_prefix(generation)}/handled"


def world_key(generation: int) -> str:
    """The smaller world the launcher published for `generation`."""
    return f"{generation_prefix(generation)}/world"


def arrived_key(generation: int, rank: int) -> str:
    """Rank `rank`'s arrival record for `generation`."""
    return f"{generation_prefix(generation)}/arrived/{rank}"


def setup_key(generation: int) -> str:
    """The survivors' setup for the replacements of `generation`."""
    return f"{generation_prefix(generation)}/setup"


def next_generation(current: int, seen: Iterable[int] = ()) -> int:
    """The generation after `current` and every generation `seen` (in the ranks' heartbeat records): the
    one a new failure starts."""
    return max([current, *seen]) + 1
