"""Project goodput at 1k-100k GPUs from the recovery costs a run measured.

    python scripts/project_goodput.py [EVENTS.jsonl | RUN_DIR ...] [--gpus 1024,16384,100000]
        [--checkpoint-interval-min 30] [--mtbf-hours H] [--plot OUT.png] [--<assumption> VALUE ...]

This script owns the projection only: it reads the launcher's ledgers (`events.jsonl`, launch/ledger.py),
takes the median of each measured recovery component over their `resume` events (a missing `path` reads
as "restart"; `path: "in-process"` events give leave, wait + re-form, restore and first step; those a spare
ended, named by the `in_process_done` event after them, give the survivors' wait for the spare), falls back
to built-in values for every component no file measured (the output says which), and projects four
strategies: durable (every rank restarts and loads the durable checkpoint, losing half a checkpoint
interval), memory (every rank restarts, state from the memory tier), in-process (only the failed rank
restarts; the survivors keep their processes, CUDA contexts, store connections and state; a lost node's
survivors go on in a smaller world, and the world restarts from memory when a node joins) and in-process with
spares (a lost node's ranks start on a spare in process, the survivors waiting for them).

Model, per strategy and GPU count N: failures arrive as a Poisson process of rate lam = N / mtbf_hours
(the per-GPU rate is constant); each costs R(N) seconds of recovery, during which the whole job waits
(a failure during a recovery starts it again), and W seconds of redone work. Then
    goodput = max(0, 1 - lam * W) * exp(-lam * R(N))
Only failures are charged: checkpoint saves, evals and the first start are outside this number. The
shape (failures x (restart overhead + work since the last checkpoint)) is that of Young/Daly and of the
ETTR estimate in Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research
Clusters" (Meta, arXiv:2410.21680, 2024); no number is taken from the latter.

Assumptions (each a field of `Assumptions` and a CLI option; the measured parts do not grow with N):
- failure rate: Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, sec. 3.3.4): 419 unexpected
  interruptions in 54 days on 16,384 GPUs, i.e. one per 50,677 GPU-hours; 78% hardware.
- c10d TCPStore init when every rank reconnects: linear in ranks through PyTorch's libuv TCPStore
  tutorial's one stated point (~100 s at 96K ranks; the legacy backend timed out past 30 min).
- NCCL communicator init: a base plus a super-linear term, 100 s at 96K ranks, exponent 1.5 (our
  assumption: NVIDIA/nccl PR #1789 (Meta, 2025) reports "several dozens of seconds at 100K scale" from
  two O(N^2) CPU loops alone; Meta's NCCLX paper, arXiv:2510.20171, names stock NCCL start-up at 100k
  GPUs a bottleneck; summaries of it quote ~265 s at 96k, not checked). ncclCommInitRankScalable (NCCL
  2.23) lowers it (--nccl-*); ncclCommShrink/grow would let in-process skip most (--reform-comm-fraction).
- redone work: half a checkpoint interval (durable); (median lost steps + half a step) x step_s
  (memory tier, in-process). Detection (failure -> noticed): built in, for every strategy (a ledger
  cannot see the moment of a kill; scripts/chaos.py and bench_restart.py measure it from outside).
- durable load: bandwidth-bound, state per GPU (Llama 3 sec. 3.3.1: 1 MB-4 GB per GPU) over the
  smaller of a per-GPU client link and the storage's aggregate (Tectonic: 2 TB/s sustained, ibid.).
- restarts wait for the slowest of the nodes' process starts: start * (1 + cv * sqrt(2 ln nodes)),
  the expected maximum of normal variables; cv is an assumption. GPU process start (CUDA context,
  NCCL load), invisible to a CPU measurement, is an assumed constant.
- node replacement: with hot spares (default) a spare takes the failed node's place within the
  measured start; without, hardware failures also wait node_replace_s (assumed: minutes)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from trainer.runtime.protocol import EVENTS_FILE, read_jsonl

STRATEGIES = ("durable", "memory", "in-process", "in-process-spares")
LABELS = {"durable": "restart world, durable", "memory": "restart world, memory",
          "in-process": "in-process, node rejoins by restart", "in-process-spares": "in-process, spares in process"}
POSITIVE = ("mtbf_hours", "gpus_per_node", "store_ref_ranks", "nccl_ref_ranks", "storage_gbps", "client_gbps",
            "peer_gbps")  # divisors; the other assumptions may be 0
LLAMA3_GPU_HOURS_PER_FAILURE = 16384 * 54 * 24 / 419  # sec. 3.3.4: 419 unexpected interruptions, 54 days


class EventsError(Exception):
    """An events file that cannot be used; main prints it as one line and exits 2."""


def _a(default: float | bool, source: str) -> float:
    return field(default=default, metadata={"help": source})  # type: ignore[return-value]


@dataclass(frozen=True)
class Assumptions:
    """What the projection assumes about scale; every field is a CLI option (--field-name)."""

    mtbf_hours: float = _a(round(LLAMA3_GPU_HOURS_PER_FAILURE, 1), "hours between failures of one GPU (Llama 3 3.3.4)")
    checkpoint_interval_min: float = _a(30.0, "durable checkpoint interval; loses half of it (assumption)")
    step_s: float = _a(5.0, "step time at scale; a memory/in-process recovery redoes half a step (assumption)")
    gpus_per_node: float = _a(8, "GPUs per node (Llama 3 3.3.1: 8 per Grand Teton server)")
    detect_extra_s: float = _a(0.0, "detection beyond the measured one, e.g. a collective timeout (assumption)")
    gpu_init_s: float = _a(5.0, "CUDA context + NCCL load per new process, unseen on CPU (assumption)")
    startup_cv: float = _a(0.1, "spread of process start across nodes, tail = 1+cv*sqrt(2 ln nodes) (assumption)")
    store_ref_s: float = _a(100.0, "TCPStore init, every rank connecting, at store_ref_ranks (PyTorch libuv tutorial)")
    store_ref_ranks: float = _a(98304, "ranks of store_ref_s (96K, PyTorch libuv TCPStore tutorial); linear")
    barrier_us_per_rank: float = _a(20.0, "in-process re-form: store barrier per rank on the kept store (assumption)")
    nccl_base_s: float = _a(2.0, "NCCL communicator init independent of size (assumption)")
    nccl_ref_s: float = _a(100.0, "NCCL init at nccl_ref_ranks (assumption; NCCL PR #1789, NCCLX arXiv:2510.20171)")
    nccl_ref_ranks: float = _a(98304, "ranks of nccl_ref_s")
    nccl_exp: float = _a(1.5, "NCCL init growth exponent: bootstrap O(N), ring/transport setup O(N^2) (assumption)")
    reform_comm_fraction: float = _a(1.0, "in-process share of a full NCCL init (1: ncclCommInitRank; <1: shrink/grow)")
    state_gb_per_gpu: float = _a(2.0, "checkpoint state per GPU (Llama 3 3.3.1: 1 MB-4 GB per GPU)")
    storage_gbps: float = _a(2000.0, "durable store aggregate read GB/s (Llama 3 3.3.1: Tectonic 2 TB/s sustained)")
    client_gbps: float = _a(5.0, "read GB/s one GPU can pull from the durable store (assumption)")
    peer_gbps: float = _a(50.0, "GB/s of a peer copy to a replaced rank: 400 Gb/s per GPU (Llama 3 3.3.1)")
    hw_fraction: float = _a(0.78, "share of failures that take a node out (Llama 3 3.3.4: 78% hardware)")
    hot_spares: bool = _a(True, "a spare node replaces a failed one at no extra cost (assumption)")
    node_replace_s: float = _a(300.0, "without hot spares: scheduler drain + allocate + health check (assumption)")


@dataclass
class Measured:
    """Recovery components in seconds (lost_* in steps), measured on a small run; taken as scale-free.
    Built-in values: docs/performance.md's chaos run (2026-12-05, 2 CPU cores, memory tier, warm
    restarts) and its durable resume; the in-process ones: bench_restart.py at 2 ranks (2026-12-05)."""

    detect_s: float = 0.1
    spawn_s: float = 0.06
    startup_s: float = 0.25
    load_memory_s: float = 0.09
    load_durable_s: float = 0.15
    first_step_s: float = 0.12
    lost_steps_memory: float = 0.0
    leave_s: float = 0.001
    reform_s: float = 0.235  # the survivors' wait for the replacement's warm start, and re-forming the groups
    restore_s: float = 0.087
    inproc_first_step_s: float = 0.236
    lost_steps_inprocess: float = 0.0
    spare_s: float = 1.0  # the survivors' wait for a spare's ranks and re-forming (test_launch_multinode, 2026-12-07)
    sources: dict[str, str] = field(default_factory=dict)  # field -> "median of k"; absent: built-in
    runs: list[str] = field(default_factory=list)


@dataclass
class Row:
    gpus: int
    strategy: str
    failures_per_day: float
    recovery_s: float
    lost_s: float
    goodput: float


def read_events(path: Path) -> list[dict]:
    """The records of one events.jsonl (or a run directory holding one); torn lines are skipped."""
    if path.is_dir():
        path = path / EVENTS_FILE
    if not path.is_file():
        raise EventsError(f"cannot read {path}: No such file or directory")
    try:
        records = [r for r in read_jsonl(path) if isinstance(r, dict) and "event" in r]
    except (OSError, UnicodeDecodeError) as e:
        raise EventsError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not records:
        raise EventsError(f"{path}: no ledger events (expected the launcher's events.jsonl)")
    return records


def measure(paths: list[Path]) -> Measured:
    """Medians of the measured components over every file's resume events."""
    m, samples = Measured(), {}

    def add(name: str, value: object) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            samples.setdefault(name, []).append(float(value))

    for path in paths:
        events = read_events(path)
        resumes = [e for e in events if e["event"] == "resume"]
        done = next((e for e in reversed(events) if e["event"] == "done"), None)
        fails = sum(e["event"] == "failure" for e in events)
        summary = f"{path}: {fails} failure(s), {len(resumes)} resume(s)"
        if done and "goodput" in done:
            summary += f", run goodput {100 * done['goodput']:.1f}% over {done.get('wall_s', 0):.0f} s"
        m.runs.append(summary)
        for r in _spare_resumes(events):
            if isinstance(r.get("wait_s"), (int, float)) and isinstance(r.get("reform_s"), (int, float)):
                add("spare_s", r["wait_s"] + r["reform_s"])
        for r in resumes:
            if r.get("path", "restart") == "in-process":
                for key, name in (("leave_s", "leave_s"), ("restore_s", "restore_s"),
                                  ("first_step_s", "inproc_first_step_s"), ("lost_steps", "lost_steps_inprocess")):
                    add(name, r.get(key))
                if isinstance(r.get("wait_s"), (int, float)) and isinstance(r.get("reform_s"), (int, float)):
                    add("reform_s", r["wait_s"] + r["reform_s"])  # the replacement's start, then the groups
                continue
            for key in ("spawn_s", "startup_s", "first_step_s"):
                add(key, r.get(key))
            tier = str(r.get("tier", "durable"))
            if tier.startswith("memory"):
                add("load_memory_s", r.get("load_s"))
                add("lost_steps_memory", r.get("lost_steps"))
            elif tier == "durable":
                add("load_durable_s", r.get("load_s"))
    for name, values in samples.items():
        setattr(m, name, statistics.median(values))
        m.sources[name] = f"median of {len(values)}"
    return m


