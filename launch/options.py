"""What a launch was asked for on the command line (or through torchrun's PET_* variables)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchOptions:
    config_path: str
    overrides: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int | None = None  # None: fault.max_restarts from the config
    rdzv_endpoint: str = ""  # empty: this node alone, rendezvous on 127.0.0.1
    rdzv_id: str = ""  # empty: derived from run.name and run.dir (the same on every node)
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None  # address the other ranks reach this node at; None: auto
    monitor_interval_s: float = 0.025  # how often the agent polls the ranks (a crash is noticed within it)
    job: str = ""  # this job's id (launch.lock.job_key): its ranks share the directory leases
