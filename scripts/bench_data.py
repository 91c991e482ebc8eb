"""Benchmark of the data pipeline, in one run (not a test):

    .venv/bin/python scripts/bench_data.py [--megabytes 12] [--vocab-size 2048] [--seq-len 256]

1. data.prepare tokens/s against a raw `tokenizer.encode_batch` baseline on the same text with the same
   process count (1 process, then 2, ...), one tokenizer thread per process in both; ratio prepare /
   baseline, and prepare's speed-up from 1 process to more.
2. loader tokens/s per rank (rank 0 of 2) from local shards and from a loopback S3 server (moto, started
   here on 127.0.0.1 with dummy credentials), with 0 and 2 worker processes; ratio S3 / local.
3. time to the first batch after a resume at an early and a late offset (fresh ShardSet each time: manifest,
   order, shard fetch + checksum), local and S3; median of several tries, early and late alternating.
4. the trainer's data wait as a share of step time on configs/default.yaml (the demo) for a few steps.
The text is the built-in corpus's (Python standard library sources); nothing is downloaded.
Modules that import torch are imported inside functions: the process pools of section 1 start by
spawning, which re-imports this script, and must not pay for torch there.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures is not installed

from data import tokenizer as tokenizers_
from data.corpus import read_source, source_files
from data.prepare import chunks, prepare
from data.shards import ShardSet
from tests.fixtures import start_s3


def upload(local: Path, url: str) -> str:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.mkdir(path.split("/")[0])
    for f in sorted(local.iterdir()):
        fs.pipe_file(f"{path}/{f.name}", f.read_bytes())
    return url


# --- 1. prepare vs raw encode_batch

_baseline_tok = None


def _init(tokenizer_json: str) -> None:
    global _baseline_tok  # per-process tokenizer of the baseline pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as in data.prepare
    _baseline_tok = tokenizers_.from_bytes(tokenizer_json.encode())


def _count(chunk: list[str]) -> int:
    return sum(len(e.ids) for e in _baseline_tok.encode_batch(chunk, add_special_tokens=False))


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (pools are joined before they are counted)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def baseline_rate(tok, docs: list[str], processes: int) -> tuple[float, float]:
    """Raw encode_batch, one thread per process, on the same chunks prepare uses: in this process for 1,
    else a spawned pool of `processes` (its start-up counted, as prepare's is). Returns (tokens/s, CPU s)."""
    work = list(chunks(docs))
    t, cpu = time.perf_counter(), cpu_seconds()
    if processes == 1:
        _init(tok.to_str())
        n = sum(map(_count, work))
    else:
        with multiprocessing.get_context("spawn").Pool(processes, _init, (tok.to_str(),)) as pool:
            n = sum(pool.imap(_count, work))
    return n / (time.perf_counter() - t), cpu_seconds() - cpu


def prepare_rate(tok, docs: list[str], processes: int, out: str, shard_tokens: int) -> tuple[float, float]:
    t, cpu = time.perf_counter(), cpu_seconds()
    m = prepare(docs, out, tok, shard_tokens=shard_tokens, progress=False, workers=processes)
    rate = (m.total_tokens - m.stats["documents"]) / (time.perf_counter() - t)  # tokens without the EOS
    return rate, cpu_seconds() - cpu


# --- 2. loader

def make_stream(root: str, args, world: int = 2):
    from data.stream import BatchGeometry, TokenStream

    geometry = BatchGeometry(seq_len=args.seq_len, global_batch=args.global_batch, rank=0, world=world)
    return TokenStream(ShardSet(root), geometry, seed=0)


def loader_rate(root: str, args, workers: int) -> tuple[float, float]:
    """(seconds to the first batch incl. worker start, tokens/s of rank 0 of 2 over the next `args.batches`)."""
    from data.loader import BatchLoader

    stream = make_stream(root, args)
    with BatchLoader(stream, num_workers=workers) as loader:
        t = time.perf_counter()
        next(loader)
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.batches):
            next(loader)
        dt = time.perf_counter() - t
    return first, args.batches * stream.geometry.local_batch * args.seq_len / dt


# --- 3. resume

def time_to_first_batch(root: str, args, samples: int) -> tuple[float, int]:
    """(seconds from nothing to the first batch after resuming at `samples`, shards that batch opened)."""
    t = time.perf_counter()
    stream = make_stream(root, args)
    stream.load_state_dict({**stream.state_dict(), "samples_consumed": samples})
    stream.next_batch()
    dt = time.perf_counter() - t
    return dt, len(stream.shards._cache)


# --- 4. the trainer's data wait on the demo config

