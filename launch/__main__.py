"""Command line: `python -m launch [options] CONFIG [key=value ...]` trains CONFIG under the
supervisor (launch/supervisor.py): restarts on crashes, kills and hangs, resumes from the last
committed checkpoint, stops on a crash loop, checkpoints and exits 75 on SIGTERM."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

from common.clock import call_bounded
from common.timing import MEMORY_SWEEP_S
from trainer.contract import EXIT_USAGE, Config, logs, memory_sweep

log = logs.get_logger(root=logs.LAUNCHER)

EPILOG = """exit codes: 0 done | 1 failed (restart budget spent, launcher error, or preempted without an
emergency checkpoint) | 2 bad config or input | 3 crash loop (the same failure at the same step again and
again) | 4 storage could not be used within storage.* (restarted with backoff until the budget is spent) |
75 preempted, or the node hosting the (last listed) rendezvous endpoint lost (launch again to resume)

torchrun's spellings work (--nproc_per_node, --standalone, --rdzv-backend c10d, --node-rank, PET_*
variables); its options that have no meaning here (--master-addr, --log-dir, ...) are refused by name.

examples:
  python -m launch --nproc-per-node 2 configs/smoke.yaml
  python -m launch --nnodes 1:2 --nproc-per-node 8 --rdzv-endpoint node0:29400,node1:29401 configs/llama-1b.yaml"""


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


def quiet_cpp_warnings() -> None:
    """torch's C++ warnings off in the launcher, its fork server and its ranks (TORCH_CPP_LOG_LEVEL=ERROR,
    unless it is set): a lost node makes every TCP store client print warnings with dozens of C++ stack
    frames, where the launcher says what happened in one line. Read once, when torch's C++ library loads:
    before anything imports torch."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# torchrun options this launcher does not have, each with what to do instead (refused by name).
NOT_SUPPORTED = {
    "--master-addr": "use --rdzv-endpoint HOST:PORT (c10d rendezvous)",
    "--master-port": "use --rdzv-endpoint HOST:PORT (c10d rendezvous)",
    "--log-dir": "the ranks' output goes to this launcher's stdout/stderr; run.dir holds metrics and events",
    "--redirects": "the ranks' output goes to this launcher's stdout/stderr",
    "--tee": "the ranks' output goes to this launcher's stdout/stderr",
    "--role": "one role: the trainer",
    "--monitor-interval": "the watchdog reads heartbeats every fault.heartbeat_s",
    "--start-method": "the ranks are started as processes, as torchrun's default",
    "--no-python": "the launcher runs `python -m trainer`",
    "--run-path": "the launcher runs `python -m trainer`",
    "--module": "the launcher runs `python -m trainer`",
    "--local-ranks-filter": "every rank's output is shown",
}


def _spellings(option: str) -> list[str]:
    """torchrun accepts both --nproc-per-node and --nproc_per_node."""
    return [option, option.replace("-", "_").replace("__", "--", 1)]


def refused_torchrun_option(argv: list[str]) -> str:
    """The first torchrun option in `argv` that this launcher does not have, with what to use instead."""
    for arg in argv:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in NOT_SUPPORTED or name == "-m":
            key = "--module" if name == "-m" else name
            return f"torchrun's {arg.split('=', 1)[0]} is not supported by python -m launch: {NOT_SUPPORTED[key]}"
    return ""


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m launch", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(*_spellings("--nproc-per-node"), dest="nproc_per_node", default=_env("NPROC_PER_NODE", "1"),
                   help="ranks on this node: N, or auto (the GPUs, else the CPUs), gpu or cpu, as torchrun (default 1)")
    p.add_argument("--nnodes", default=_env("NNODES", "1"), help="N or MIN:MAX nodes (elastic between MIN and MAX)")
    p.add_argument(*_spellings("--max-restarts"), dest="max_restarts", type=int, default=_env("MAX_RESTARTS", None),
                   help="restart budget (default fault.max_restarts)")
    p.add_argument("--standalone", action="store_true",
                   help="one node, rendezvous on 127.0.0.1 (the default without --rdzv-endpoint), as torchrun")
    p.add_argument(*_spellings("--rdzv-backend"), dest="rdzv_backend", default=_env("RDZV_BACKEND", "c10d"),
                   help="c10d, the only rendezvous backend (as torchrun's default)")
    p.add_argument(*_spellings("--rdzv-endpoint"), dest="rdzv_endpoint", default=_env("RDZV_ENDPOINT", ""),
                   help="HOST:PORT of the c10d rendezvous (default: this node alone, on 127.0.0.1); a list "
                        "HOST:PORT,HOST:PORT,... in order: when the node hosting one is lost, the others move on")
    p.add_argument(*_spellings("--rdzv-id"), dest="rdzv_id", default=_env("RDZV_ID", ""),
                   help="job id shared by all nodes (default: from run.name and run.dir)")
    p.add_argument(*_spellings("--rdzv-conf"), dest="rdzv_conf", default=_env("RDZV_CONF", ""),
                   help="extra rendezvous settings, k=v,k=v (e.g. join_timeout=600)")
    p.add_argument(*_spellings("--node-rank"), dest="node_rank", default=_env("NODE_RANK", None),
                   help="accepted as torchrun does and not needed: the c10d rendezvous numbers the nodes")
    p.add_argument(*_spellings("--local-addr"), dest="local_addr", default=None,
                   help="address other nodes reach this one at")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    return p.parse_args(argv)


