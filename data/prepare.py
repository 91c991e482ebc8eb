"""Raw text -> token shards + manifest.json + tokenizer.json.

    python -m data.prepare --input PATH_OR_URL [...] --output DIR_OR_URL [--tokenizer FILE | --vocab-size N]
                           [--workers P] [--skip-bad] [--shard-tokens N]

Inputs are `.txt` files (one document per file) or `.jsonl` files (one document per line, field
`text`), optionally `.gz`-compressed, on local disk or any fsspec URL (`s3://`, `memory://`), with globs.
Exact duplicate documents are dropped. Tokenization runs in P processes; the output is byte-identical
for any P. The manifest records the lineage (every input with its size and sha256, the tokenizer, the
shard size); re-running with an unchanged lineage over a finished output does nothing.
Bad input (missing or empty file, invalid UTF-8, malformed JSON line) is an error naming the file and
line, or with --skip-bad is skipped and counted in the manifest (`skipped_bad`, `skipped`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from tqdm import tqdm

from data import tokenizer as tokenizers_
from data.shards import FORMAT_VERSION, MANIFEST, Manifest, ShardError, ShardSet, ShardWriter
from trainer.protocol import EXIT_USAGE
from trainer.storage import filesystem, store_unreachable

MAX_SKIPPED_LISTED = 100  # the manifest lists this many skipped items; `skipped_bad` counts them all


class InputError(ValueError):
    """Unreadable or malformed input, naming the file (and line)."""


@dataclass
class BadInput:
    """Collects bad input: raises InputError at the first one, or (skip=True) records it and goes on."""

    skip: bool = False
    count: int = 0
    items: list[dict[str, str]] = field(default_factory=list)

    def report(self, where: str, reason: str) -> None:
        if not self.skip:
            raise InputError(f"{where}: {reason}")
        self.count += 1
        if len(self.items) < MAX_SKIPPED_LISTED:
            self.items.append({"where": where, "reason": reason})


def expand_inputs(patterns: list[str], bad: BadInput | None = None) -> list[str]:
    """Resolve globs and directories into a sorted list of input URLs; missing inputs are an error
    (or, with a skipping `bad`, skipped and counted; no input at all is always an error)."""
    bad = bad or BadInput()
    urls: list[str] = []
    for pattern in patterns:
        fs, path = filesystem(pattern)
        protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
        matches = fs.glob(path) if any(c in path for c in "*?[") else ([path] if fs.exists(path) else [])
        files: list[str] = []
        for m in matches:
            if fs.isdir(m):
                files += [f for f in fs.find(m) if f.endswith((".txt", ".jsonl", ".txt.gz", ".jsonl.gz"))]
            else:
                files.append(m)
        if not files:
            bad.report(repr(pattern), "input matches no file")
        urls += [protocol + f if protocol and not f.startswith(protocol) else f for f in sorted(files)]
    if not urls:
        raise InputError(f"input {' '.join(patterns)!r} matches no file")
    return urls


def read_documents(url: str, bad: BadInput | None = None) -> Iterator[str]:
    """Yield the documents of one input file; bad files/lines go to `bad` (default: raise InputError)."""
    bad = bad or BadInput()
    try:
        with fsspec.open(url, "rb") as raw:
            data = raw.read()
    except FileNotFoundError:
        return bad.report(url, "file not found")
    if url.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            return bad.report(url, f"not a valid gzip file ({e})")
    if not data.strip():
        return bad.report(url, "empty file")
    name = url[:-3] if url.endswith(".gz") else url
    if name.endswith(".jsonl"):
        for lineno, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.report(f"{url}:{lineno}", f"invalid UTF-8 ({e.reason} at byte {e.start} of the line)")
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as e:
                bad.report(f"{url}:{lineno}", f"malformed JSON line or no 'text' field ({e})")
                continue
            if not isinstance(text, str):
                bad.report(f"{url}:{lineno}", "field 'text' is not a string")
                continue
            yield text
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = data[: e.start].count(b"\n") + 1
            return bad.report(f"{url}:{lineno}", f"invalid UTF-8 ({e.reason} at byte {e.start})")
        yield text


def file_lineage(url: str) -> dict[str, Any]:
    """{url, bytes, sha256} of one input file, streamed (never held in memory whole)."""
    h, size = hashlib.sha256(), 0
    with fsspec.open(url, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"url": url, "bytes": size, "sha256": h.hexdigest()}


# --- parallel tokenization: P single-threaded tokenizers (P processes, or this one when P = 1); chunks
# of about CHUNK_CHARS characters (not a number of documents, which may be few and very unequal) keep
# the processes evenly loaded; a chunk comes back as two numpy arrays, which pickle as one memory copy.

CHUNK_CHARS = 1 << 18


class ChunkEncoder:
    """Encodes a list of documents in this thread only: (tokens with EOS after each document, lengths)."""

    def __init__(self, tokenizer_json: str, dtype: str) -> None:
        self.tok = tokenizers_.from_bytes(tokenizer_json.encode())
        # A document that contains the EOS text itself (code and web text can) is encoded as plain text:
        # the only EOS tokens in the stream are the document boundaries this encoder inserts.
        self.tok.encode_special_tokens = True
        self.eos, self.dtype = tokenizers_.eos_id(self.tok), np.dtype(dtype)

    def __call__(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # encode() of one text never uses the Rust thread pool (encode_batch would, unless told not to)
        ids = [self.tok.encode(doc, add_special_tokens=False).ids for doc in docs]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()))
        return np.insert(flat, np.cumsum(lengths), self.eos), lengths + 1


_worker_encoder: ChunkEncoder | None = None


def _init_worker(tokenizer_json: str, dtype: str) -> None:
    global _worker_encoder  # per-process worker state, set once by the pool initializer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, whatever the tokenizer is asked
    _worker_encoder = ChunkEncoder(tokenizer_json, dtype)


def _encode_chunk(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encoder(docs)


def chunks(docs: Iterable[str], chars: int = CHUNK_CHARS) -> Iterator[list[str]]:
    """Group documents into lists of at least `chars` characters (the last may be smaller)."""
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_parallel(tok, docs: Iterable[str], workers: int, dtype: str,
                    chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode documents with `workers` single-threaded tokenizers, yielding (tokens, lengths) per chunk in
    input order; tokens hold each document followed by EOS. Read-ahead is bounded (4 chunks per worker)."""
    todo = chunks(docs, chunk_chars)
    head = list(itertools.islice(todo, 2))
    todo = itertools.chain(head, todo)
    if workers <= 1 or len(head) < 2:  # one chunk: starting processes would cost more than it saves
        yield from map(ChunkEncoder(tok.to_str(), dtype), todo)
        return
    # spawn, not fork: the caller may hold threads (s3fs, tqdm, the tokenizer's own pool)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _init_worker, (tok.to_str(), dtype)) as pool:
        pending: deque = deque()
        for chunk in todo:
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get(timeout=600)
        while pending:
            yield pending.popleft().get(timeout=600)


