"""Data pipeline, basic form: prepare -> shards + manifest; TokenStream slices global batches by rank,
covers every sample once per epoch, resumes from its state, and detects corrupt shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data import tokenizer as tokenizers_
from data.prepare import InputError, expand_inputs, prepare, read_documents
from data.prepare import main as prepare_main
from data.shards import NotADatasetError, ShardError, ShardSet
from data.stream import BatchGeometry, DataStateError, TokenStream
from tests.helpers import TEXTS, make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> ShardSet:
    return make_dataset(tmp_path_factory.mktemp("shards"))


def test_manifest_describes_shards(dataset):
    m = dataset.manifest
    assert len(m.shards) > 3  # small shards: reads must cross shard boundaries
    assert m.dtype == "uint16" and m.vocab_size <= 300
    assert m.stats["documents"] == len(TEXTS) and m.stats["duplicates_dropped"] == 0
    assert sum(s.docs for s in m.shards) == len(TEXTS)
    assert 0 < m.stats["unigram_entropy_nats"] < np.log(300)
    # the stream is the documents, each followed by EOS
    first = dataset.read(0, m.shards[0].tokens)
    tok = tokenizers_.from_bytes(dataset.tokenizer_json())
    assert tok.decode(first[: int(np.argmax(first == m.eos_id))].tolist()) == TEXTS[0]


def test_exact_duplicates_are_dropped(tmp_path):
    tok = tokenizers_.train(TEXTS, vocab_size=300)
    manifest = prepare(TEXTS[:10] + TEXTS[:5], str(tmp_path), tok, progress=False)
    assert manifest.stats == {**manifest.stats, "documents": 10, "duplicates_dropped": 5}


def test_reads_across_shard_boundaries(dataset):
    files = [f"{dataset.root}/{s.name}.bin" for s in dataset.manifest.shards]
    whole = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in files])
    for start in (0, 1999, dataset.manifest.shards[0].tokens - 3, len(dataset) - 50):
        assert np.array_equal(dataset.read(start, 50), whole[start : start + 50])


def epoch_order(s: TokenStream, epoch: int) -> np.ndarray:
    return s.sample_indices(epoch * s.n_train, s.n_train)


def stream(dataset, rank=0, world=1, seed=5, batch=8, seq=16, val_fraction=0.05):
    geometry = BatchGeometry(seq_len=seq, global_batch=batch, rank=rank, world=world)
    return TokenStream(dataset, geometry, seed=seed, val_fraction=val_fraction)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_take_disjoint_slices_of_the_same_global_batch(dataset, world):
    single = stream(dataset)
    ranks = [stream(dataset, r, world) for r in range(world)]
    for _ in range(5):
        full = single.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert all(p.shape == (8 // world, 17) for p in parts)
        assert np.array_equal(np.concatenate(parts), full.numpy())


def test_every_training_sample_once_per_epoch_and_val_held_out(dataset):
    s = stream(dataset, batch=4)
    for epoch in range(2):
        ids = s.sample_indices(epoch * s.n_train, s.n_train)
        assert sorted(ids.tolist()) == list(range(s.n_train))
    # batches straddling the epoch boundary continue into the next epoch's order
    assert s.sample_indices(s.n_train - 2, 4).tolist() == [*epoch_order(s, 0)[-2:], *epoch_order(s, 1)[:2]]
    first = s.next_batch()
    assert np.array_equal(first.numpy(), np.stack([dataset.read(i * 16, 17) for i in s.sample_indices(0, 4)]))
    val_start = s.n_train * 16
    assert np.array_equal(s.val_batch(0)[0].numpy(), dataset.read(val_start, 17))  # held out: after train


def test_epochs_reshuffle_deterministically(dataset):
    a, b = stream(dataset), stream(dataset)
    assert epoch_order(a, 0).tolist() == epoch_order(b, 0).tolist()
    assert epoch_order(a, 0).tolist() != epoch_order(a, 1).tolist()
    assert epoch_order(stream(dataset, seed=6), 0).tolist() != epoch_order(a, 0).tolist()
    # computed a few samples at a time (windows built and dropped as it goes), the order is the same
    piecewise = np.concatenate([b.sample_indices(p, 7) for p in range(0, 2 * b.n_train, 7)])[: 2 * b.n_train]
    assert piecewise.tolist() == [*epoch_order(a, 0), *epoch_order(a, 1)]


def test_resuming_far_away_builds_only_the_windows_it_reads(dataset):
    """Starting at any offset costs one window of the order, not the epoch or the samples before it."""
    s = stream(dataset, batch=4)
    s.load_state_dict({**s.state_dict(), "samples_consumed": 1000 * s.n_train + 4 * (s.n_train // 8)})
    s.next_batch()
    assert len(s._windows) <= 2 and set(s._layouts) <= {999, 1000, 1001}
    assert all(len(w) <= s.n_train for w in s._windows.values())


def test_resume_from_state_matches_uninterrupted(dataset):
    ref = stream(dataset)
    batches = [ref.next_batch() for _ in range(12)]
    first = stream(dataset)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON
    resumed = stream(dataset, rank=1, world=2)  # a different world size re-slices the same batches
    resumed.load_state_dict(state)
    for b in batches[5:]:
        assert np.array_equal(resumed.next_batch().numpy(), b[4:].numpy())


def test_state_from_other_dataset_or_order_is_refused(dataset):
    state = stream(dataset).state_dict()
    with pytest.raises(DataStateError, match="seed"):
        stream(dataset, seed=99).load_state_dict(state)
    with pytest.raises(DataStateError, match="manifest_sha256"):
        stream(dataset).load_state_dict({**state, "manifest_sha256": "0" * 64})
    # another held-out share: another epoch length and order, and trained samples would be evaluated on
    with pytest.raises(DataStateError, match="val_fraction"):
        stream(dataset, val_fraction=0.2).load_state_dict(state)
    legacy = {k: v for k, v in state.items() if k != "n_train"}  # saved before n_train was recorded
    stream(dataset).load_state_dict(legacy)


def test_builtin_corpus_finds_the_stdlib_under_a_directory_named_like_tests(tmp_path):
    from data.corpus import source_files

    lib = tmp_path / "tester" / "lib" / "python3"
    for rel in ("json/decoder.py", "os.py", "test/test_os.py", "idlelib/idle_test/t.py", "site-packages/x/y.py"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text("x = 1\n")
    assert sorted(p.relative_to(lib).as_posix() for p in source_files(10**6, lib)) == ["json/decoder.py", "os.py"]


def corrupt_copy(dataset, tmp_path, how: str):
    import shutil

    shutil.copytree(dataset.root, tmp_path / "copy")
    shard = tmp_path / "copy" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[10] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(bytes(data[:-7]))
    else:
        shard.unlink()
    return ShardSet(str(tmp_path / "copy"))


@pytest.mark.parametrize(
    "how, message", [("flip", "fails its checksum"), ("truncate", "truncated"), ("delete", "missing")]
)
def test_corrupt_shard_is_detected_and_named(dataset, tmp_path, how, message):
    broken = corrupt_copy(dataset, tmp_path, how)
    broken.read(0, 10)  # shard 0 is intact
    with pytest.raises(ShardError, match=rf"shard-00001\.bin.*{message}|{message}.*shard-00001"):
        broken.read(dataset.manifest.shards[0].tokens, 10)


def test_prepare_cli_reads_txt_and_jsonl_gz(tmp_path):
    import gzip

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(TEXTS[0])
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        for t in TEXTS[1:50]:
            f.write(json.dumps({"text": t}) + "\n")
    args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--vocab-size", "280"]
    assert prepare_main(args) == 0
    assert ShardSet(str(tmp_path / "out")).manifest.stats["documents"] == 50


def test_bad_input_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: malformed JSON"):
        list(read_documents(str(bad)))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"line one\ncaf\xe9\n")
    with pytest.raises(InputError, match=r"latin.txt:2: invalid UTF-8"):
        list(read_documents(str(latin)))
    with pytest.raises(InputError, match="matches no file"):
        expand_inputs([str(tmp_path / "nothing*.txt")])


def test_not_a_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(NotADatasetError, match="no manifest.json"):
        ShardSet(str(tmp_path))
    with pytest.raises(NotADatasetError, match=f"the data path {tmp_path / 'nowhere'} does not exist"):
        ShardSet(str(tmp_path / "nowhere"))
    (tmp_path / "manifest.json").write_bytes(b'{"version": 1, "shards": [\xff\xfe]}')  # not UTF-8
    with pytest.raises(NotADatasetError, match="manifest.json: not a valid manifest \\(UnicodeDecodeError"):
        ShardSet(str(tmp_path))
    (tmp_path / "manifest.json").write_text("[1, 2]")  # JSON, but not a manifest
    with pytest.raises(NotADatasetError, match="not a valid manifest"):
        ShardSet(str(tmp_path))
