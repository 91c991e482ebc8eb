"""data.prepare hardening: lineage and duplicate counts in the manifest, an unchanged re-run does
nothing, and bad input is an error naming the file and line, or (--skip-bad) skipped and counted.
(Output identical for any number of tokenizer processes: tests/integration/test_data_prepare_parallel.py.)"""

from __future__ import annotations

import hashlib
import json

import pytest

from data import tokenizer as tokenizers_
from data.prepare import InputError, prepare, read_documents
from data.prepare import main as prepare_main
from data.shards import ShardSet
from tests.helpers import TEXTS


@pytest.fixture(scope="module")
def tok():
    return tokenizers_.train(TEXTS, vocab_size=300)


def shard_bytes(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_eos_text_inside_a_document_is_not_a_document_boundary(tmp_path, tok):
    """A document may contain the EOS token's text (code that prints it, web text): the stream must
    still hold exactly one EOS per document, at its end."""
    docs = [f"print('{tokenizers_.EOS}')  # a document that mentions the marker", *TEXTS[:3]]
    manifest = prepare(docs, str(tmp_path / "ds"), tok, shard_tokens=100_000, progress=False)
    tokens = ShardSet(str(tmp_path / "ds")).read(0, manifest.total_tokens)
    eos = tokenizers_.eos_id(tok)
    assert int((tokens == eos).sum()) == len(docs)
    first_doc_end = int((tokens == eos).nonzero()[0][0])
    assert tok.decode(tokens[:first_doc_end].tolist(), skip_special_tokens=False) == docs[0]


def write_inputs(d):
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:60] + TEXTS[:3]))
    (d / "b.txt").write_text(TEXTS[100])
    return d


def test_manifest_records_lineage_and_rerun_is_skipped(tmp_path, capsys):
    inp = write_inputs(tmp_path / "in")
    args = ["--input", str(inp), "--output", str(tmp_path / "out"), "--vocab-size", "280", "--workers", "2",
            "--no-progress"]
    assert prepare_main(args) == 0
    stats = ShardSet(str(tmp_path / "out")).manifest.stats
    assert stats["duplicates_dropped"] == 3 and stats["documents"] == 61 and stats["skipped_bad"] == 0
    lineage = stats["lineage"]
    assert [(i["url"], i["bytes"], i["sha256"]) for i in lineage["inputs"]] == [
        (str(p), p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(inp.iterdir())
    ]
    assert lineage["tokenizer"] == {"train_vocab_size": 280} and lineage["shard_tokens"] == 1 << 24
    before = shard_bytes(tmp_path / "out")
    mtime = (tmp_path / "out" / "manifest.json").stat().st_mtime_ns
    capsys.readouterr()
    assert prepare_main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert (tmp_path / "out" / "manifest.json").stat().st_mtime_ns == mtime  # nothing rewritten
    # a changed input is new lineage: the output is rebuilt
    (inp / "b.txt").write_text(TEXTS[101])
    assert prepare_main(args) == 0
    assert "up to date" not in capsys.readouterr().out
    assert shard_bytes(tmp_path / "out") != before
    assert ShardSet(str(tmp_path / "out")).manifest.stats["lineage"]["inputs"][1]["sha256"] != \
        lineage["inputs"][1]["sha256"]


def bad_inputs(d):
    d.mkdir()
    (d / "good.txt").write_text(TEXTS[0])
    (d / "lines.jsonl").write_bytes(b'{"text": "ok one"}\n{"text": broken\n{"text": "caf\xe9"}\n{"nope": 1}\n'
                                    b'{"text": "ok two"}\n')
    (d / "empty.txt").write_text("")
    (d / "latin.txt").write_bytes(b"line one\ncaf\xe9\n")
    return d


def test_bad_input_is_an_error_naming_file_and_line(tmp_path, capsys):
    inp = bad_inputs(tmp_path / "in")
    with pytest.raises(InputError, match=r"lines\.jsonl:2: malformed JSON line"):
        list(read_documents(str(inp / "lines.jsonl")))
    (tmp_path / "utf.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"utf\.jsonl:3: invalid UTF-8"):
        list(read_documents(str(tmp_path / "utf.jsonl")))
    with pytest.raises(InputError, match=r"empty\.txt: empty file"):
        list(read_documents(str(inp / "empty.txt")))
    out = str(tmp_path / "out")
    assert prepare_main(["--input", str(inp), "--output", out, "--vocab-size", "280", "--no-progress"]) == 2
    assert "empty.txt: empty file" in capsys.readouterr().err  # the first bad input, in sorted order
    missing = str(tmp_path / "missing.txt")
    assert prepare_main(["--input", missing, "--output", out, "--vocab-size", "280"]) == 2
    err = capsys.readouterr().err
    assert "missing.txt" in err and "matches no file" in err


def test_skip_bad_skips_and_counts(tmp_path):
    inp = bad_inputs(tmp_path / "in")
    out = tmp_path / "out"
    args = ["--input", str(inp), str(tmp_path / "missing.txt"), "--output", str(out), "--vocab-size", "280",
            "--skip-bad", "--no-progress"]
    assert prepare_main(args) == 0
    stats = ShardSet(str(out)).manifest.stats
    assert stats["documents"] == 3  # good.txt, "ok one", "ok two"
    assert stats["skipped_bad"] == 6
    wheres = sorted(s["where"] for s in stats["skipped"])
    assert any(w.endswith("lines.jsonl:2") for w in wheres) and any(w.endswith("lines.jsonl:3") for w in wheres)
    assert any(w.endswith("lines.jsonl:4") for w in wheres) and any(w.endswith("latin.txt:2") for w in wheres)
    assert any(w.endswith("empty.txt") for w in wheres) and any("missing.txt" in w for w in wheres)


def test_empty_input_is_an_error(tmp_path, tok, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.jsonl").write_text("\n\n")
    args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--vocab-size", "280",
            "--skip-bad", "--no-progress"]
    assert prepare_main(args) == 2
    assert "empty" in capsys.readouterr().err
    with pytest.raises(InputError, match="the input is empty"):
        prepare([], str(tmp_path / "out2"), tok, progress=False)
