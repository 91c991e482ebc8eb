"""The one module that reaches into torch's private APIs, each guarded: a torch that lacks one fails
with TorchVersionError naming the API, the torch version and the versions tested, instead of an
AttributeError deep in a save. Everything else in rekindle uses torch's public API only.

What is private, and why there is no public way:
- `StorageInfo` (torch.distributed.checkpoint.filesystem._StorageInfo): where a DCP item lies in a
  file. The raw shard format's writer must return one per item, since DCP's FileSystemReader reads it.
- `copy_state_dict`, `create_cpu_state_dict` (torch.distributed._state_dict_utils): a reused, pinned
  CPU copy of a (sharded) state dict for async saves; DCP's own async staging uses them.
- `checkpoint_wrapper` (torch.distributed.algorithms._checkpoint): activation checkpointing per block,
  as torchtitan applies it under FSDP2.
- FSDP2's per-module state (`FSDPModule._get_fsdp_state`, its param group's mesh infos): the process
  groups FSDP2 holds itself, and the gradients on its unsharded parameters: in-process recovery gives
  it the re-formed groups (`rebind_fsdp_groups`) and drops what an interrupted backward left
  (`drop_fsdp_unsharded_grads`).
- torchelastic's agent methods (`ELASTIC_AGENT_METHODS`), overridden by launch/agent.py: the agent
  has no public hooks for start, stop, restart and monitoring.
- The c10d rendezvous's state-machine actions (`rendezvous_actions`): a spare claimed for a lost node leaves
  its redundancy list through them (launch.rounds.claimable); the rendezvous has no public way out.
Public where this torch has it: FsspecReader/FsspecWriter (torch.distributed.checkpoint from 2.15,
before that only in the private `_fsspec_filesystem`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

TESTED = "2.13.0 (CI) and 2.15.0"  # torch releases the whole test suite ran on


class TorchVersionError(ImportError):
    """This torch lacks an API rekindle needs."""


def _missing(what: str) -> TorchVersionError:
    return TorchVersionError(f"rekindle needs {what}, which torch {torch.__version__} does not have; "
                             f"rekindle is tested on torch {TESTED}: install one of those")


def _private(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}") from None


def _first(*candidates: tuple[str, str]) -> Any:
    """The first of (module, name) that this torch has: the public home first."""
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise _missing(" or ".join(f"{m}.{n}" for m, n in candidates))


StorageInfo = _private("torch.distributed.checkpoint.filesystem", "_StorageInfo")
copy_state_dict = _private("torch.distributed._state_dict_utils", "_copy_state_dict")
create_cpu_state_dict = _private("torch.distributed._state_dict_utils", "_create_cpu_state_dict")
FsspecReader = _first(("torch.distributed.checkpoint", "FsspecReader"),
                      ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader"))
FsspecWriter = _first(("torch.distributed.checkpoint", "FsspecWriter"),
                      ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"))


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its activations recomputed in backward (torch's checkpoint_wrapper)."""
    wrap = _private("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper")
    return wrap(module, preserve_rng_state=False)


# torchelastic's LocalElasticAgent: what launch/agent.py overrides, calls or reads.
ELASTIC_AGENT_METHODS = ("_start_workers", "_stop_workers", "_restart_workers", "_monitor_workers", "_shutdown",
                         "_invoke_run", "_initialize_workers", "_rendezvous")
ELASTIC_AGENT_FIELDS = ("_pcontext", "_remaining_restarts", "_worker_group")


def check_elastic_agent(agent: Any) -> None:
    """Raise TorchVersionError unless `agent` (a constructed LocalElasticAgent) has what rekindle's
    launcher overrides and reads."""
    missing = [name for name in ELASTIC_AGENT_METHODS + ELASTIC_AGENT_FIELDS if not hasattr(agent, name)]
    if missing:
        raise _missing(f"torchelastic's LocalElasticAgent.{', .'.join(missing)}")


def rendezvous_actions() -> Any:
    """The c10d dynamic rendezvous's state-machine actions (its private `_Action` enum)."""
    return _private("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_Action")


FSDP_GROUP_FIELDS = ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group")


def _fsdp_param_groups(model: torch.nn.Module) -> list:
    """FSDP2's param group of every FSDP module of `model` (private: `_get_fsdp_state`)."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            try:
                group = module._get_fsdp_state()._fsdp_param_group
            except AttributeError:
                raise _missing("FSDPModule._get_fsdp_state()._fsdp_param_group") from None
            if group is not None:
                groups.append(group)
    return groups


def drop_fsdp_unsharded_grads(model: torch.nn.Module) -> None:
    """Forget the gradients an interrupted backward left on FSDP2's unsharded parameters (reduced and
    cleared only when a module's backward completes; `zero_grad` sees the sharded parameters only): the
    next backward would add to them. Call after `reset_iter_state`."""
    for group in _fsdp_param_groups(model):
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None


def rebind_fsdp_groups(model: torch.nn.Module, mapping: dict) -> int:
    """Give every FSDP2 module of `model` the new process group for each old one in `mapping` (FSDP2
    keeps the groups it took from the DeviceMesh at `fully_shard`); returns the fields rebound."""
    rebound = 0
    for group in _fsdp_param_groups(model):
        infos = {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None}
        for param in group.fsdp_params:
            infos.update({id(i): i for i in (param.mesh_info, param.post_forward_mesh_info) if i is not None})
        for info in infos.values():
            for name in FSDP_GROUP_FIELDS:
                old = getattr(info, name, None)
                if old is not None and old in mapping:
                    setattr(info, name, mapping[old])
                    rebound += 1
            registry = getattr(info.mesh, "_pg_registry", None)  # what compiled code resolves names with
            if registry is not None:
                for key, old in list(registry.items()):
                    registry[key] = mapping.get(old, old)
    return rebound
