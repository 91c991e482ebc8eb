"""Shards in object storage: data.prepare writes to and reads from s3:// (the loopback moto server),
ShardSet/TokenStream read remote shards exactly like local ones with a bounded cache, and a truncated,
bit-flipped or missing remote shard is detected and named."""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pytest

from data import tokenizer as tokenizers_
from data.prepare import main as prepare_main
from data.prepare import prepare
from data.shards import ShardError, ShardSet
from data.stream import BatchGeometry, TokenStream
from tests.helpers import TEXTS, upload


def test_prepare_writes_to_s3_and_reads_back_identically(local_dataset, s3_bucket):
    tok = tokenizers_.from_bytes(local_dataset.tokenizer_json())
    manifest = prepare(TEXTS, f"{s3_bucket}/ds", tok, shard_tokens=2000, progress=False)
    assert manifest.sha256() == local_dataset.manifest.sha256()  # byte-identical shards, same checksums
    remote = ShardSet(f"{s3_bucket}/ds")
    assert remote.manifest == local_dataset.manifest
    assert remote.tokenizer_json() == local_dataset.tokenizer_json()
    assert np.array_equal(remote.read(0, len(remote)), local_dataset.read(0, len(local_dataset)))


def test_prepare_cli_reads_s3_inputs_and_writes_s3_output(s3_bucket):
    fs, bucket = fsspec.core.url_to_fs(s3_bucket)
    fs.pipe_file(f"{bucket}/raw/a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:40]).encode())
    fs.pipe_file(f"{bucket}/raw/b.txt", TEXTS[40].encode())
    args = ["--input", f"{s3_bucket}/raw/*", "--output", f"{s3_bucket}/out", "--vocab-size", "280"]
    assert prepare_main(args) == 0
    out = ShardSet(f"{s3_bucket}/out")
    assert out.manifest.stats["documents"] == 41
    inputs = [i["url"] for i in out.manifest.stats["lineage"]["inputs"]]
    assert inputs == [f"{s3_bucket}/raw/a.jsonl", f"{s3_bucket}/raw/b.txt"]
    tok = tokenizers_.from_bytes(out.tokenizer_json())
    first = out.read(0, out.manifest.shards[0].tokens)
    assert tok.decode(first[: int(np.argmax(first == out.manifest.eos_id))].tolist()) == TEXTS[0]


def test_stream_from_s3_equals_local_with_bounded_cache(local_dataset, s3_bucket):
    remote = ShardSet(upload(local_dataset, f"{s3_bucket}/ds"), cache_shards=3)
    kw = dict(geometry=BatchGeometry(seq_len=16, global_batch=8), seed=5, val_fraction=0.05, shuffle_window=1)
    a, b = TokenStream(local_dataset, **kw), TokenStream(remote, **kw)
    for _ in range(2 * a.n_train // 8):  # two epochs
        assert np.array_equal(a.next_batch().numpy(), b.next_batch().numpy())
    assert len(remote._cache) <= 3
    # block shuffle keeps reads local: each shard is fetched about once per epoch, not once per sample
    n_shards = len(remote.manifest.shards)
    assert remote.fetches <= 2 * 2 * n_shards, remote.fetches


def corrupt_remote(url: str, how: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    shard = f"{path}/shard-00001.bin"
    data = bytearray(fs.cat_file(shard))
    if how == "flip":
        data[10] ^= 0x01
        fs.pipe_file(shard, bytes(data))
    elif how == "truncate":
        fs.pipe_file(shard, bytes(data[:-7]))
    else:
        fs.rm_file(shard)


@pytest.mark.parametrize(
    "how, message", [("flip", "fails its checksum"), ("truncate", "truncated"), ("delete", "missing")]
)
def test_corrupt_remote_shard_is_detected_and_named(local_dataset, s3_bucket, how, message):
    url = upload(local_dataset, f"{s3_bucket}/ds")
    corrupt_remote(url, how)
    broken = ShardSet(url)
    broken.read(0, 10)  # shard 0 is intact
    with pytest.raises(ShardError, match=rf"{s3_bucket}/ds/shard-00001\.bin.*{message}"):
        broken.read(local_dataset.manifest.shards[0].tokens, 10)
    with pytest.raises(ShardError, match=rf"shard-00001\.bin.*{message}"):
        ShardSet(url).verify()


def test_shardset_pickles_without_its_cache(local_dataset, s3_bucket):
    import pickle

    remote = ShardSet(upload(local_dataset, f"{s3_bucket}/ds"))
    remote.read(0, 100)
    clone = pickle.loads(pickle.dumps(remote))
    assert clone._cache == {} and clone.root == remote.root
    assert np.array_equal(clone.read(0, 3000), local_dataset.read(0, 3000))


def test_missing_bucket_is_named(s3_endpoint):
    with pytest.raises(ShardError, match="bucket does not exist"):
        ShardSet("s3://rekindle-no-such-bucket/ds")


def test_unreachable_endpoint_is_one_clear_line(tmp_path):
    """An endpoint nobody listens on (a closed loopback port): prepare and the trainer each say which
    URL they could not reach, in one line, without a traceback and without the credentials."""
    import subprocess
    import sys

    from tests.helpers import REPO, SECRET, SMOKE, unreachable_env

    (tmp_path / "a.txt").write_text("print('hello')\n" * 50)
    env = unreachable_env()
    prep = subprocess.run([sys.executable, "-m", "data.prepare", "--input", str(tmp_path / "a.txt"), "--output",
                           "s3://rekindle-unreachable/ds", "--vocab-size", "300", "--no-progress"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    train = subprocess.run([sys.executable, "-m", "trainer", str(SMOKE), f"run.dir={tmp_path / 'run'}",
                            "data.path=s3://rekindle-unreachable/ds", "log.progress=false"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 2 and "error: object storage unusable" in prep.stderr
    assert train.returncode == 4 and "error: cannot read s3://rekindle-unreachable/ds" in train.stderr
    for proc in (prep, train):
        assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout
        assert "Could not connect to the endpoint URL" in proc.stderr
