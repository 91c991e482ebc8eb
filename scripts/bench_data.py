"""Benchmark of the data pipeline, in one run (not a test):

    /tmp/venvprobe/bin/python scripts/bench_data.py [--megabytes 4] [--vocab-size 2048] [--seq-len 256]

1. loader tokens/s per rank (rank 0 of 2) from local shards and from a loopback S3 server (moto, started
   here on 127.0.0.1 with dummy credentials), with 0 and 2 worker processes; ratio S3 / local.
2. data.prepare tokens/s against a raw `tokenizer.encode_batch` baseline on the same text with the same
   process count (1 process, then 2 processes); ratio prepare / baseline.
3. time to first batch after a resume, at an early and a late offset (cold cache), local and S3.
The text is the built-in corpus's (Python standard library sources); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import tokenizer as tokenizers_  # noqa: E402
from data.corpus import _read, source_files  # noqa: E402
from data.loader import BatchLoader  # noqa: E402
from data.prepare import prepare  # noqa: E402
from data.shards import ShardSet  # noqa: E402
from data.stream import TokenStream  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3() -> object:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    return server


def upload(local: Path, url: str) -> str:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.mkdir(path.split("/")[0])
    for f in sorted(local.iterdir()):
        fs.pipe_file(f"{path}/{f.name}", f.read_bytes())
    return url


def make_stream(root: str, args, world: int = 2) -> TokenStream:
    return TokenStream(ShardSet(root), args.seq_len, args.global_batch, seed=0, rank=0, world=world)


def loader_rate(root: str, args, workers: int) -> tuple[float, float]:
    """(seconds to the first batch incl. worker start, tokens/s of rank 0 of 2 over the next `args.batches`)."""
    stream = make_stream(root, args)
    with BatchLoader(stream, num_workers=workers) as loader:
        t = time.perf_counter()
        next(loader)
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.batches):
            next(loader)
        dt = time.perf_counter() - t
    return first, args.batches * stream.local_batch * args.seq_len / dt


def time_to_first_batch(root: str, args, samples: int) -> float:
    t = time.perf_counter()
    stream = make_stream(root, args)
    stream.load_state_dict({**stream.state_dict(), "samples_consumed": samples})
    stream.next_batch()
    return time.perf_counter() - t


def _count(chunk: list[str]) -> int:
    return sum(len(e.ids) for e in _baseline_tok.encode_batch(chunk, add_special_tokens=False))


_baseline_tok = None


def _init(tokenizer_json: str) -> None:
    global _baseline_tok  # per-process tokenizer of the baseline pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _baseline_tok = tokenizers_.from_bytes(tokenizer_json.encode())


def baseline_rate(tok, docs: list[str], processes: int) -> float:
    """Raw encode_batch: in-process for 1 (the Rust core uses all cores), else a pool of `processes`."""
    chunks = [docs[i : i + 256] for i in range(0, len(docs), 256)]
    t = time.perf_counter()
    if processes == 1:
        n = sum(len(e.ids) for c in chunks for e in tok.encode_batch(c, add_special_tokens=False))
    else:
        with multiprocessing.get_context("spawn").Pool(processes, _init, (tok.to_str(),)) as pool:
            n = sum(pool.map(_count, chunks, chunksize=1))
    return n / (time.perf_counter() - t)


def prepare_rate(tok, docs: list[str], processes: int, out: str) -> float:
    t = time.perf_counter()
    m = prepare(docs, out, tok, shard_tokens=1 << 18, progress=False, workers=processes)
    return (m.total_tokens - m.stats["documents"]) / (time.perf_counter() - t)  # tokens without the EOS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megabytes", type=float, default=4.0)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=300, help="timed batches per loader measurement")
    ap.add_argument("--shard-tokens", type=int, default=1 << 18)
    args = ap.parse_args()

    files = source_files(int(args.megabytes * 1e6))
    docs = [_read(p) for p in files]
    print(f"corpus: {len(docs)} stdlib files, {sum(map(len, docs)) / 1e6:.1f} MB; "
          f"{os.cpu_count()} CPU(s); seq_len {args.seq_len}, global batch {args.global_batch}, rank 0 of 2")
    tok = tokenizers_.train(docs, args.vocab_size)
    server = start_s3()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n== data.prepare vs raw encode_batch (same text, same process count)")
            for p in (1, 2):
                base = baseline_rate(tok, docs, p)
                prep = prepare_rate(tok, docs, p, f"{tmp}/prep{p}")
                print(f"  {p} process(es): prepare {prep:>12,.0f} tok/s   encode_batch {base:>12,.0f} tok/s   "
                      f"ratio {prep / base:.2f}")

            local = f"{tmp}/prep1"
            remote = upload(Path(local), "s3://bench-data/ds")
            n_shards = len(ShardSet(local).manifest.shards)
            print(f"\n== loader tokens/s per rank ({n_shards} shards of ~{args.shard_tokens:,} tokens, cold cache)")
            for workers in (0, 2):
                (lf, lr), (sf, sr) = loader_rate(local, args, workers), loader_rate(remote, args, workers)
                print(f"  num_workers={workers}: local {lr:>12,.0f} tok/s   s3 {sr:>12,.0f} tok/s   "
                      f"ratio s3/local {sr / lr:.2f}   (first batch: local {lf * 1e3:.0f} ms, s3 {sf * 1e3:.0f} ms)")

            n_train = make_stream(local, args).n_train
            early = args.global_batch * 10
            late = (n_train * 3 + n_train * 9 // 10) // args.global_batch * args.global_batch  # epoch 3, 90%
            print("\n== time to first batch after resume (fresh ShardSet: manifest, order, shard fetch+verify)")
            for name, root in (("local", local), ("s3", remote)):
                e, lt = time_to_first_batch(root, args, early), time_to_first_batch(root, args, late)
                print(f"  {name:5s}: early (sample {early:,}) {e * 1e3:7.1f} ms   late (sample {late:,}) "
                      f"{lt * 1e3:7.1f} ms   ratio late/early {lt / e:.2f}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