def _spare_resumes(events: list[dict]) -> list[dict]:
    """The in-process resumes a spare ended: each the last one of its node before an `in_process_done` event that
    names a spare (the launcher writes it once its ranks' first step is done)."""
    found = []
    for done in (e for e in events if e["event"] == "in_process_done" and e.get("spare")):
        before = [e for e in events if e["event"] == "resume" and e.get("path") == "in-process"
                  and e.get("node") == done.get("node") and done["time"] - 10 <= e["time"] <= done["time"]]
        found += before[-1:]
    return found


def recovery(m: Measured, a: Assumptions, gpus: int) -> dict[str, tuple[float, float]]:
    """Per strategy: (seconds the job waits per failure, seconds of work redone per failure)."""
    nodes = max(gpus / a.gpus_per_node, 1.0)
    tail = 1 + a.startup_cv * math.sqrt(2 * math.log(nodes))
    store = a.store_ref_s * gpus / a.store_ref_ranks
    nccl = a.nccl_base_s + a.nccl_ref_s * (gpus / a.nccl_ref_ranks) ** a.nccl_exp
    replace_s = 0.0 if a.hot_spares else a.hw_fraction * a.node_replace_s  # the job waits for a node
    peer = a.state_gb_per_gpu / a.peer_gbps  # the replaced node's ranks copy their state from a peer
    durable_load = m.load_durable_s + a.state_gb_per_gpu / min(a.client_gbps, a.storage_gbps / gpus)
    detect = m.detect_s + a.detect_extra_s
    world = detect + (m.spawn_s + m.startup_s + a.gpu_init_s) * tail + store + nccl + m.first_step_s
    regroup = (a.gpu_init_s + a.barrier_us_per_rank * 1e-6 * gpus + a.reform_comm_fraction * nccl + m.restore_s
               + peer + m.inproc_first_step_s)
    inproc = detect + m.leave_s + m.reform_s + regroup  # a failed rank: replaced alone
    spare = detect + m.leave_s + m.spare_s + regroup  # a lost node: its ranks started on a spare
    memory = world + m.load_memory_s + peer
    hw, redo = a.hw_fraction, (m.lost_steps_inprocess + 0.5) * a.step_s
    # Without spares in process, a lost node's survivors go on in a smaller world (in process, waiting for no
    # node), and the world restarts from memory when a node joins: both, for the hardware share of failures.
    return {"durable": (replace_s + world + durable_load, a.checkpoint_interval_min * 60 / 2),
            "memory": (replace_s + memory, (m.lost_steps_memory + 0.5) * a.step_s),
            "in-process": (inproc + hw * memory, redo + hw * (m.lost_steps_memory + 0.5) * a.step_s),
            "in-process-spares": (replace_s + (1 - hw) * inproc + hw * spare, redo)}


