"""Input files -> documents: which files an input names, the documents each holds, and its lineage.

One document is
  .txt[.gz]     a whole file
  .jsonl[.gz]   one line, its field `text_field` (default `text`)
  .parquet      one row, its string column `text_field`, read a batch of rows at a time (memory stays
                bounded by about a row group's text)
  .arrow        one row of an Arrow IPC stream, as in a Hugging Face `datasets` directory written by
                `save_to_disk` (dataset_info.json, state.json, data-NNNNN-of-NNNNN.arrow): a directory is
                read as its Arrow files in the order state.json lists them. Only pyarrow is needed, not
                the `datasets` package.
Each on local disk or any fsspec URL (`s3://`, `memory://`). Parquet and Arrow need pyarrow
(`pip install 'rekindle[formats]'`). A null text value is skipped and counted (`BadInput.nulls`); bad
input (a missing, empty or corrupt file, invalid UTF-8, a malformed line, no such text field) goes to a
BadInput, which raises InputError naming the file (and line) or, skipping, records it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec

from common.storage import filesystem

MAX_SKIPPED_LISTED = 100  # the manifest lists this many skipped items; `skipped_bad` counts them all
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".parquet")  # what a directory is searched for
ARROW_SUFFIXES = (".parquet", ".arrow")  # read with pyarrow
DATASET_STATE, DATASET_INFO = "state.json", "dataset_info.json"  # a `datasets` save_to_disk directory
BATCH_ROWS = 1024
PYARROW_MISSING = "reading Parquet or Arrow input needs pyarrow: pip install 'rekindle[formats]'"


class InputError(ValueError):
    """Unreadable or malformed input, naming the file (and line)."""


@dataclass
class BadInput:
    """Collects bad input: raises InputError at the first one, or (skip=True) records it and goes on.
    Also counts null text values, which are skipped either way (a null is no document, not bad input)."""

    skip: bool = False
    count: int = 0
    items: list[dict[str, str]] = field(default_factory=list)
    nulls: int = 0

    def report(self, where: str, reason: str) -> None:
        if not self.skip:
            raise InputError(f"{where}: {reason}")
        self.count += 1
        if len(self.items) < MAX_SKIPPED_LISTED:
            self.items.append({"where": where, "reason": reason})


def require_pyarrow() -> Any:
    """The pyarrow module; InputError saying how to install it if it is missing."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401 - loads the submodule onto `pyarrow`
    except ImportError:
        raise InputError(PYARROW_MISSING) from None
    return pyarrow


def needs_pyarrow(urls: Iterable[str]) -> bool:
    return any(u.endswith(ARROW_SUFFIXES) for u in urls)


# --- which files -----------------------------------------------------------------------------------


