"""Raw text -> token shards + manifest.json + tokenizer.json.

    python -m data.prepare --input PATH_OR_URL [...] --output DIR_OR_URL [--tokenizer FILE | --vocab-size N]
                           [--eos-token TOKEN] [--text-field NAME] [--workers P] [--skip-bad] [--shard-tokens N]

Inputs (data.readers) are `.txt` files (one document per file), `.jsonl` files (one document per line,
field `text` or --text-field), both optionally `.gz`-compressed, Parquet files (one document per row,
column `text` or --text-field) and Hugging Face `datasets` directories written by `save_to_disk` (their
Arrow files, in state.json's order), on local disk or any fsspec URL (`s3://`, `memory://`), with globs;
Parquet and Arrow need pyarrow (`pip install 'rekindle[formats]'`). A null text is skipped and counted.
The tokenizer is trained on the input (--vocab-size) or an existing Hugging Face tokenizer.json; its
--eos-token (default `<|endoftext|>`) ends every document, and the manifest records it and its id.
Exact duplicate documents are dropped. Tokenization runs in P processes; the output is byte-identical
for any P. The manifest records the lineage (every input with its size and sha256, the tokenizer, the
shard size); re-running with an unchanged lineage over a finished output does nothing.
Bad input (missing, empty or corrupt file, invalid UTF-8, malformed JSON line, no such text field) is an
error naming the file and line, or with --skip-bad is skipped and counted in the manifest (`skipped_bad`,
`skipped`); null texts are counted there too (`skipped_null`).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from common.exits import EXIT_USAGE
from common.storage import filesystem, storage_error
from data import tokenizer as tokenizers_
from data.readers import (  # BadInput, InputError, expand_inputs, read_documents: also this module's API
    BadInput,
    InputError,
    expand_inputs,
    file_lineage,
    needs_pyarrow,
    read_documents,
    require_pyarrow,
)
from data.shards import FORMAT_VERSION, MANIFEST, Manifest, ShardError, ShardSet, ShardWriter

# --- parallel tokenization: P single-threaded tokenizers (P processes, or this one when P = 1); chunks
# of about CHUNK_CHARS characters (not a number of documents, which may be few and very unequal) keep
# the processes evenly loaded; a chunk comes back as two numpy arrays, which pickle as one memory copy.

CHUNK_CHARS = 1 << 18


class ChunkEncoder:
    """Encodes a list of documents in this thread only: (tokens with EOS after each document, lengths)."""

    def __init__(self, tokenizer_json: str, dtype: str, eos_id: int) -> None:
        self.tok = tokenizers_.from_bytes(tokenizer_json.encode())
        # A document that contains the EOS text itself (code and web text can) is encoded as plain text:
        # the only EOS tokens in the stream are the document boundaries this encoder inserts.
        self.tok.encode_special_tokens = True
        self.eos, self.dtype = eos_id, np.dtype(dtype)

    def __call__(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # encode() of one text never uses the Rust thread pool (encode_batch would, unless told not to)
        ids = [self.tok.encode(doc, add_special_tokens=False).ids for doc in docs]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()))
        return np.insert(flat, np.cumsum(lengths), self.eos), lengths + 1


_worker_encoder: ChunkEncoder | None = None


def _init_worker(tokenizer_json: str, dtype: str, eos_id: int) -> None:
    global _worker_encoder  # per-process worker state, set once by the pool initializer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, whatever the tokenizer is asked
    _worker_encoder = ChunkEncoder(tokenizer_json, dtype, eos_id)


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


def encode_parallel(tok, docs: Iterable[str], workers: int, dtype: str, eos_id: int,
                    chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode documents with `workers` single-threaded tokenizers, yielding (tokens, lengths) per chunk in
    input order; tokens hold each document followed by `eos_id`. Read-ahead is bounded (4 chunks per worker)."""
    todo = chunks(docs, chunk_chars)
    head = list(itertools.islice(todo, 2))
    todo = itertools.chain(head, todo)
    if workers <= 1 or len(head) < 2:  # one chunk: starting processes would cost more than it saves
        yield from map(ChunkEncoder(tok.to_str(), dtype, eos_id), todo)
        return
    # spawn, not fork: the caller may hold threads (s3fs, tqdm, the tokenizer's own pool)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _init_worker, (tok.to_str(), dtype, eos_id)) as pool:
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
    eos_token: str = tokenizers_.EOS,
) -> Manifest:
    """Tokenize `docs` with `tok` and write shards + manifest to `output`; `workers` single-threaded
    tokenizer processes (1 = this process only). The output is byte-identical for any `workers`.
    `eos_token` (a token of `tok`) follows every document; the manifest records it and its id.

    `stats` (e.g. lineage) is merged into the manifest's stats; so is what `bad` skipped while `docs` was read."""
    eos = tokenizers_.eos_id(tok, eos_token)
    writer = ShardWriter(output, tok.get_vocab_size(), eos, shard_tokens, eos_token)
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
    for tokens, lengths in encode_parallel(tok, unique(docs), workers, writer.dtype.name, eos, chunk_chars):
        writer.add_encoded(tokens, lengths)
        bar.update(len(lengths))
    bar.close()
    if not seen:
        raise InputError(f"the input is empty: no documents to write to {output}")
    skipped = {"skipped_bad": bad.count, "skipped": bad.items, "skipped_null": bad.nulls} if bad is not None else {}
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True,
                    help="files (.txt, .jsonl, .gz of those, .parquet, .arrow), directories (searched for those and "
                         "for `datasets` save_to_disk directories) or globs; local or URL")
    ap.add_argument("--output", required=True, help="output dir or URL")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokenizer", help="an existing tokenizer.json (any Hugging Face tokenizer)")
    group.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size on the input")
    ap.add_argument("--eos-token", default=tokenizers_.EOS,
                    help="the token that ends every document, in the tokenizer's vocabulary (default: %(default)s)")
    ap.add_argument("--text-field", default="text",
                    help="the field (.jsonl) or string column (.parquet, .arrow) holding the text (default: text)")
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
    return args


