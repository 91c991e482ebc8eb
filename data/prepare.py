"""Raw text -> token shards + manifest.json + tokenizer.json.

    python -m data.prepare --input PATH_OR_URL [...] --output DIR_OR_URL [--tokenizer FILE | --vocab-size N]

Inputs are `.txt` files (one document per file) or `.jsonl` files (one document per line, field
`text`), optionally `.gz`-compressed, on local disk or any fsspec URL (`s3://`, `memory://`), with globs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable, Iterator

import fsspec
from tqdm import tqdm

from data import tokenizer as tokenizers_
from data.shards import Manifest, ShardWriter


class InputError(ValueError):
    """Unreadable or malformed input, naming the file (and line)."""


def expand_inputs(patterns: list[str]) -> list[str]:
    """Resolve globs and directories into a sorted list of input URLs; missing inputs are an error."""
    urls: list[str] = []
    for pattern in patterns:
        fs, path = fsspec.core.url_to_fs(pattern)
        protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
        matches = fs.glob(path) if any(c in path for c in "*?[") else ([path] if fs.exists(path) else [])
        files: list[str] = []
        for m in matches:
            if fs.isdir(m):
                files += [f for f in fs.find(m) if f.endswith((".txt", ".jsonl", ".txt.gz", ".jsonl.gz"))]
            else:
                files.append(m)
        if not files:
            raise InputError(f"input {pattern!r} matches no file")
        urls += [protocol + f if protocol and not f.startswith(protocol) else f for f in sorted(files)]
    return urls


def read_documents(url: str) -> Iterator[str]:
    """Yield the documents of one input file."""
    try:
        with fsspec.open(url, "rb") as raw:
            data = raw.read()
    except FileNotFoundError as e:
        raise InputError(f"{url}: file not found") from e
    if url.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except OSError as e:
            raise InputError(f"{url}: not a valid gzip file ({e})") from e
    name = url[:-3] if url.endswith(".gz") else url
    if name.endswith(".jsonl"):
        for lineno, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{url}:{lineno}: malformed JSON line or no 'text' field ({e})") from e
            if not isinstance(text, str):
                raise InputError(f"{url}:{lineno}: field 'text' is not a string")
            yield text
    else:
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = data[: e.start].count(b"\n") + 1
            raise InputError(f"{url}:{lineno}: invalid UTF-8 ({e.reason} at byte {e.start})") from e


def prepare(
    docs: Iterable[str],
    output: str,
    tok,
    shard_tokens: int = 1 << 24,
    progress: bool = True,
    total_docs: int | None = None,
) -> Manifest:
    """Tokenize `docs` with `tok` and write shards + manifest to `output`."""
    writer = ShardWriter(output, tok.get_vocab_size(), tokenizers_.eos_id(tok), shard_tokens)
    seen: set[bytes] = set()
    duplicates = 0

    def unique(stream: Iterable[str]) -> Iterator[str]:
        nonlocal duplicates
        import hashlib

        for doc in stream:
            key = hashlib.blake2b(doc.encode(), digest_size=16).digest()
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            yield doc

    bar = tqdm(total=total_docs, unit="doc", desc="tokenize", disable=not progress, file=sys.stderr)
    for batch in tokenizers_.encode_batches(tok, unique(docs)):
        for ids in batch:
            writer.add(ids)
        bar.update(len(batch))
    bar.close()
    return writer.finish(tok.to_str().encode(), {"documents": len(seen), "duplicates_dropped": duplicates})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="files, dirs or globs; local or URL")
    ap.add_argument("--output", required=True, help="output dir or URL")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokenizer", help="an existing tokenizer.json")
    group.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size on the input")
    ap.add_argument("--shard-tokens", type=int, default=1 << 24)
    args = ap.parse_args(argv)
    try:
        urls = expand_inputs(args.input)
        docs = lambda: (d for u in urls for d in read_documents(u))  # noqa: E731
        if args.tokenizer:
            tok = tokenizers_.load(args.tokenizer)
        else:
            tok = tokenizers_.train(docs(), args.vocab_size)
        manifest = prepare(docs(), args.output, tok, args.shard_tokens)
    except (InputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(manifest.shards)} shard(s), {manifest.total_tokens:,} tokens, "
        f"{manifest.stats['documents']:,} documents to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
