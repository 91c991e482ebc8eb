"""Benchmark of checkpoint saves and loads, in one run (not a test):

    python scripts/bench_ckpt.py [--layers 10] [--repeats 3] [--steps-per-save 2] [--quick]

State: the default config's model (width 256, grouped KV heads, vocab 4096) with `--layers` blocks,
after one AdamW step (weights + two moments: ~100 MB at 10 layers), in one process (world size 1).
1. Sync save and load MB/s through the Checkpointer (DCP shards checksummed while written,
   COMMIT.json; load = verify every checksum + DCP load) in its raw shard format (checkpoint.format=raw)
   and in DCP's standard format (checkpoint.format=dcp), and stock `dcp.save`/`dcp.load` alone, against a raw
   `torch.save` (+ fsync, locally, as the checkpointer does) / `torch.load(weights_only=True)` +
   `load_state_dict` of the same state to the same place: a local directory, and a loopback S3
   server (moto, started here on 127.0.0.1 with dummy credentials; raw goes through an fsspec file).
   Each figure is the median of `--repeats` runs, raw and checkpointer alternating.
2. Async: real training steps on the same model; the time training is blocked by an async save
   (the save() call plus any wait of optimizer.step() for the background copy), as a fraction of a
   sync save to the same place, and the step time while the background write runs.
Goals: sync save >= 0.8x the raw write; async blocking <= 10% of a sync save. The "raw/dcp" column is
what the raw shard format gains over DCP's standard one, both through the checkpointer. The machine's other
load shows up in every figure: compare the ratios, printed side by side from one run.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures is not installed

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.fixtures import start_s3
from trainer.checkpoint import Checkpointer, TrainState
from trainer.config import CheckpointConfig
from trainer.distributed.parallel import DistInfo
from trainer.distributed.torch_compat import FsspecReader as fsspec_reader
from trainer.distributed.torch_compat import FsspecWriter
from trainer.model.transformer import ModelArgs, Transformer
from trainer.observability import logs

SOLO = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def build(layers: int, seed: int = 0) -> tuple[Transformer, torch.optim.AdamW, int]:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=256, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=4096, seq_len=128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt)
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3  # weights, exp_avg, exp_avg_sq (fp32)
    return model, opt, nbytes


def train_step(model: Transformer, opt: torch.optim.Optimizer, batch: int = 4) -> None:
    x = torch.randint(0, model.args.vocab_size, (batch, model.args.seq_len + 1))
    logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_save(model, opt, url: str) -> None:
    with fsspec.open(url, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        if not url.startswith("s3://"):  # the checkpointer fsyncs local shards: so does the raw baseline
            f.flush()
            os.fsync(f.fileno())


def dcp_save(model, opt, url: str) -> None:
    """Stock DCP, no checksums and no commit: what the checkpointer builds on (for attribution)."""
    writer = FsspecWriter(url, sync_files=False) if url.startswith("s3://") else dcp.FileSystemWriter(url)
    sd = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
    dcp.save(sd, storage_writer=writer, no_dist=True)


def dcp_load(model, opt, url: str) -> None:
    """Stock DCP load (its own reader and planner) of a `dcp_save` directory."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, storage_reader=fsspec_reader(url) if url.startswith("s3://") else dcp.FileSystemReader(url),
             no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def raw_load(model, opt, url: str) -> None:
    with fsspec.open(url, "rb") as f:
        sd = torch.load(io.BytesIO(f.read()), weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def sync_round(where: str, root: str, model, opt, repeats: int) -> dict[str, list[float]]:
    """Alternate raw and checkpointer saves/loads `repeats` times; seconds per operation."""
    times: dict[str, list[float]] = {f"{who} {op}": [] for who in ("raw", "ckpt", "ckpt-dcp", "dcp")
                                     for op in ("save", "load")}
    ckpt = Checkpointer(f"{root}/ckpt", SOLO, CheckpointConfig(keep=2))
    standard = Checkpointer(f"{root}/ckpt-dcp", SOLO, CheckpointConfig(keep=2, format="dcp"))
    other, other_opt, _ = build(len(model.layers), seed=1)
    for i in range(repeats):
        times["raw save"].append(timed(lambda: raw_save(model, opt, f"{root}/raw.pt")))
        times["ckpt save"].append(timed(lambda i=i: ckpt.save(TrainState(step=i + 1), model, opt)))
        times["ckpt-dcp save"].append(timed(lambda i=i: standard.save(TrainState(step=i + 1), model, opt)))
        times["dcp save"].append(timed(lambda i=i: dcp_save(model, opt, f"{root}/dcp-{i}")))
        loads = (("raw load", lambda: raw_load(other, other_opt, f"{root}/raw.pt")),
                 ("ckpt load", lambda: ckpt.load(ckpt.discover_latest(), other, other_opt)),
                 ("ckpt-dcp load", lambda: standard.load(standard.discover_latest(), other, other_opt)),
                 ("dcp load", lambda i=i: dcp_load(other, other_opt, f"{root}/dcp-{i}")))
        for name, load in loads:
            times[name].append(timed(load))
            for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
                assert torch.equal(a, b), f"{name}: loaded state differs from the saved one"
            torch.nn.init.zeros_(other.norm.weight)  # so that a load that loads nothing cannot pass
    ckpt.close()
    standard.close()
    return times


def async_round(root: str, model, opt, repeats: int, steps_per_save: int) -> dict[str, list[float]]:
    """Train; every `steps_per_save` steps start an async save and keep training until it commits."""
    ckpt = Checkpointer(f"{root}/async", SOLO, CheckpointConfig(keep=2, async_=True))
    out: dict[str, list[float]] = {"blocked": [], "write": [], "step busy": [], "step idle": []}
    for _ in range(2):
        out["step idle"].append(timed(lambda: train_step(model, opt)))
    step = 0
    for _ in range(repeats):
        step += 1
        ckpt.save(TrainState(step=step), model, opt, blocking=False)
        started = time.perf_counter()
        while ckpt._pending is not None:
            out["step busy"].append(timed(lambda: train_step(model, opt)))
            step += 1
            if ckpt._pending.future.done():
                out["write"].append(time.perf_counter() - started)
            ckpt.poll()
        out["blocked"].append(ckpt.last_blocking_s)  # the save() call + optimizer.step() waiting for the copy
        for _ in range(steps_per_save):
            out["step idle"].append(timed(lambda: train_step(model, opt)))
    ckpt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10, help="transformer blocks (10: ~100 MB of state)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-per-save", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 repeat: a sanity run in seconds")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeats = 2, 1
    logs.setup()  # the checkpointer's own lines (retention), as the trainer says them
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    model, opt, nbytes = build(args.layers)
    mb = nbytes / 1e6
    print(f"state: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params + AdamW = {mb:.0f} MB "
          f"| {args.repeats} repeat(s), medians | torch {torch.__version__}, {os.cpu_count()} CPUs")
    server = start_s3()
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
            results["local"] = sync_round("local", tmp, model, opt, args.repeats)
            fs = fsspec.filesystem("s3")
            fs.mkdir("bench")
            results["s3"] = sync_round("s3", "s3://bench/run", model, opt, args.repeats)
            async_local = async_round(tmp, model, opt, args.repeats, args.steps_per_save)
            async_s3 = async_round("s3://bench/run", model, opt, args.repeats, args.steps_per_save)
    finally:
        server.stop()

    med = statistics.median
    print(f"\n{'MB/s':6} {'op':5} {'torch.save':>10} {'ckpt raw':>9} {'ckpt dcp':>9} {'stock dcp':>10} "
          f"{'ckpt raw/torch':>15} {'ckpt raw/ckpt dcp':>18}")
    for where, t in results.items():
        for op in ("save", "load"):
            raw, ck, ck_dcp, stock = (mb / med(t[f"{who} {op}"]) for who in ("raw", "ckpt", "ckpt-dcp", "dcp"))
            goal = "   (goal ckpt raw/torch >= 0.80)" if op == "save" else ""
            print(f"{where:6} {op:5} {raw:10.0f} {ck:9.0f} {ck_dcp:9.0f} {stock:10.0f} {ck / raw:15.2f} "
                  f"{ck / ck_dcp:18.2f}{goal}")
    print(f"\n{'async':6} {'blocked s':>10} {'sync save s':>12} {'blocked/sync':>13} {'write s':>8} "
          f"{'step s idle/busy':>17}")
    for where, a in (("local", async_local), ("s3", async_s3)):
        sync = med(results[where]["ckpt save"])
        blocked = med(a["blocked"])
        write = med(a["write"]) if a["write"] else float("nan")
        print(f"{where:6} {blocked:10.3f} {sync:12.3f} {blocked / sync:13.1%} {write:8.2f} "
              f"{med(a['step idle']):8.2f}/{med(a['step busy']):.2f}   (goal blocked/sync <= 10%)")


if __name__ == "__main__":
    main()
