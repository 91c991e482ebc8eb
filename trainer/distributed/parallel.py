"""Every distributed concern of the trainer: process-group set-up (gloo on CPU, NCCL on GPU; on a
loopback address its store listens on that address only),
FSDP2 `fully_shard` per block and on the root, mixed precision, compile (the whole model on one CPU
rank, else per block) and activation checkpointing. The model module stays plain PyTorch; this
module wraps it."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from common.net import wait_listening
from trainer.config import DistConfig

if TYPE_CHECKING:
    from trainer.recovery.regroup import Regroup


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def tcp_store_server(host: str, port: int, world_size: int | None, timeout: timedelta,
                     multi_tenant: bool = False, wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server that listens on `host` only (port 0: any free one; host "": every interface).
    torch's own TCPStore server listens on every interface, which for a loopback address would open an
    unauthenticated store to the network. Raises OSError when the address is taken (another process
    hosts it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return dist.TCPStore(host or "0.0.0.0", port, world_size, True, timeout, multi_tenant=multi_tenant,
                         wait_for_workers=wait_for_workers,
                         master_listen_fd=sock.detach())  # the store owns the listening socket from here


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun's agent shares its rendezvous store (the default)
GROUP_STORE_KEY = "rekindle/group-store"  # in that shared store: where this attempt's group store listens


def _group_store(rank: int, world: int, timeout: timedelta) -> dist.Store | None:
    """The process group's store, new for every attempt of the worker group:
    - under plain torchrun, which by default hands the workers its own rendezvous store, the same one
      across restarts: the restarted ranks then read the dead ranks' gloo addresses from it (`Gloo
      connectFullMesh failed ... Connection refused`) or wait for keys that never come. Rank 0 hosts a
      store of its own and publishes its address there (`_store_through_agent`);
    - rank 0 hosts it on a loopback MASTER_ADDR, bound to that address;
    - else None: torch's env:// store (rank 0 hosts it on MASTER_PORT, which the launcher picks anew for
      each attempt)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get(AGENT_STORE_ENV) == str(True):
        return _store_through_agent(host, port, rank, world, timeout)
    if not is_loopback(host):
        return None
    if rank == 0:
        return tcp_store_server(host, port, world, timeout)
    # A TCPStore client that comes before its server retries with growing waits (up to about a second on
    # torch 2.13): a restarted rank that reaches the group a moment before rank 0 would lose that second.
    wait_listening(host, port, timeout.total_seconds())  # False: the store's own connect reports the error
    return dist.TCPStore(host, port, world, False, timeout)


def _store_through_agent(host: str, port: int, rank: int, world: int, timeout: timedelta) -> dist.Store:
    """A fresh store for this attempt, found through torchrun's shared one: rank 0 serves it on a free port
    (on `host` when that is a loopback address, else on every interface, as torch's own store) and writes
    `host:port` under GROUP_STORE_KEY; the other ranks read the key until it names a store that accepts
    connections. A key left by an earlier attempt names a store that died with its rank 0 (torchrun stops
    every worker before it starts new ones), so it refuses connections until the new rank 0 rewrites the
    key. Bounded by `timeout`."""
    agent = dist.TCPStore(host, port, None, False, timeout)
    if rank == 0:
        server = tcp_store_server(host if is_loopback(host) else "", 0, world, timeout, wait_for_workers=False)
        agent.set(GROUP_STORE_KEY, f"{host}:{server.port}")
        return server
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        where = agent.get(GROUP_STORE_KEY).decode()
        store_host, _, store_port = where.rpartition(":")
        if wait_listening(store_host, int(store_port), 0.05):
            return dist.TCPStore(store_host, int(store_port), world, False, timeout)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank 0's process-group store ({where}, read from torchrun's store at "
                               f"{host}:{port}) did not accept connections within {timeout.total_seconds():.0f}s")


def init_distributed(cfg: DistConfig, regroup: Regroup | None = None) -> DistInfo:
    """Join the process group torchrun describes in the environment, or form a group of one.

    backend=auto picks nccl when CUDA is available, else gloo. World size 1 works without torchrun.
    With `regroup` (in-process recovery), the group's connections are tracked, and a replacement rank
    joins the survivors' generation on the launcher's store instead of the attempt's own.
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("dist.backend=nccl needs CUDA, and none is available; use auto or gloo")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            if regroup is not None and regroup.generation > 0:
                regroup.announce(regroup.generation, "replacement")
                store = regroup.group_store()
            else:
                store = _group_store(rank, world, timeout)
            with regroup.tracking() if regroup is not None else contextlib.nullcontext():
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                        device_id=device if backend == "nccl" else None)
        else:
            if world != 1:
                raise RuntimeError("WORLD_SIZE > 1 but no MASTER_ADDR: launch several ranks with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(rank=rank, world=world, local_rank=local_rank, device=device, backend=backend)


def shutdown() -> None:
    for timer in list(_COMM_TIMERS):  # a run that ended in an exception leaves its CommTimer open
        timer.close()
    # FSDP2 modules sit in reference cycles (hooks), so the process group they hold would otherwise be
    # destroyed during interpreter teardown, where gloo's threads abort the process now and then
    # ("terminate called without an active exception"). Free them while the interpreter is whole.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def compute_dtype(cfg: DistConfig, device: torch.device) -> torch.dtype:
    """auto = bf16 on GPU, fp32 on CPU: safe everywhere, since a CPU without bf16 hardware runs bf16 far
    slower than fp32 (one with AMX runs it faster: docs/performance.md, "The machine")."""
    if cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def parallelize(model: nn.Module, cfg: DistConfig, info: DistInfo) -> nn.Module:
    """Apply activation checkpointing, compile and FSDP2 to a Transformer, in that order.

    World size 1 skips FSDP (nothing to shard; torchtitan does the same) and relies on autocast
    for mixed precision, see `autocast()`; with dist.compile on CPU it compiles the whole model
    instead of each block.
    """
    blocks = model.layers
    if cfg.activation_checkpointing != "none":
        from trainer.distributed.torch_compat import checkpoint_wrapper

        for i, (name, block) in enumerate(list(blocks.items())):
            if cfg.activation_checkpointing == "full" or i % 2 == 0:  # selective: every other block
                blocks[name] = checkpoint_wrapper(block)
    # Per block (as torchtitan): inside FSDP2's per-block hooks, and on GPUs at any world size, where
    # one compiled block serves every layer, so compile time does not grow with depth, as the whole
    # model's does (docs/performance.md, "Design choices": compile).
    whole_model = cfg.compile and info.world == 1 and info.device.type == "cpu"
    if cfg.compile and not whole_model:
        for block in blocks.values():
            block.compile()
    if info.world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = compute_dtype(cfg, info.device)
        # No casting of forward inputs: the activations already come in param_dtype from the layer
        # before, and the RoPE table passed to every block must stay float32 (cos/sin in bf16 lose
        # precision at long positions, and complex numbers need float32).
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for i, block in enumerate(blocks.values()):
            # The last block's parameters are needed right away by backward: keep them gathered.
            fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, mp_policy=mp)
    else:
        model.to(info.device)
        if whole_model:
            # No FSDP hooks to respect: one graph for the whole model also fuses across block
            # boundaries (a block's residual add with the next block's RMSNorm), a little faster than
            # per-block compile, for a longer compile that the small CPU models can afford
            # (docs/performance.md, "Design choices": compile).
            model.compile()
    return model


def autocast(cfg: DistConfig, info: DistInfo) -> contextlib.AbstractContextManager:
    """Mixed precision for the unsharded (world size 1) case; FSDP2 handles it otherwise."""
    dtype = compute_dtype(cfg, info.device)
    if info.world > 1 or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(info.device.type, dtype=dtype)


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (any picklable object)."""
    if info.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_mean(values: list[float], info: DistInfo) -> list[float]:
    """Average a few scalars over all ranks (one collective)."""
    if info.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return (t / info.world).tolist()


def all_gather_rows(values: list[float], info: DistInfo) -> Callable[[], list[list[float]]]:
    """Start gathering every rank's `values` (as many on every rank; one collective, asynchronous);
    the returned function waits for them and gives them by rank."""
    if info.world == 1:
        return lambda: [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=info.device)
    rows = torch.empty(info.world * len(values), dtype=torch.float64, device=info.device)
    work = dist.all_gather_single(rows, mine, async_op=True)

    def wait() -> list[list[float]]:
        work.wait()
        return rows.view(info.world, len(values)).tolist()

    return wait


def use_fused_adamw(cfg: DistConfig, device: torch.device) -> bool:
    """dist.fused_adamw: auto = the fused kernel on GPU (one launch for all parameters) and on CPU (one
    pass over each parameter instead of one per operation, see docs/performance.md, "Design choices":
    fused AdamW); foreach elsewhere."""
    return cfg.fused_adamw == "fused" or (cfg.fused_adamw == "auto" and device.type in ("cuda", "cpu"))


class CommTimer:
    """Wall time the training thread spends inside blocking torch.distributed collectives.

    Why this measures communication wait honestly on gloo: FSDP2 on CPU has no streams, so its
    all-gathers (forward, and backward for resharded blocks) and reduce-scatters (backward) run
    synchronously on the training thread and nothing computes while they run. The time inside
    those calls is exactly what the step waits for: the transfer itself plus waiting for the slowest
    rank to arrive. It wraps the `torch.distributed` functions FSDP2 and the trainer call
    (they are looked up on the module at call time) and counts only calls from the thread that
    created the timer and only blocking ones (`async_op=False`); background checkpoint threads and
    asynchronous work are not counted. Not counted either: the DTensor all-reduce of the gradient
    norm (a scalar, through functional collectives), which is negligible.

    On NCCL the same calls only enqueue work on communication streams that overlap compute; their
    host time is not a wait, so `enabled_for()` is false there and the trainer reports no comm wait
    (the profiler trace, `profile.steps`, shows the overlap instead).
    """

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_reduce", "all_gather", "broadcast", "barrier")

    def __init__(self) -> None:
        self.total_s = 0.0
        self.calls = 0
        self._thread = threading.get_ident()
        self._originals: dict[str, object] = {}
        _COMM_TIMERS.append(self)
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original))

    @staticmethod
    def enabled_for(info: DistInfo) -> bool:
        return info.world > 1 and info.backend == "gloo"

    def _wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if kwargs.get("async_op") or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - start
                self.calls += 1

        timed.__rekindle_original__ = fn
        return timed

    def close(self) -> None:
        """Put the original functions back."""
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        if self in _COMM_TIMERS:
            _COMM_TIMERS.remove(self)


_COMM_TIMERS: list[CommTimer] = []


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip FSDP's reduce-scatter on micro-batches before the last one of an accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def set_collective_timeout(seconds: float, info: DistInfo, barrier: bool = True) -> None:
    """Shorten the default group's collective timeout once start-up (slow, uneven) is over.

    A barrier first (unless the caller has just synchronized the ranks), so no rank runs a collective
    under the short timeout while another is still in its first step under the long one (torchtitan
    does the same after its first step)."""
    if info.world == 1 or seconds <= 0:
        return
    if barrier:
        dist.barrier()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