def prepare(
    docs: Iterable[str],
    output: str,
    tok,
    shard_tokens: int = 1 << 24,
    progress: bool = True,
    total_docs: int | None = None,
    workers: int = 1,
    stats: dict[str, Any] | None = None,
    bad: BadInput | None = None,
    chunk_chars: int = CHUNK_CHARS,
) -> Manifest:
    """Tokenize `docs` with `tok` and write shards + manifest to `output`; `workers` single-threaded
    tokenizer processes (1 = this process only). The output is byte-identical for any `workers`.

    `stats` (e.g. lineage) is merged into the manifest's stats; so is what `bad` skipped while `docs` was read."""
    writer = ShardWriter(output, tok.get_vocab_size(), tokenizers_.eos_id(tok), shard_tokens)
    seen: set[bytes] = set()
    duplicates = 0

    def unique(stream: Iterable[str]) -> Iterator[str]:
        nonlocal duplicates
        for doc in stream:
            key = hashlib.blake2b(doc.encode(), digest_size=16).digest()
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            yield doc

    bar = tqdm(total=total_docs, unit="doc", desc="tokenize", disable=not progress, file=sys.stderr)
    for tokens, lengths in encode_parallel(tok, unique(docs), workers, writer.dtype.name, chunk_chars):
        writer.add_encoded(tokens, lengths)
        bar.update(len(lengths))
    bar.close()
    if not seen:
        raise InputError(f"the input is empty: no documents to write to {output}")
    skipped = {"skipped_bad": bad.count, "skipped": bad.items} if bad is not None else {}
    return writer.finish(tok.to_str().encode(),
                         {"documents": len(seen), "duplicates_dropped": duplicates, **skipped, **(stats or {})})


def existing_lineage(output: str) -> dict[str, Any] | None:
    """The lineage recorded in a finished output's manifest, or None (no or unreadable manifest)."""
    fs, path = filesystem(output)
    if not fs.exists(f"{path.rstrip('/')}/{MANIFEST}"):
        return None
    try:
        return ShardSet(output).manifest.stats.get("lineage")
    except ShardError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="files, dirs or globs; local or URL")
    ap.add_argument("--output", required=True, help="output dir or URL")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokenizer", help="an existing tokenizer.json")
    group.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size on the input")
    ap.add_argument("--shard-tokens", type=int, default=1 << 24)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="tokenizer processes, one thread each (default: the CPUs available; the output is the "
                         "same for any)")
    ap.add_argument("--skip-bad", action="store_true", help="skip and count bad files/lines instead of failing")
    ap.add_argument("--force", action="store_true", help="rebuild even if the output's lineage matches")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers must be at least 1; got {args.workers}")
    try:
        bad = BadInput(skip=args.skip_bad)
        urls = expand_inputs(args.input, bad)
        inputs = []
        for u in urls:
            try:
                inputs.append(file_lineage(u))
            except FileNotFoundError:
                bad.report(u, "file not found")
        urls = [i["url"] for i in inputs]
        if args.tokenizer:
            with open(args.tokenizer, "rb") as f:
                tokenizer = {"file_sha256": hashlib.sha256(f.read()).hexdigest()}
        else:
            tokenizer = {"train_vocab_size": args.vocab_size}
        lineage = {"format": FORMAT_VERSION, "inputs": inputs, "tokenizer": tokenizer,
                   "shard_tokens": args.shard_tokens, "skip_bad": args.skip_bad}
        if not args.force and existing_lineage(args.output) == lineage:
            print(f"{args.output} is up to date (same inputs, tokenizer and settings): nothing to do")
            return 0
        docs = lambda b: (d for u in urls for d in read_documents(u, b))  # noqa: E731
        if args.tokenizer:
            tok = tokenizers_.load(args.tokenizer)
        else:
            tok = tokenizers_.train(docs(BadInput(skip=args.skip_bad)), args.vocab_size)
        manifest = prepare(docs(bad), args.output, tok, args.shard_tokens, progress=not args.no_progress,
                           workers=args.workers, stats={"lineage": lineage}, bad=bad)
    except (InputError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if not store_unreachable(e):
            raise
        print(f"error: object storage unusable: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE
    skipped = f", skipped {bad.count} bad file(s)/line(s)" if bad.count else ""
    print(
        f"wrote {len(manifest.shards)} shard(s), {manifest.total_tokens:,} tokens, "
        f"{manifest.stats['documents']:,} documents ({manifest.stats['duplicates_dropped']:,} duplicates dropped"
        f"{skipped}) to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
