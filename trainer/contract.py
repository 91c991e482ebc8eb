"""Everything the launcher (launch/) uses of the trainer, and nothing else: the one module launch/
imports from trainer/ (a unit test holds it to that). What crosses:

  exit codes                                  common.exits (trainer.runtime.protocol re-exports them too)
  env names, heartbeats, events               trainer.runtime.protocol: how a rank and its launcher talk (the
                                              heartbeat record: HeartbeatRecord, read by read_heartbeats; where
                                              the ranks' store moved: write_store_moved, forget_store_moves)
  process helpers                             common.process: liveness, dying with a parent
  scratch directories                         trainer.runtime.scratch: per-process temp dirs, dead owners' swept
  memory_sweep                                trainer.runtime.memory_sweep: this node's memory snapshots of runs
                                              gone or too old, removed at the launcher's start
  atomic writes                               common.storage: temp names, a file that appears whole
  recovery's keys, next_generation            trainer.recovery.keys: the coordination store's keys (torch-free)
  the job id's env name                       trainer.runtime.lease: the launcher names the job its ranks lease under
  config                                      trainer.config: the launcher refuses a bad config before any rank starts
  cost, logs                                  one cost arithmetic and one `[launch]` / `[rekindle]` log format
  torch-using parts, imported when first used (the launcher starts its fork server before torch loads):
    tcp_store_server, is_loopback             trainer.distributed.parallel: the rendezvous's store
    check_elastic_agent, rendezvous_actions   trainer.distributed.torch_compat: torchelastic's internals, checked
    committed_steps, read_commit, step_dir    trainer.checkpoint.commit: the step a preempted job resumes from
    trainer_main                              the trainer.__main__ module: what the fork server runs in a forked rank
    coordination_store, arrived_ranks,        trainer.recovery.regroup: the in-process recovery's store, where the
    publish_smaller_world, announce_failure,  launcher sends the survivors of a lost node on in a smaller world
    failure_handled, smaller_world_published, or has a spare start its ranks (publish_spare, published_world),
    publish_spare, published_world            tells the ranks that one of them died, and hears that another
                                              launcher handles its own ranks' failure (its node lives), or that
                                              the others went on without this node
"""

from __future__ import annotations

import importlib
from typing import Any

from common.exits import (
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_FAULTY,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
)
from common.process import die_with_parent, exit_now, is_alive, proc_stat
from common.storage import atomic_file, temp_name
from trainer.config import Config, ConfigError, load, validate
from trainer.observability import logs
from trainer.observability.cost import cost_report, format_cost
from trainer.recovery.keys import arrived_key, failed_key, handled_key, next_generation, store_prefix, world_key
from trainer.runtime import memory_sweep
from trainer.runtime.lease import JOB_ENV
from trainer.runtime.protocol import (
    COORD_STORE_ENV,
    GENERATION_ENV,
    HEARTBEAT_DIR_ENV,
    LAUNCHER_PID_ENV,
    ROUND_ENV,
    HeartbeatRecord,
    append_event,
    forget_store_moves,
    read_heartbeats,
    write_store_moved,
)
from trainer.runtime.scratch import scratch_prefix, sweep_scratch

_LAZY = {
    "tcp_store_server": ("trainer.distributed.parallel", "tcp_store_server"),
    "is_loopback": ("trainer.distributed.parallel", "is_loopback"),
    "check_elastic_agent": ("trainer.distributed.torch_compat", "check_elastic_agent"),
    "rendezvous_actions": ("trainer.distributed.torch_compat", "rendezvous_actions"),
    "committed_steps": ("trainer.checkpoint.commit", "committed_steps"),
    "read_commit": ("trainer.checkpoint.commit", "read_commit"),
    "step_dir": ("trainer.checkpoint.commit", "step_dir"),
    "trainer_main": ("trainer.__main__", None),
    "coordination_store": ("trainer.recovery.regroup", "coordination_store"),
    "arrived_ranks": ("trainer.recovery.regroup", "arrived_ranks"),
    "announce_failure": ("trainer.recovery.regroup", "announce_failure"),
    "failure_handled": ("trainer.recovery.regroup", "failure_handled"),
    "publish_smaller_world": ("trainer.recovery.regroup", "publish_smaller_world"),
    "smaller_world_published": ("trainer.recovery.regroup", "smaller_world_published"),
    "publish_spare": ("trainer.recovery.regroup", "publish_spare"),
    "published_world": ("trainer.recovery.regroup", "published_world"),
}


def __getattr__(name: str) -> Any:
    """The torch-using names, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    loaded = importlib.import_module(module)
    return loaded if attribute is None else getattr(loaded, attribute)


__all__ = [
    "COORD_STORE_ENV", "GENERATION_ENV", "EXIT_CRASH_LOOP", "EXIT_FAILED", "EXIT_FAULTY", "EXIT_OK", "EXIT_PREEMPTED",
    "EXIT_STORAGE", "EXIT_USAGE", "HEARTBEAT_DIR_ENV", "HeartbeatRecord", "JOB_ENV", "LAUNCHER_PID_ENV", "ROUND_ENV",
    "Config", "ConfigError",
    "append_event", "arrived_key", "atomic_file", "failed_key", "handled_key", "next_generation", "store_prefix",
    "world_key", "cost_report", "die_with_parent", "exit_now", "format_cost", "is_alive", "load",
    "logs", "memory_sweep", "proc_stat", "read_heartbeats", "scratch_prefix", "sweep_scratch", "temp_name",
    "validate", "forget_store_moves", "write_store_moved", *_LAZY,
]