def load_tokenizer(path: str, eos_token: str) -> tuple[Tokenizer, str]:
    """The tokenizer.json at `path` and its sha256; InputError if it is not one or lacks `eos_token`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InputError(f"--tokenizer {path}: no such file") from None
    try:
        tok = tokenizers_.from_bytes(data)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a malformed file
        raise InputError(f"--tokenizer {path}: not a tokenizer.json ({e})") from None
    specials = tokenizers_.special_tokens(tok)
    if tok.token_to_id(eos_token) is None:
        raise InputError(f"--eos-token {eos_token!r} is not in the vocabulary of {path} "
                         f"({tok.get_vocab_size():,} tokens; special tokens: {', '.join(specials) or 'none'})")
    if eos_token not in specials:
        print(f"warning: --eos-token {eos_token!r} is not a special token of {path}: a document whose text "
              "contains it may encode to the same id, a false document boundary", file=sys.stderr)
    return tok, hashlib.sha256(data).hexdigest()


def lineage_of(args: argparse.Namespace, inputs: list[dict[str, Any]], tokenizer_sha256: str | None) -> dict:
    """What the output is made from. Options at their defaults are left out, so that an output prepared
    before the option existed stays up to date."""
    tokenizer: dict[str, Any] = ({"file_sha256": tokenizer_sha256} if tokenizer_sha256 else
                                 {"train_vocab_size": args.vocab_size})
    if args.eos_token != tokenizers_.EOS:
        tokenizer["eos_token"] = args.eos_token
    lineage = {"format": FORMAT_VERSION, "inputs": inputs, "tokenizer": tokenizer,
               "shard_tokens": args.shard_tokens, "skip_bad": args.skip_bad}
    return lineage | ({"text_field": args.text_field} if args.text_field != "text" else {})


def run(args: argparse.Namespace, bad: BadInput) -> Manifest | None:
    """Prepare the output `args` describe; None if it is already up to date."""
    urls = expand_inputs(args.input, bad)
    if needs_pyarrow(urls):
        require_pyarrow()
    tok, tok_sha256 = load_tokenizer(args.tokenizer, args.eos_token) if args.tokenizer else (None, None)
    inputs = []
    for u in urls:
        try:
            inputs.append(file_lineage(u))
        except FileNotFoundError:
            bad.report(u, "file not found")
    urls = [i["url"] for i in inputs]
    lineage = lineage_of(args, inputs, tok_sha256)
    if not args.force and existing_lineage(args.output) == lineage:
        return None
    docs = lambda b: (d for u in urls for d in read_documents(u, b, args.text_field))  # noqa: E731
    if tok is None:
        tok = tokenizers_.train(docs(BadInput(skip=args.skip_bad)), args.vocab_size, args.eos_token)
    return prepare(docs(bad), args.output, tok, args.shard_tokens, progress=not args.no_progress,
                   workers=args.workers, stats={"lineage": lineage}, bad=bad, eos_token=args.eos_token)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bad = BadInput(skip=args.skip_bad)
    try:
        manifest = run(args, bad)
    except (InputError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if not storage_error(e):
            raise
        print(f"error: object storage unusable: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if manifest is None:
        print(f"{args.output} is up to date (same inputs, tokenizer and settings): nothing to do")
        return 0
    skipped = f", skipped {bad.count} bad file(s)/line(s)" if bad.count else ""
    skipped += f", skipped {bad.nulls:,} null text(s)" if bad.nulls else ""
    print(
        f"wrote {len(manifest.shards)} shard(s), {manifest.total_tokens:,} tokens, "
        f"{manifest.stats['documents']:,} documents ({manifest.stats['duplicates_dropped']:,} duplicates dropped"
        f"{skipped}) to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
