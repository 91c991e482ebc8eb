"""Collectives benchmark in the style of nccl-tests: all_reduce, all_gather and reduce_scatter time,
algorithm bandwidth and bus bandwidth over message sizes, on gloo (CPU) or NCCL (GPU), with a
correctness check of every result. Run it on a cluster's nodes before a long run to check the fabric.

    python scripts/bench_comm.py [--nproc 2] [--quick]                  # spawns its own ranks via torchrun
    torchrun --nnodes 2 --nproc-per-node 8 ... scripts/bench_comm.py    # or under your own launcher

size is the bytes of the full (largest) buffer per rank, as in nccl-tests: the all_reduce tensor,
the all_gather output, the reduce_scatter input. algbw = size / time; busbw = algbw x factor, the
per-link traffic of a ring: 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter;
busbw is what to compare with the link's speed. time is the slowest rank's mean over the timed
iterations.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n}


def run_op(op: str, size: int, world: int, rank: int, device: torch.device, dtype: torch.dtype, iters: int,
           warmup: int) -> tuple[float, float]:
    """Mean seconds per call (slowest rank) and the max abs error of the result."""
    count = max(size // torch.tensor([], dtype=dtype).element_size(), world)
    count -= count % world
    shard = count // world
    if op == "all_reduce":
        buf = torch.full((count,), float(rank + 1), dtype=dtype, device=device)
        fn = lambda: dist.all_reduce(buf)
        reset = lambda: buf.fill_(float(rank + 1))
        expected, check = world * (world + 1) / 2, lambda: buf
    elif op == "all_gather":
        inp = torch.full((shard,), float(rank + 1), dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        fn = lambda: ALL_GATHER(out, inp)
        reset = lambda: None
        expected = None
        check = lambda: out - torch.arange(1, world + 1, dtype=dtype, device=device).repeat_interleave(shard)
    else:
        inp = torch.full((count,), float(rank + 1), dtype=dtype, device=device)
        out = torch.empty(shard, dtype=dtype, device=device)
        fn = lambda: REDUCE_SCATTER(out, inp)
        reset = lambda: None
        expected, check = world * (world + 1) / 2, lambda: out
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        reset()
        fn()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    # correctness: one clean call
    reset()
    fn()
    sync()
    result = check().double()
    err = (result - expected).abs().max() if expected is not None else result.abs().max()
    err = torch.tensor([float(err)], dtype=torch.float64, device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return float(elapsed), float(err)


def bench(args: argparse.Namespace) -> None:
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    lo, hi = (1 << 10, 1 << 22) if args.quick else (args.min_bytes, args.max_bytes)
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= args.factor
    ops = args.ops.split(",")
    if rank == 0:
        gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
        print(f"# bench_comm: {backend}, {world} ranks, {args.dtype}, {args.iters} iters ({args.warmup} warm-up), "
              f"torch {torch.__version__}{gpu}")
        print(f"# {'op':<15} {'size(B)':>12} {'count':>11} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
              f"{'maxerr':>8}")
    peak_bus = {op: 0.0 for op in ops}
    wrong = 0
    for op in ops:
        for size in sizes:
            iters = args.iters if size <= (1 << 22) else max(args.iters // 4, 2)
            seconds, err = run_op(op, size, world, rank, device, dtype, iters, args.warmup)
            algbw = size / seconds / 1e9
            busbw = algbw * FACTORS[op](world)
            peak_bus[op] = max(peak_bus[op], busbw)
            wrong += err > 1e-3
            if rank == 0:
                count = size // torch.tensor([], dtype=dtype).element_size()
                print(f"  {op:<15} {size:>12,} {count:>11,} {seconds * 1e6:>11.1f} {algbw:>12.3f} {busbw:>12.3f} "
                      f"{err:>8.1e}", flush=True)
    if rank == 0:
        print("# peak busbw (GB/s): " + ", ".join(f"{op} {bw:.3f}" for op, bw in peak_bus.items())
              + f" | results wrong: {wrong}")
    dist.barrier()
    dist.destroy_process_group()
    if wrong:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--min-bytes", type=int, default=1 << 10)
    ap.add_argument("--max-bytes", type=int, default=1 << 26)
    ap.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 KiB to 4 MiB, 10 iterations")
    args = ap.parse_args()
    if args.quick:
        args.iters = min(args.iters, 10)
    if "RANK" in os.environ:
        bench(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0", __file__, *sys.argv[1:]]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(subprocess.run(cmd, env=env, timeout=1800).returncode)


if __name__ == "__main__":
    main()