def project(m: Measured, a: Assumptions, gpus: int) -> list[Row]:
    lam = gpus / (a.mtbf_hours * 3600)  # failures per second of wall time
    rows = []
    for strategy, (rec, lost) in recovery(m, a, gpus).items():
        goodput = max(0.0, 1 - lam * lost) * math.exp(-lam * rec)
        rows.append(Row(gpus, strategy, lam * 86400, rec, lost, goodput))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| GPUs | strategy | failures/day | recovery s/failure | redone work s/failure | goodput % |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.gpus:,} | {LABELS[r.strategy]} | {r.failures_per_day:.1f} | {r.recovery_s:.1f} "
                     f"| {r.lost_s:.1f} | {100 * r.goodput:.2f} |")
    return "\n".join(lines)


def describe(m: Measured, a: Assumptions) -> str:
    if not m.runs:
        head = "measured costs: built-in defaults (no events file given; see Measured in this script)"
    else:
        builtin = [f.name for f in fields(Measured) if f.name not in ("sources", "runs") and f.name not in m.sources]
        head = "\n".join(["measured costs from:", *(f"  {r}" for r in m.runs),
                          "  from the events: " + (", ".join(f"{k} ({v})" for k, v in m.sources.items()) or "none"),
                          "  built-in: " + (", ".join(builtin) or "none")])
    changed = [f"{f.name}={getattr(a, f.name)}" for f in fields(Assumptions) if getattr(a, f.name) != f.default]
    return (f"{head}\nfailure rate: one per {a.mtbf_hours:,.0f} GPU-hours (Llama 3: 419 in 54 days on 16,384 GPUs), "
            f"linear in GPUs\nassumptions: {'defaults' if not changed else ', '.join(changed)}")


