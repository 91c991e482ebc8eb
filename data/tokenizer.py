"""The tokenizer: train, save and load a byte-level BPE (`tokenizer.json`, Hugging Face `tokenizers`).

Byte-level means every input string is encodable (no unknown token) and nothing is downloaded:
the vocabulary is learned from the corpus on this machine. An existing tokenizer.json (any Hugging Face
tokenizer) can be loaded instead, with its own end-of-document token in place of EOS."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"  # the default end-of-document token (every manifest written before others were allowed)


def train(texts: Iterable[str], vocab_size: int, eos: str = EOS) -> Tokenizer:
    """Learn a byte-level BPE with `vocab_size` entries (the special token `eos` included) from `texts`."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes + EOS + 1 merge); got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save(tok: Tokenizer, path: str | Path) -> str:
    """Write tokenizer.json; returns its sha256."""
    data = tok.to_str()
    Path(path).write_text(data)
    return hashlib.sha256(data.encode()).hexdigest()


def load(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def from_bytes(data: bytes) -> Tokenizer:
    return Tokenizer.from_str(data.decode())


def eos_id(tok: Tokenizer, token: str = EOS) -> int:
    """The id of end-of-document token `token`; ValueError if the vocabulary lacks it."""
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer has no {token} token")
    return token_id


def special_tokens(tok: Tokenizer) -> list[str]:
    """The tokenizer's special tokens, in id order (data.prepare encodes their text inside a document as
    plain text, so the only ids of these in a stream are the ones it inserts)."""
    return [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]

