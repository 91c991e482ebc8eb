"""data.prepare on what public corpora ship: the same documents as JSON lines, as Parquet (several row
groups, another text column) and as a Hugging Face `datasets` directory (save_to_disk) give byte-identical
shards; a missing or non-string text field is a one-line error naming the file and the columns; an
existing Hugging Face tokenizer with its own EOS token (`--eos-token`) ends every document with that id,
and the manifest, the loader and the stream's document boundaries use it."""

from __future__ import annotations

import hashlib
import json
import sys
import uuid

import fsspec
import numpy as np
import pytest

from data import tokenizer as tokenizers_
from data.prepare import main as prepare_main
from data.shards import Manifest, ShardSet
from tests.helpers import TEXTS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [*TEXTS[:80], None, *TEXTS[:5]]  # a null text (skipped, counted) and 5 duplicates (dropped)


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizers_.save(tokenizers_.train(TEXTS, vocab_size=300), path)
    return path


def prepare(inputs: list, out, tok_file, *extra: str) -> ShardSet:
    args = ["--input", *map(str, inputs), "--output", str(out), "--tokenizer", str(tok_file), "--workers", "1",
            "--no-progress", *extra]
    assert prepare_main(args) == 0
    return ShardSet(str(out))


def write_jsonl(path, docs: list, field: str = "text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path, docs: list, field: str = "text", row_group_size: int = 25):
    table = pa.table({"id": list(range(len(docs))), field: pa.array(docs, pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def save_dataset(path, docs: list, field: str = "text", num_shards: int = 3):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()  # its bars go to stderr, which the tests read
    datasets.Dataset.from_dict({"id": list(range(len(docs))), field: docs}).save_to_disk(str(path),
                                                                                          num_shards=num_shards)
    return path


def reorder_arrow_files(path) -> list[str]:
    """Rename a saved dataset's Arrow files so that their names sort against state.json's order; returns
    them in state.json's order (the order the documents must be read in)."""
    state = json.loads((path / "state.json").read_text())
    new = [f"part-{chr(ord('z') - i)}.arrow" for i in range(len(state["_data_files"]))]
    for entry, name in zip(state["_data_files"], new, strict=True):
        (path / entry["filename"]).rename(path / name)
        entry["filename"] = name
    (path / "state.json").write_text(json.dumps(state))
    assert sorted(new) != new
    return new


def shard_files(shards: ShardSet) -> dict[str, bytes]:
    """Every file of a prepared dataset but its manifest (whose lineage names the inputs), by name."""
    return {p.rsplit("/", 1)[-1]: shards.fs.cat_file(p) for p in sorted(shards.fs.ls(shards.path, detail=False))
            if not p.endswith("manifest.json")}


def token_stats(m: Manifest) -> dict:
    keep = ("unigram_entropy_nats", "documents", "duplicates_dropped", "skipped_bad", "skipped_null")
    return {"shards": m.shards, "eos": (m.eos_id, m.eos_token), "dtype": m.dtype,
            **{k: m.stats[k] for k in keep}}


@pytest.fixture
def memory_dir():
    """A fresh directory URL on fsspec's in-memory file system (an object store without a server)."""
    fs, root = fsspec.filesystem("memory"), f"/formats-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_jsonl_parquet_and_datasets_give_identical_shards(tmp_path, tok_file, memory_dir, capsys):
    inp = tmp_path / "in"
    inp.mkdir()
    jsonl = write_jsonl(inp / "docs.jsonl", DOCS)
    parquet = write_parquet(inp / "docs.parquet", DOCS, field="body")
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 4
    dataset = save_dataset(inp / "docs-ds", DOCS)
    arrow_files = reorder_arrow_files(dataset)

    from_jsonl = prepare([jsonl], tmp_path / "out-jsonl", tok_file, "--shard-tokens", "2000")
    assert "skipped 1 null text(s)" in capsys.readouterr().out
    from_parquet = prepare([parquet], tmp_path / "out-parquet", tok_file, "--shard-tokens", "2000",
                           "--text-field", "body", "--workers", "2")
    from_dataset = prepare([dataset], tmp_path / "out-ds", tok_file, "--shard-tokens", "2000")
    fsspec.filesystem("memory").put(str(inp), memory_dir, recursive=True)
    parquet_url = prepare([f"{memory_dir}/docs.parquet"], tmp_path / "out-parquet-url", tok_file,
                          "--shard-tokens", "2000", "--text-field", "body")
    dataset_url = prepare([f"{memory_dir}/docs-ds"], tmp_path / "out-ds-url", tok_file, "--shard-tokens", "2000")

    expected = shard_files(from_jsonl)
    assert len(expected) > 3  # several shards (.bin + .idx each) and tokenizer.json
    assert shard_files(from_parquet) == expected and shard_files(from_dataset) == expected
    stats = token_stats(from_jsonl.manifest)
    assert token_stats(from_parquet.manifest) == stats and token_stats(from_dataset.manifest) == stats
    assert stats["documents"] == 80 and stats["duplicates_dropped"] == 5 and stats["skipped_null"] == 1
    assert shard_files(parquet_url) == expected and shard_files(dataset_url) == expected

    # lineage: every input file with its size and sha256, the dataset's Arrow files in state.json's order
    inputs = from_dataset.manifest.stats["lineage"]["inputs"]
    assert [i["url"] for i in inputs] == [str(dataset / name) for name in arrow_files]
    assert [(i["bytes"], i["sha256"]) for i in inputs] == [
        ((dataset / n).stat().st_size, hashlib.sha256((dataset / n).read_bytes()).hexdigest()) for n in arrow_files]
    parquet_lineage = from_parquet.manifest.stats["lineage"]
    assert parquet_lineage["text_field"] == "body" and parquet_lineage["inputs"][0]["url"] == str(parquet)
    assert "text_field" not in from_jsonl.manifest.stats["lineage"]  # a default is left out
    assert [i["url"] for i in dataset_url.manifest.stats["lineage"]["inputs"]] == [
        f"{memory_dir}/docs-ds/{n}" for n in arrow_files]

    # a directory is searched for every format (a dataset's Arrow files in its state.json's order)
    every = prepare([inp], tmp_path / "out-every", tok_file, "--skip-bad")
    urls = [i["url"] for i in every.manifest.stats["lineage"]["inputs"]]
    assert urls == [str(dataset / n) for n in arrow_files] + [str(jsonl), str(parquet)]
    assert every.manifest.stats["skipped_bad"] == 1  # docs.parquet has no column `text`


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_missing_or_non_string_text_field_is_a_one_line_error(tmp_path, tok_file, capsys):
    out = str(tmp_path / "out")
    base = ["--output", out, "--tokenizer", str(tok_file), "--no-progress", "--workers", "1"]
    parquet = write_parquet(tmp_path / "p.parquet", TEXTS[:10], field="content")
    assert prepare_main(["--input", str(parquet), *base]) == 2
    err = one_line_error(capsys)
    assert "p.parquet: no column 'text' (columns: id, content)" in err and "--text-field" in err

    assert prepare_main(["--input", str(parquet), *base, "--text-field", "id"]) == 2
    assert "p.parquet: column 'id' is int64, not a string column (columns: id, content)" in one_line_error(capsys)

    dataset = save_dataset(tmp_path / "ds", TEXTS[:10], field="content", num_shards=1)
    assert prepare_main(["--input", str(dataset), *base, "--text-field", "body"]) == 2
    assert "data-00000-of-00001.arrow: no column 'body' (columns: id, content)" in one_line_error(capsys)

    jsonl = write_jsonl(tmp_path / "j.jsonl", TEXTS[:10], field="content")
    assert prepare_main(["--input", str(jsonl), *base]) == 2
    assert "j.jsonl:1: no field 'text' (fields: id, content)" in one_line_error(capsys)

    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    assert prepare_main(["--input", str(tmp_path / "broken.parquet"), *base]) == 2
    assert "broken.parquet: not a valid Parquet file" in one_line_error(capsys)


def test_missing_pyarrow_says_how_to_install_it(tmp_path, tok_file, capsys, monkeypatch):
    parquet = write_parquet(tmp_path / "p.parquet", TEXTS[:10])
    for module in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc"):
        monkeypatch.setitem(sys.modules, module, None)  # `import pyarrow` now raises ImportError
    assert prepare_main(["--input", str(parquet), "--output", str(tmp_path / "out"), "--tokenizer",
                         str(tok_file), "--no-progress"]) == 2
    assert "pip install 'rekindle[formats]'" in one_line_error(capsys)


WORDS = "the a cat dog sat ran on mat log and then home".split()


def word_level_tokenizer(path):
    """A tiny Hugging Face tokenizer whose end-of-document token is `</s>` (no <|endoftext|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path))
    return path


def test_hf_tokenizer_with_another_eos_token(tmp_path, capsys):
    tok_file = word_level_tokenizer(tmp_path / "tokenizer.json")
    docs = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 7)) for i in range(40)]
    docs[3] = "the cat </s> sat"  # the EOS text inside a document is not a document boundary
    write_jsonl(tmp_path / "docs.jsonl", docs)
    shards = prepare([tmp_path / "docs.jsonl"], tmp_path / "out", tok_file, "--eos-token", "</s>",
                     "--shard-tokens", "64")
    assert "warning" not in capsys.readouterr().err
    m = shards.manifest
    assert (m.eos_id, m.eos_token) == (2, "</s>") and len(m.shards) > 1
    assert m.stats["lineage"]["tokenizer"]["eos_token"] == "</s>"
    tokens = shards.read(0, len(shards))
    ends = (tokens == 2).nonzero()[0]
    assert len(ends) == len(docs) and ends[-1] == len(tokens) - 1
    # every document (the .idx offsets) starts right after an EOS of id 2
    starts = np.concatenate([int(shards.starts[i]) + np.fromfile(tmp_path / "out" / f"{s.name}.idx", np.int64)
                             for i, s in enumerate(m.shards)])
    assert starts[0] == 0 and (tokens[starts[1:] - 1] == 2).all() and len(starts) == len(docs)
    the, cat, unk, sat = (tokenizers_.load(tok_file).token_to_id(t) for t in ("the", "cat", "<unk>", "sat"))
    assert tokens[ends[2] + 1 : ends[3]].tolist() == [the, cat, unk, unk, unk, sat]  # "</", "s", ">"

    # the stream takes document boundaries from the manifest's EOS id
    from data.stream import BatchGeometry, TokenStream

    stream = TokenStream(ShardSet(str(tmp_path / "out")), BatchGeometry(seq_len=8, global_batch=2), seed=0,
                         val_fraction=0)
    batch = stream.next_batch_with_positions()
    inputs = batch.tokens[:, :-1]
    assert (batch.loss_mask == (inputs != 2)).all()
    after_eos = batch.positions[:, 1:][inputs[:, :-1] == 2]
    assert len(after_eos) and (after_eos == 0).all()  # positions restart after each </s>


def test_unknown_eos_token_is_a_one_line_error(tmp_path, tok_file, capsys):
    write_jsonl(tmp_path / "docs.jsonl", TEXTS[:10])
    args = ["--input", str(tmp_path / "docs.jsonl"), "--output", str(tmp_path / "out"), "--no-progress"]
    assert prepare_main([*args, "--tokenizer", str(tok_file), "--eos-token", "</s>"]) == 2
    err = one_line_error(capsys)
    assert "--eos-token '</s>' is not in the vocabulary of" in err and "special tokens: <|endoftext|>" in err
    assert not (tmp_path / "out").exists()


def test_manifest_without_eos_token_reads_as_the_default_with_its_old_checksum(tmp_path, tok_file):
    """A manifest written before the EOS token was recorded: its EOS is <|endoftext|>, and its checksum
    (which checkpoints hold) is the one computed before."""
    shards = prepare([write_jsonl(tmp_path / "d.jsonl", TEXTS[:20])], tmp_path / "out", tok_file)
    path = tmp_path / "out" / "manifest.json"
    raw = json.loads(path.read_text())
    assert raw["eos_token"] == tokenizers_.EOS
    del raw["eos_token"]
    path.write_text(json.dumps(raw))
    old = ShardSet(str(tmp_path / "out")).manifest
    assert old.eos_token == tokenizers_.EOS and old.eos_id == shards.manifest.eos_id
    assert old.sha256() == hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
    assert old.sha256() == shards.manifest.sha256()
