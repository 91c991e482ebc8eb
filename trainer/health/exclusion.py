"""Setting a faulty node aside from the trainer: its host name in `run.dir/excluded-nodes`
(common.exclusion) and a `node_excluded` record in the ledger. Written by the faulty rank itself, before it
ends (exit EXIT_FAULTY: its launcher then leaves the job, and the other nodes take the node for lost)."""

from __future__ import annotations

from common.exclusion import add_this_host
from trainer.runtime import protocol


def set_aside(run_dir: str, rank: int, step: int, why: str) -> str:
    """Name this node as faulty (once in the file; every time in the ledger); returns its host name."""
    host, path = add_this_host(run_dir)
    protocol.append_event(run_dir, "node_excluded", host=host, rank=rank, step=step, why=why, file=path,
                          by="trainer")
    return host
