"""Command line: `python -m launch [options] CONFIG [key=value ...]` trains CONFIG under the
supervisor (launch/supervisor.py): restarts on crashes, kills and hangs, resumes from the last
committed checkpoint, stops on a crash loop, checkpoints and exits 75 on SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys

from trainer import logs
from trainer.protocol import EXIT_USAGE

log = logs.get_logger(root=logs.LAUNCHER)

EPILOG = """exit codes: 0 done | 1 failed (restart budget spent, or launcher error) | 2 bad config or input |
3 crash loop (the same failure at the same step again and again) | 75 preempted (emergency checkpoint
committed; launch again to resume)

examples:
  python -m launch --nproc-per-node 2 configs/smoke.yaml
  python -m launch --nnodes 1:2 --nproc-per-node 8 --rdzv-endpoint node0:29400 configs/llama-1b.yaml"""


def _env(name: str, default):
    """torchrun's convention: every option can come from PET_<OPTION> (the Kubeflow operator sets these)."""
    return os.environ.get(f"PET_{name}", default)


def nproc_per_node(value: str) -> int:
    """torchrun's values: a number, `gpu` (the visible GPUs), `cpu` (the CPUs) or `auto` (GPUs if any,
    else CPUs). Raises ValueError for anything else, and for `gpu` without GPUs."""
    if value in ("auto", "gpu", "cpu"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if value == "gpu" and not gpus:
            raise ValueError("no GPUs")
        return gpus if value != "cpu" and gpus else os.cpu_count() or 1
    return int(value)


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m launch", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", default=_env("NPROC_PER_NODE", "1"),
                   help="ranks on this node: N, or auto (the GPUs, else the CPUs), gpu or cpu, as torchrun (default 1)")
    p.add_argument("--nnodes", default=_env("NNODES", "1"), help="N or MIN:MAX nodes (elastic between MIN and MAX)")
    p.add_argument("--max-restarts", type=int, default=_env("MAX_RESTARTS", None),
                   help="restart budget (default fault.max_restarts)")
    p.add_argument("--rdzv-endpoint", default=_env("RDZV_ENDPOINT", ""),
                   help="HOST:PORT of the c10d rendezvous (default: this node alone, on 127.0.0.1)")
    p.add_argument("--rdzv-id", default=_env("RDZV_ID", ""),
                   help="job id shared by all nodes (default: from run.name and run.dir)")
    p.add_argument("--rdzv-conf", default=_env("RDZV_CONF", ""),
                   help="extra rendezvous settings, k=v,k=v (e.g. join_timeout=600)")
    p.add_argument("--local-addr", default=None, help="address other nodes reach this one at")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logs.setup(logs.LAUNCHER, stream=sys.stderr)
    from trainer.config import ConfigError, load, validate

    try:
        lo, _, hi = args.nnodes.partition(":")
        min_nodes, max_nodes = int(lo), int(hi or lo)
        nproc = nproc_per_node(args.nproc_per_node)
        if not 1 <= min_nodes <= max_nodes or nproc < 1:
            raise ValueError
    except ValueError:
        log.error(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, and --nproc-per-node N >= 1, auto, "
                  f"gpu (with GPUs) or cpu; got {args.nnodes!r}, {args.nproc_per_node!r}")
        return EXIT_USAGE
    try:
        conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if kv)
    except ValueError:
        log.error(f"--rdzv-conf must be k=v,k=v; got {args.rdzv_conf!r}")
        return EXIT_USAGE
    try:
        cfg = load(args.config, args.overrides)
        validate(cfg)
    except ConfigError as e:
        log.error(f"config: {e}")
        return EXIT_USAGE

    from launch import lock
    from launch.options import LaunchOptions
    from launch.supervisor import Supervisor

    job = lock.job_key(args.rdzv_endpoint, args.rdzv_id)
    opts = LaunchOptions(args.config, args.overrides, nproc, min_nodes, max_nodes, args.max_restarts,
                         args.rdzv_endpoint, args.rdzv_id, conf, args.local_addr, job=job)
    try:
        with lock.claim(cfg.run.dir, job):
            return Supervisor(cfg, opts).run()
    except lock.RunDirInUse as e:
        log.error(str(e))
        return EXIT_USAGE


if __name__ == "__main__":
    from trainer.process import exit_now

    exit_now(main())  # the agent thread may still be in a rendezvous: no teardown around it
