"""Setting a faulty node aside: its host name in `run.dir/excluded-nodes`, one per line, for a cluster
script to read (Slurm: `sbatch --exclude=$(paste -sd, RUN_DIR/excluded-nodes)`), and a `node_excluded`
record in the ledger. Written by the faulty rank itself, before it ends (exit EXIT_FAULTY: its launcher
then leaves the job, and the other nodes take the node for lost)."""

from __future__ import annotations

import socket
from pathlib import Path

from trainer.runtime import protocol

EXCLUDED_FILE = "excluded-nodes"


def set_aside(run_dir: str, rank: int, step: int, why: str) -> str:
    """Name this node as faulty (once in the file; every time in the ledger); returns its host name."""
    host, path = socket.gethostname(), Path(run_dir) / EXCLUDED_FILE
    if host not in excluded(run_dir):
        with path.open("a") as f:
            f.write(host + "\n")
    protocol.append_event(run_dir, "node_excluded", host=host, rank=rank, step=step, why=why, file=str(path))
    return host


def excluded(run_dir: str) -> list[str]:
    """The host names set aside so far."""
    path = Path(run_dir) / EXCLUDED_FILE
    return path.read_text().split() if path.exists() else []
