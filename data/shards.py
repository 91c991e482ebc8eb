"""The token shard format: write, read and verify.

A prepared dataset is a directory (local path or fsspec URL) holding
  shard-00000.bin   raw token ids (uint16 when the vocabulary fits, else uint32), documents EOS-separated
  shard-00000.idx   int64 offsets of each document's first token inside the shard
  manifest.json     format version, dtype, EOS id and token, tokenizer sha256, per-shard tokens/docs/sha256,
                    stats
  tokenizer.json    the tokenizer that produced the ids
The manifest is written last, so a directory with a manifest is complete. The EOS token ends every
document: `<|endoftext|>` unless the data was prepared with another tokenizer's (`--eos-token`); readers
take its id from the manifest (`eos_id`), never from the token's text.

Reading: local shards are memory-mapped; remote shards (s3://, gs://, ... through fsspec) are fetched
whole, verified, and kept in a small LRU cache, so memory stays bounded by `cache_shards` shards.
The stream's block-shuffled order (data.stream) touches only a few shards at a time, so each remote
shard is fetched about once per epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from common.storage import filesystem, is_local, join, unreachable_as, write_file
from data.tokenizer import EOS

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"


class ShardError(RuntimeError):
    """A missing, truncated or corrupt shard or manifest."""


class CorruptShardError(ShardError):
    """A shard the manifest lists is missing, truncated or fails its checksum: the dataset is broken. Bad
    input: no restart can fix it."""


class NotADatasetError(ShardError):
    """The path holds no prepared dataset: it does not exist, or it has no readable manifest. Bad input:
    no restart can fix it."""


@dataclass
class ShardInfo:
    name: str
    tokens: int
    docs: int
    sha256: str


@dataclass
class Manifest:
    version: int
    dtype: str
    eos_id: int
    vocab_size: int
    tokenizer_sha256: str
    shards: list[ShardInfo]
    stats: dict[str, Any] = field(default_factory=dict)
    eos_token: str = EOS  # a manifest without one predates --eos-token, so its EOS is the default

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def sha256(self) -> str:
        # eos_token is left out: the tokenizer and eos_id, both in, determine it, and a manifest written
        # before it was recorded keeps the checksum that checkpoints (the data state) hold
        fields = {k: v for k, v in asdict(self).items() if k != "eos_token"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_json(text: str | bytes, where: str) -> Manifest:
        try:
            raw = json.loads(text)  # bytes that are not UTF-8 raise UnicodeDecodeError, a ValueError
            shards = [ShardInfo(**s) for s in raw.pop("shards")]
            manifest = Manifest(shards=shards, **raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise NotADatasetError(f"{where}: not a valid manifest ({type(e).__name__}: {e})") from None
        if manifest.version != FORMAT_VERSION:
            raise NotADatasetError(f"{where}: manifest format version {manifest.version}, expected {FORMAT_VERSION}")
        return manifest


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


class ShardWriter:
    """Accumulates tokenized documents and cuts a shard each time `shard_tokens` is reached."""

    def __init__(self, root: str, vocab_size: int, eos_id: int, shard_tokens: int = 1 << 24,
                 eos_token: str = EOS) -> None:
        self.root = root
        self.fs, self.path = filesystem(root)
        self.fs.makedirs(self.path, exist_ok=True)
        manifest = join(self.path, MANIFEST)
        if self.fs.exists(manifest):  # rewriting: the old manifest must not vouch for half-written new shards
            self.fs.rm_file(manifest)
        self.dtype = np.dtype(dtype_for(vocab_size))
        self.vocab_size, self.eos_id, self.eos_token, self.shard_tokens = vocab_size, eos_id, eos_token, shard_tokens
        self.shards: list[ShardInfo] = []
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, ids: list[int]) -> None:
        """One document's token ids (EOS is appended here)."""
        doc = np.empty(len(ids) + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = self.eos_id
        self.add_encoded(doc, np.array([len(doc)]))

    def add_encoded(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Several documents at once: `tokens` is each document followed by EOS, `lengths` their sizes
        with the EOS. Shards are cut exactly where adding the documents one by one would cut them."""
        tokens = tokens.astype(self.dtype, copy=False)
        start = 0
        for n in lengths.tolist():
            self._pending.append(tokens[start : start + n])
            self._pending_tokens += n
            start += n
            if self._pending_tokens >= self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        tokens = np.concatenate(self._pending)
        offsets = np.cumsum([0] + [len(d) for d in self._pending[:-1]], dtype=np.int64)
        name = f"shard-{len(self.shards):05d}"
        data = tokens.tobytes()
        write_file(self.fs, join(self.path, name + ".bin"), data)
        write_file(self.fs, join(self.path, name + ".idx"), offsets.tobytes())
        self._counts += np.bincount(tokens, minlength=self.vocab_size)[: self.vocab_size]
        self.shards.append(ShardInfo(name, len(tokens), len(offsets), hashlib.sha256(data).hexdigest()))
        self._pending, self._pending_tokens = [], 0

    def finish(self, tokenizer_json: bytes, stats: dict[str, Any] | None = None) -> Manifest:
        self._flush()
        if not self.shards:
            raise ShardError(f"no tokens were written to {self.root}: the input is empty")
        write_file(self.fs, join(self.path, TOKENIZER), tokenizer_json)
        p = self._counts[self._counts > 0] / self._counts.sum()
        manifest = Manifest(
            version=FORMAT_VERSION,
            dtype=self.dtype.name,
            eos_id=self.eos_id,
            vocab_size=self.vocab_size,
            tokenizer_sha256=hashlib.sha256(tokenizer_json).hexdigest(),
            shards=self.shards,
            stats={"unigram_entropy_nats": float(-(p * np.log(p)).sum()), **(stats or {})},
            eos_token=self.eos_token,
        )
        write_file(self.fs, join(self.path, MANIFEST), json.dumps(asdict(manifest), indent=1).encode())
        return manifest


class ShardSet:
    """Read access to the concatenated token stream of a prepared dataset.

    Local shards are memory-mapped and verified (size + sha256) the first time they are opened.
    Remote shards are fetched whole, verified on every fetch, and kept in an LRU of `cache_shards` shards.
    A ShardSet pickles without its open files, caches or filesystem handle (safe to send to worker processes).
    """

    def __init__(self, root: str, cache_shards: int = 8) -> None:
        if cache_shards < 1:
            raise ValueError(f"cache_shards must be at least 1; got {cache_shards}")
        self.root = root
        self.cache_shards = cache_shards
        self.fs, self.path = filesystem(root)
        manifest_path = join(self.path, MANIFEST)
        with unreachable_as(ShardError, f"cannot read {root}"):
            try:
                text = self.fs.cat_file(manifest_path)
            except FileNotFoundError as e:
                why = f" ({e.args[-1]})" if e.args and "bucket" in str(e.args[-1]).lower() else ""
                if not why and not self.fs.exists(self.path):
                    raise NotADatasetError(f"the data path {root} does not exist") from None
                raise NotADatasetError(f"no {MANIFEST} in {root}{why}: not a prepared dataset (run `python -m "
                                       "data.prepare`)") from e
        self.manifest = Manifest.from_json(text, join(root, MANIFEST))
        self._setup(verified=set())

    def _setup(self, verified: set[int]) -> None:
        self.dtype = np.dtype(self.manifest.dtype)
        self.starts = np.cumsum([0] + [s.tokens for s in self.manifest.shards], dtype=np.int64)
        self._local = is_local(self.fs)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified = verified  # local shards whose checksum already matched
        self.fetches = 0  # remote shard downloads so far (for tests and benchmarks)

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "cache_shards": self.cache_shards, "manifest": self.manifest,
                "verified": set(self._verified)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.root, self.cache_shards, self.manifest = state["root"], state["cache_shards"], state["manifest"]
        self.fs, self.path = filesystem(self.root)
        self._setup(verified=state["verified"])

    def reopen(self) -> ShardSet:
        """A copy with a fresh filesystem handle and empty cache (use one per process or thread)."""
        clone = ShardSet.__new__(ShardSet)
        clone.__setstate__(self.__getstate__())
        return clone

    def __len__(self) -> int:
        return int(self.starts[-1])

    def tokenizer_json(self) -> bytes:
        return self.fs.cat_file(join(self.path, TOKENIZER))

    def shard_of(self, token: int | np.ndarray) -> int | np.ndarray:
        """Index of the shard holding stream position `token` (vectorized)."""
        return np.searchsorted(self.starts, token, side="right") - 1

    def _shard(self, i: int) -> np.ndarray:
        arr = self._cache.get(i)
        if arr is None:
            arr = self._open(i)
            self._cache[i] = arr
            while len(self._cache) > self.cache_shards:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(i)
        return arr

    def _open(self, i: int) -> np.ndarray:
        info = self.manifest.shards[i]
        path = join(self.path, info.name + ".bin")
        where = join(self.root, info.name + ".bin")
        expected = info.tokens * self.dtype.itemsize
        try:
            if self._local:
                size = os.path.getsize(path)
                if size != expected:
                    raise CorruptShardError(f"shard {where} is {size} bytes, the manifest says {expected} (truncated?)")
                arr = np.memmap(path, dtype=self.dtype, mode="r")
                if i in self._verified:
                    return arr
                digest = hashlib.sha256(arr).hexdigest()
            else:
                data = self.fs.cat_file(path)
                self.fetches += 1
                if len(data) != expected:
                    raise CorruptShardError(
                        f"shard {where} is {len(data)} bytes, the manifest says {expected} (truncated?)"
                    )
                digest = hashlib.sha256(data).hexdigest()
                arr = np.frombuffer(data, dtype=self.dtype)
        except FileNotFoundError as e:
            raise CorruptShardError(f"shard {where} is missing") from e
        if digest != info.sha256:
            raise CorruptShardError(
                f"shard {where} fails its checksum (corrupt): sha256 {digest[:12]}…, expected {info.sha256[:12]}…"
            )
        if self._local:
            self._verified.add(i)
        return arr

    def verify(self) -> None:
        """Check every shard's size and checksum now (raises ShardError naming the first bad shard)."""
        for i in range(len(self.manifest.shards)):
            self._open(i)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the concatenated stream, possibly spanning shards."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"token range [{start}, {start + length}) outside 0..{len(self)}")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        i = int(self.shard_of(start))
        while pos < length:
            shard = self._shard(i)
            lo = start + pos - int(self.starts[i])
            n = min(length - pos, len(shard) - lo)
            out[pos : pos + n] = shard[lo : lo + n]
            pos += n
            i += 1
        return out
