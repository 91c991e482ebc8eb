"""data.prepare with several tokenizer processes: the output is identical for any number of them."""

from __future__ import annotations

import pytest

from data import tokenizer as tokenizers_
from data.prepare import prepare
from tests.helpers import TEXTS


@pytest.fixture(scope="module")
def tok():
    return tokenizers_.train(TEXTS, vocab_size=300)


def shard_bytes(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_output_is_identical_for_any_number_of_processes(tmp_path, tok):
    docs = TEXTS * 3  # duplicates too
    kw = dict(shard_tokens=3000, progress=False, chunk_chars=5000)  # many chunks: order across processes matters
    one = prepare(docs, str(tmp_path / "p1"), tok, workers=1, **kw)
    two = prepare(docs, str(tmp_path / "p2"), tok, workers=2, **kw)
    three = prepare(docs, str(tmp_path / "p3"), tok, workers=3, shard_tokens=3000, progress=False)  # 1 chunk
    assert one.sha256() == two.sha256() == three.sha256()
    assert shard_bytes(tmp_path / "p1") == shard_bytes(tmp_path / "p2") == shard_bytes(tmp_path / "p3")
    assert two.stats["documents"] == len(TEXTS) and two.stats["duplicates_dropped"] == 2 * len(TEXTS)