def plot(m: Measured, a: Assumptions, gpus: list[int], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise EventsError("--plot needs matplotlib (pip install matplotlib, or the dev extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted({round(2 ** (k / 4)) for k in range(36, 69)} | set(gpus))  # 512 .. 131072
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    for strategy, style in zip(STRATEGIES, ("-", "--", "-.", ":"), strict=True):
        ys = [100 * next(r.goodput for r in project(m, a, x) if r.strategy == strategy) for x in xs]
        ax.plot(xs, ys, style, label=LABELS[strategy])
        ax.plot(gpus, [ys[xs.index(g)] for g in gpus], "o", color=ax.lines[-1].get_color(), markersize=4)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput % (failures only)")
    ax.set_title("Projected goodput (Llama 3 failure rate)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out)
    except OSError as e:
        raise EventsError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("events", nargs="*", type=Path, help="events.jsonl files or run directories (none: built-ins)")
    p.add_argument("--gpus", default="1024,16384,100000", help="comma-separated GPU counts")
    p.add_argument("--plot", type=Path, help="also write a goodput-vs-GPUs plot (PNG) here")
    for f in fields(Assumptions):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            p.add_argument(flag, type=float, default=f.default, metavar="X", help=f"{f.metadata['help']} [{f.default}]")
    args = p.parse_args(argv)
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        p.error(f"--gpus wants comma-separated integers, got {args.gpus!r}")
    if min(args.gpus) < 1:
        p.error("--gpus: every count must be at least 1")
    for f in fields(Assumptions):
        value, positive = getattr(args, f.name), f.name in POSITIVE
        if not isinstance(value, bool) and (value <= 0 if positive else value < 0):
            p.error(f"--{f.name.replace('_', '-')} must be {'above 0' if positive else 'at least 0'}, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    a = replace(Assumptions(), **{f.name: getattr(args, f.name) for f in fields(Assumptions)})
    try:
        m = measure(args.events)
        print(describe(m, a) + "\n")
        print(format_table([row for g in args.gpus for row in project(m, a, g)]))
        if args.plot:
            plot(m, a, args.gpus, args.plot)
            print(f"\nplot: {args.plot}")
    except EventsError as e:
        print(f"project_goodput: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
