"""Picture of a run: `python -m trainer.plot RUN_DIR [-o OUT.png]`.

Reads `RUN_DIR/metrics.jsonl` (one record per logged step, appended across restarts) and, when
present, the launcher's `RUN_DIR/events.jsonl` (start, commit, failure, restart, resume, preempt,
done). Writes a PNG (default `RUN_DIR/run.png`) with, against wall-clock minutes since the run
started: train and eval loss; tokens/s; where the step time goes; each rank's straggler score (its own
work per step over the other ranks' median) when a rank was reported as a straggler; and the
failure/restart timeline, with the time from each failure to the next resume shaded on every panel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.runtime.protocol import EVENTS_FILE, read_jsonl

BREAKDOWN_COLORS = {"data_wait_s": ("data wait", "#9467bd"), "fwd_bwd_s": ("forward+backward", "#1f77b4"),
                    "optim_s": ("optimizer", "#2ca02c"), "comm_wait_s": ("comm wait", "#d62728"),
                    "other_s": ("other (eval, ckpt, log)", "#7f7f7f")}
EVENT_STYLE = {"failure": ("#d62728", "x"), "restart": ("#ff7f0e", "o"), "resume": ("#2ca02c", "^"),
               "preempt": ("#9467bd", "v"), "commit": ("#1f77b4", "|"), "start": ("#000000", ">"),
               "done": ("#000000", "s"), "checkpoint_failed": ("#e377c2", "x"), "fallback": ("#bcbd22", "<"),
               "straggler": ("#8c564b", "D")}


def lost_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """(failure or preempt time, next resume time or the last known time) for each interruption."""
    spans, open_at = [], None
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] in ("failure", "preempt") and open_at is None:
            open_at = e["time"]
        elif e["event"] == "resume" and open_at is not None:
            spans.append((open_at, e["time"]))
            open_at = None
    if open_at is not None:
        spans.append((open_at, max(e["time"] for e in events)))
    return spans


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG for run_dir and return its path. Raises FileNotFoundError without metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time" in r and "step" in r]
    if not metrics:
        raise FileNotFoundError(f"no metrics records in {run_dir / 'metrics.jsonl'}")
    events = [e for e in read_jsonl(run_dir / EVENTS_FILE) if "event" in e and "time" in e]
    t0 = min([r["time"] for r in metrics] + [e["time"] for e in events])
    minutes = lambda t: (t - t0) / 60.0

    has_breakdown = any("fwd_bwd_s" in r for r in metrics)
    has_stragglers = any(e["event"] == "straggler" for e in events) and any("straggler_score" in r for r in metrics)
    rows = 3 + has_breakdown + has_stragglers
    heights = [3, 2] + ([2] if has_breakdown else []) + ([1.5] if has_stragglers else []) + [1.2]
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.2 * rows + 1), sharex=True,
                             gridspec_kw={"height_ratios": heights})
    ax_loss, ax_tps, *rest = axes
    x = [minutes(r["time"]) for r in metrics]
    _loss_panel(ax_loss, x, metrics, minutes)
    _throughput_panel(ax_tps, x, metrics)
    if has_breakdown:
        _breakdown_panel(rest[0], x, metrics)
    if has_stragglers:
        _straggler_panel(rest[-2], metrics, events, minutes)
    for ax in axes:
        for a, b in lost_intervals(events):
            ax.axvspan(minutes(a), minutes(b), color="#d62728", alpha=0.12, lw=0)
    _events_panel(rest[-1], events, minutes, marked=(ax_loss, ax_tps))
    fig.suptitle(_title(run_dir, metrics, events))
    fig.tight_layout()
    out = Path(out) if out else run_dir / "run.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _loss_panel(ax, x: list[float], metrics: list[dict], minutes) -> None:
    ax.plot(x, [r["loss"] for r in metrics], ".-", ms=3, lw=1, label="train loss")
    evals = [r for r in metrics if "eval_loss" in r]
    if evals:
        ax.plot([minutes(r["time"]) for r in evals], [r["eval_loss"] for r in evals], "o", color="#ff7f0e",
                label="eval loss")
    ax.set_ylabel("loss (nats)")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)


def _throughput_panel(ax, x: list[float], metrics: list[dict]) -> None:
    ax.plot(x, [r["tokens_per_s"] for r in metrics], ".-", ms=3, lw=1, color="#2ca02c")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    if all("mfu" in r for r in metrics):
        mfu_ax = ax.twinx()
        mfu_ax.plot(x, [100 * r["mfu"] for r in metrics], lw=0.8, color="#8c564b", alpha=0.6)
        mfu_ax.set_ylabel("MFU %", color="#8c564b")


def _breakdown_panel(ax, x: list[float], metrics: list[dict]) -> None:
    bottom = [0.0] * len(metrics)
    width = min((b - a for a, b in zip(x, x[1:], strict=False) if b > a), default=0.1) * 0.9
    for key, (label, color) in BREAKDOWN_COLORS.items():
        vals = [r.get(key) or 0.0 for r in metrics]
        if any(vals):
            ax.bar(x, vals, width=-width, bottom=bottom, color=color, label=label, align="edge")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("s / step")
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    ax.grid(alpha=0.3)


def _straggler_panel(ax, metrics: list[dict], events: list[dict], minutes) -> None:
    """The straggler score (own work per step over the other ranks' median) of each rank the ledger
    named as a straggler, the highest score of the others, and the factor that makes a rank slow."""
    scored = [r for r in metrics if r.get("straggler_score")]
    x = [minutes(r["time"]) for r in scored]
    named = sorted({e["rank"] for e in events if e["event"] == "straggler" and "rank" in e})
    for rank in named:
        ax.plot(x, [r["straggler_score"][rank] if rank < len(r["straggler_score"]) else float("nan") for r in scored],
                lw=0.9, label=f"rank {rank}")
    rest = [max((v for i, v in enumerate(r["straggler_score"]) if i not in named), default=float("nan"))
            for r in scored]
    ax.plot(x, rest, lw=0.8, color="#7f7f7f", label="highest of the other ranks")
    for factor in {e.get("factor") for e in events if e["event"] == "straggler" and e.get("factor")}:
        ax.axhline(factor, color="#8c564b", lw=0.8, ls=":")
    ax.set_ylabel("straggler score")
    ax.legend(loc="upper right", fontsize=7, ncol=4)
    ax.grid(alpha=0.3)


def _events_panel(ax, events: list[dict], minutes, marked: tuple) -> None:
    """The ledger's timeline; failures, restarts, resumes and preemptions also as lines on `marked`."""
    for name, (color, marker) in EVENT_STYLE.items():
        sel = [e for e in events if e["event"] == name]
        if not sel:
            continue
        ax.scatter([minutes(e["time"]) for e in sel], [0] * len(sel), color=color, marker=marker,
                   s=70 if name == "failure" else 50, label=name, zorder=5 if name == "failure" else 3)
        if name in ("failure", "restart", "resume", "preempt"):
            for e in sel:
                for other in marked:
                    other.axvline(minutes(e["time"]), color=color, lw=0.8, ls="--", alpha=0.7)
    for e in events:
        if e["event"] == "failure":
            ax.annotate(f"rank {e.get('rank', '?')} {e.get('cause', '?')}", (minutes(e["time"]), 0), xytext=(2, 8),
                        textcoords="offset points", fontsize=7, color="#d62728", rotation=30)
        elif e["event"] == "straggler":
            ax.annotate(f"rank {e.get('rank', '?')} {e.get('status', '?')} {e.get('score', 0):.1f}x",
                        (minutes(e["time"]), 0), xytext=(2, 8), textcoords="offset points", fontsize=7,
                        color="#8c564b", rotation=30)
        elif e["event"] == "resume" and "lost_steps" in e:
            ax.annotate(f"step {e.get('step', '?')}, lost {e['lost_steps']}", (minutes(e["time"]), 0),
                        xytext=(2, -14), textcoords="offset points", fontsize=7, color="#2ca02c")
    ax.set_yticks([])
    ax.set_ylim(-1, 1)
    ax.set_ylabel("events")
    if events:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=len(EVENT_STYLE), fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0, "no events.jsonl", transform=ax.get_yaxis_transform(), ha="center", va="center",
                fontsize=8, color="gray")
    ax.set_xlabel("minutes since start")


def _title(run_dir: Path, metrics: list[dict], events: list[dict]) -> str:
    title = f"{run_dir.name}: {metrics[-1]['step']} steps"
    done = [e for e in events if e["event"] == "done"]
    if done:
        d = done[-1]
        if "goodput" in d:
            title += f" | goodput {100 * d['goodput']:.1f}%"
        if "restarts" in d:
            title += f" | {d['restarts']} restart(s)"
    failures = sum(e["event"] == "failure" for e in events)
    if failures:
        title += f" | {failures} failure(s)"
    return title


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="run directory with metrics.jsonl (and events.jsonl)")
    ap.add_argument("-o", "--out", help="PNG to write (default RUN_DIR/run.png)")
    args = ap.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