def torchrun_conflicts(args) -> str:
    """What is wrong with the torchrun-style options given ('' if nothing)."""
    if args.rdzv_backend != "c10d":
        return f"--rdzv-backend {args.rdzv_backend!r} is not supported: c10d is the only rendezvous backend"
    if args.standalone and (args.rdzv_endpoint or args.nnodes not in ("1", "1:1")):
        return "--standalone is one node with a local rendezvous: drop --rdzv-endpoint and --nnodes"
    return ""


def start_fork_server(cfg):
    """Warm restarts (fault.warm_restarts, Linux): the fork server, started before this launcher imports
    torch (launch.supervisor) so that the two imports overlap: the first ranks wait for both. None when off."""
    if not (cfg.fault.warm_restarts and sys.platform.startswith("linux")):  # (PR_SET_PDEATHSIG, pidfd)
        return None
    from launch.zygote import Zygote

    zygote = Zygote(cfg.run.dir)
    zygote.start()  # on the main thread: PR_SET_PDEATHSIG follows the thread that started it
    return zygote


def sweep_memory(cfg: Config) -> list[memory_sweep.Removed]:
    """Remove this node's memory snapshots of other runs whose run.dir is gone or that are older than
    checkpoint.memory_max_age_h (trainer.runtime.memory_sweep), one line each, before any rank starts;
    waited for at most MEMORY_SWEEP_S, so that a file system that stopped answering does not hold the start.
    Returns what was removed (`memory_sweep.Removed`) within that bound."""
    ck, removed = cfg.checkpoint, []

    def found(one: memory_sweep.Removed) -> None:
        removed.append(one)
        log.info(one.line())

    done = call_bounded(lambda: memory_sweep.sweep(memory_sweep.bases(ck.memory_dir), cfg.run.dir,
                                                   ck.memory_max_age_h * 3600, on_removed=found),
                        MEMORY_SWEEP_S, name="memory-sweep")
    if not done.done:
        log.warning(f"the sweep of old memory snapshots did not finish within {MEMORY_SWEEP_S:.0f}s: going on")
    elif done.error is not None:
        log.warning(f"the sweep of old memory snapshots failed: {type(done.error).__name__}: {done.error}")
    return list(removed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_cpp_warnings()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <launcher pid>`: its stacks; it goes on
    logs.setup(logs.LAUNCHER, stream=sys.stderr)
    refused = refused_torchrun_option(argv)
    if refused:
        log.error(refused)
        return EXIT_USAGE
    args = parse_args(argv)
    conflict = torchrun_conflicts(args)
    if conflict:
        log.error(conflict)
        return EXIT_USAGE
    from trainer.contract import ConfigError, load, validate

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

    job = lock.job_key(args.rdzv_endpoint, args.rdzv_id)
    opts = LaunchOptions(args.config, args.overrides, nproc, min_nodes, max_nodes, args.max_restarts,
                         args.rdzv_endpoint, args.rdzv_id, conf, args.local_addr, job=job)
    try:
        with lock.claim(cfg.run.dir, job):
            zygote = start_fork_server(cfg)
            sweep_memory(cfg)  # while the fork server imports torch
            from launch.supervisor import Supervisor  # imports torch, while the fork server does the same

            return Supervisor(cfg, opts, zygote).run()
    except lock.RunDirInUse as e:
        log.error(str(e))
        return EXIT_USAGE


if __name__ == "__main__":
    from trainer.contract import exit_now

    exit_now(main())  # the agent thread may still be in a rendezvous: no teardown around it