def demo_data_wait(steps: int) -> tuple[float, float]:
    """(median data wait, median step time) in seconds over the logged windows after the first."""
    import json

    from trainer import config as config_
    from trainer.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_.load(Path(__file__).resolve().parents[1] / "configs" / "default.yaml",
                           [f"run.dir={tmp}", f"train.steps={steps}", "train.log_every=5", "train.eval_every=0",
                            "checkpoint.every=0", "checkpoint.resume=never", "log.progress=false"])
        train(cfg)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()][1:-1]
    return (statistics.median(r["data_wait_s"] for r in records), statistics.median(r["step_time_s"] for r in records))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megabytes", type=float, default=12.0, help="text to prepare (the stdlib has about 12)")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=300, help="timed batches per loader measurement")
    ap.add_argument("--shard-tokens", type=int, default=1 << 18)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts for prepare")
    ap.add_argument("--resume-tries", type=int, default=5)
    ap.add_argument("--demo-steps", type=int, default=20, help="steps of the demo config to time (0 = skip)")
    return ap.parse_args()


def prepare_section(tok, docs: list[str], args: argparse.Namespace, tmp: str) -> None:
    print("\n== data.prepare vs raw encode_batch (same text, same process count, 1 thread per process)")
    rates = {}
    for p in args.processes:
        base, base_cpu = baseline_rate(tok, docs, p)
        prep, prep_cpu = prepare_rate(tok, docs, p, f"{tmp}/prep{p}", args.shard_tokens)
        rates[p] = prep
        print(f"  {p} process(es): prepare {prep:>9,.0f} tok/s   encode_batch {base:>9,.0f} tok/s   "
              f"ratio {prep / base:.2f}   prepare speed-up vs 1 process {prep / rates[args.processes[0]]:.2f}x"
              f"   (CPU s: prepare {prep_cpu:.1f}, encode_batch {base_cpu:.1f}; "
              f"load {os.getloadavg()[0]:.1f})", flush=True)


def loader_section(local: str, remote: str, args: argparse.Namespace) -> None:
    n_shards = len(ShardSet(local).manifest.shards)
    print(f"\n== loader tokens/s per rank ({n_shards} shards of ~{args.shard_tokens:,} tokens, cold cache)")
    for workers in (0, 2):
        (lf, lr), (sf, sr) = loader_rate(local, args, workers), loader_rate(remote, args, workers)
        print(f"  num_workers={workers}: local {lr:>12,.0f} tok/s   s3 {sr:>12,.0f} tok/s   "
              f"ratio s3/local {sr / lr:.2f}   (first batch: local {lf * 1e3:.0f} ms, s3 {sf * 1e3:.0f} ms)",
              flush=True)


def resume_section(local: str, remote: str, args: argparse.Namespace) -> None:
    n_train = make_stream(local, args).n_train
    early = args.global_batch * 10
    late = (n_train * 3 + n_train * 9 // 10) // args.global_batch * args.global_batch  # epoch 3, 90%
    print(f"\n== time to first batch after resume (fresh ShardSet: manifest, order window, shard fetch + "
          f"checksum; median of {args.resume_tries}, early/late alternating)")
    for name, root in (("local", local), ("s3", remote)):
        times: dict[int, list[float]] = {early: [], late: []}
        opened: dict[int, int] = {}
        for _ in range(args.resume_tries):
            for at in (early, late):
                dt, opened[at] = time_to_first_batch(root, args, at)
                times[at].append(dt)
        e, lt = statistics.median(times[early]), statistics.median(times[late])
        print(f"  {name:5s}: early (sample {early:,}) {e * 1e3:7.1f} ms   late (sample {late:,}) "
              f"{lt * 1e3:7.1f} ms   ratio late/early {lt / e:.2f}   "
              f"(shards opened: {opened[early]} / {opened[late]})", flush=True)


def main() -> int:
    args = parse_args()
    files = source_files(int(args.megabytes * 1e6))
    docs = [read_source(p) for p in files]
    print(f"corpus: {len(docs)} stdlib files, {sum(map(len, docs)) / 1e6:.1f} MB; {os.cpu_count()} CPU(s) "
          f"(load average {os.getloadavg()[0]:.1f} at start); seq_len {args.seq_len}, global batch "
          f"{args.global_batch}, rank 0 of 2", flush=True)
    tok = tokenizers_.train(docs[: max(1, len(docs) // 3)], args.vocab_size)
    server = start_s3()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prepare_section(tok, docs, args, tmp)
            local = f"{tmp}/prep{args.processes[0]}"
            remote = upload(Path(local), "s3://bench-data/ds")
            loader_section(local, remote, args)
            resume_section(local, remote, args)
    finally:
        server.stop()
    if args.demo_steps:
        print(f"\n== trainer data wait on configs/default.yaml ({args.demo_steps} steps, num_workers=0)")
        wait, step = demo_data_wait(args.demo_steps)
        print(f"  data wait {wait * 1e3:.2f} ms per step of {step * 1e3:.0f} ms = {100 * wait / step:.3f}% (goal < 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
