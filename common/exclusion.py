"""The run's list of nodes set aside: their host names in `run.dir/excluded-nodes`, one per line, for a
cluster script to read (Slurm: `sbatch --exclude=$(paste -sd, RUN_DIR/excluded-nodes)`). Written by a rank
found faulty (trainer.health) or by a launcher whose ranks fail again and again (launch.policy); each also
puts a `node_excluded` record in the ledger."""

from __future__ import annotations

import socket
from pathlib import Path

EXCLUDED_FILE = "excluded-nodes"


def add_this_host(run_dir: str) -> tuple[str, str]:
    """Name this node in the file (once); returns (its host name, the file's path)."""
    host, path = socket.gethostname(), Path(run_dir) / EXCLUDED_FILE
    if host not in excluded(run_dir):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(host + "\n")
    return host, str(path)


def excluded(run_dir: str) -> list[str]:
    """The host names set aside so far."""
    path = Path(run_dir) / EXCLUDED_FILE
    return path.read_text().split() if path.exists() else []