def dataset_files(fs: fsspec.AbstractFileSystem, directory: str, bad: BadInput) -> list[str]:
    """The Arrow files of a `datasets` save_to_disk directory, in the order its state.json lists them."""
    where = f"{directory}/{DATASET_STATE}"
    try:
        state = json.loads(fs.cat_file(where))
        return [f"{directory}/{f['filename']}" for f in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        bad.report(where, f"not a valid `datasets` state.json ({type(e).__name__}: {e})")
        return []


def files_under(fs: fsspec.AbstractFileSystem, directory: str, bad: BadInput) -> list[tuple[tuple[str, int], str]]:
    """The input files in `directory` and below, each with its sort key: text, JSON lines and Parquet files
    by path, and the Arrow files of each `datasets` directory at its path, in its state.json's order."""
    found = fs.find(directory)
    names = set(found)
    keyed = [((f, 0), f) for f in found if f.endswith(SUFFIXES)]
    for f in found:
        dataset = f.rsplit("/", 1)[0]
        if f.endswith("/" + DATASET_STATE) and f"{dataset}/{DATASET_INFO}" in names:
            keyed += [((dataset + "/", i), a) for i, a in enumerate(dataset_files(fs, dataset, bad))]
    return keyed


def expand_inputs(patterns: list[str], bad: BadInput | None = None) -> list[str]:
    """Resolve globs and directories into a sorted list of input URLs; missing inputs are an error
    (or, with a skipping `bad`, skipped and counted; no input at all is always an error)."""
    bad = bad or BadInput()
    urls: list[str] = []
    for pattern in patterns:
        fs, path = filesystem(pattern)
        protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
        matches = fs.glob(path) if any(c in path for c in "*?[") else ([path] if fs.exists(path) else [])
        keyed: list[tuple[tuple[str, int], str]] = []
        for m in matches:
            keyed += files_under(fs, m, bad) if fs.isdir(m) else [((m, 0), m)]
        if not keyed:
            bad.report(repr(pattern), "input matches no file")
        urls += [protocol + f if protocol and not f.startswith(protocol) else f for _, f in sorted(keyed)]
    if not urls:
        raise InputError(f"input {' '.join(patterns)!r} matches no file")
    return urls


def file_lineage(url: str) -> dict[str, Any]:
    """{url, bytes, sha256} of one input file, streamed (never held in memory whole)."""
    h, size = hashlib.sha256(), 0
    with fsspec.open(url, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"url": url, "bytes": size, "sha256": h.hexdigest()}


# --- the documents of one file ---------------------------------------------------------------------


def read_documents(url: str, bad: BadInput | None = None, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of one input file; bad files/lines go to `bad` (default: raise InputError)."""
    bad = bad or BadInput()
    if url.endswith(ARROW_SUFFIXES):
        yield from read_columnar(url, bad, text_field)
        return
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
    if url.removesuffix(".gz").endswith(".jsonl"):
        yield from read_jsonl(url, data, bad, text_field)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data[: e.start].count(b"\n") + 1
        return bad.report(f"{url}:{lineno}", f"invalid UTF-8 ({e.reason} at byte {e.start})")
    yield text


def read_jsonl(url: str, data: bytes, bad: BadInput, text_field: str) -> Iterator[str]:
    """The documents of JSON lines `data` (from `url`): field `text_field` of each line."""
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{url}:{lineno}"
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.report(where, f"invalid UTF-8 ({e.reason} at byte {e.start} of the line)")
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            bad.report(where, f"malformed JSON line ({e})")
            continue
        if not isinstance(record, dict) or text_field not in record:
            fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            bad.report(where, f"no field {text_field!r} (fields: {fields}); choose one with --text-field")
        elif record[text_field] is None:
            bad.nulls += 1
        elif not isinstance(record[text_field], str):
            bad.report(where, f"field {text_field!r} is not a string")
        else:
            yield record[text_field]


def read_columnar(url: str, bad: BadInput, text_field: str) -> Iterator[str]:
    """The documents of a Parquet file or an Arrow IPC stream: column `text_field`, a batch at a time."""
    pa = require_pyarrow()
    parquet = url.endswith(".parquet")
    try:
        with fsspec.open(url, "rb") as f:
            if parquet:
                reader = pa.parquet.ParquetFile(f)
                schema = reader.schema_arrow
                batches = lambda: reader.iter_batches(batch_size=BATCH_ROWS, columns=[text_field])
            else:
                reader = pa.ipc.open_stream(f)
                schema, batches = reader.schema, lambda: reader
            if text_column(url, schema, text_field, bad):
                for batch in batches():
                    yield from texts(batch.column(text_field).to_pylist(), bad)
    except FileNotFoundError:
        bad.report(url, "file not found")
    except pa.ArrowException as e:  # ArrowInvalid, ArrowIOError...: another format, truncated, corrupt
        bad.report(url, f"not a valid {'Parquet file' if parquet else 'Arrow IPC stream'} ({e})")


def text_column(url: str, schema: Any, text_field: str, bad: BadInput) -> bool:
    """Whether `schema` has a string column `text_field`; if not, it is reported as bad input."""
    pa = require_pyarrow()
    columns = f"columns: {', '.join(schema.names) or 'none'}"
    if text_field not in schema.names:
        bad.report(url, f"no column {text_field!r} ({columns}); choose one with --text-field")
        return False
    kind = schema.field(text_field).type
    if not is_string(pa, kind.value_type if pa.types.is_dictionary(kind) else kind):
        bad.report(url, f"column {text_field!r} is {kind}, not a string column ({columns}); choose one with "
                        "--text-field")
        return False
    return True


def is_string(pa: Any, kind: Any) -> bool:
    string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or string_view(kind)


def texts(values: list[str | None], bad: BadInput) -> Iterator[str]:
    """The non-null values; the nulls are counted."""
    for value in values:
        if value is None:
            bad.nulls += 1
        else:
            yield value
