"""The model's arguments, declared once: the shape of trainer.model.transformer's Transformer and also the
`model` group of the run config (trainer/config/groups.py). Torch-free, so that a config error answers
before torch loads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config.schema import ConfigError, setting


@dataclass(frozen=True)
class ModelArgs:
    """The model's shape, declared once: also the `model` group of the run config (trainer/config/groups.py)."""

    dim: int = setting(256, "width of the residual stream", gt=0)
    n_layers: int = setting(4, "transformer blocks", gt=0)
    n_heads: int = setting(4, "query heads per attention layer; must divide dim into an even head dim", gt=0)
    n_kv_heads: int = setting(0, "key/value heads (grouped KV), must divide n_heads; 0 = n_heads", ge=0)
    ffn_mult: float = setting(4.0, "SwiGLU hidden = round(ffn_mult * dim * 2/3, multiple_of)", gt=0)
    multiple_of: int = setting(32, "the SwiGLU hidden size is rounded up to a multiple of this", gt=0)
    vocab_size: int = setting(4096, "embedding rows; at least the tokenizer's vocabulary", gt=0)
    seq_len: int = setting(256, "tokens per training sequence, the longest the model accepts", gt=0)
    tie_embeddings: bool = setting(True, "the output layer shares the input embedding's weights")
    rope_theta: float = setting(10000.0, "RoPE base: pair i of a head turns rope_theta^(-2i/head_dim) per position",
                                gt=0)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", ge=0)
    init_std: float = setting(0.02, "std of the normal weight init (residual projections: / sqrt(2 n_layers))", ge=0)
    init_from: str = setting("", "start from the weights of a Hugging Face Llama directory (config.json and "
                             "safetensors; its shape must be this one); a resume loads its checkpoint instead")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(self.ffn_mult * self.dim * 2 / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def check(self, prefix: str = "") -> None:
        """The rules between fields (each field's own limits are beside it; `trainer.config.schema.check`)."""
        if self.dim % self.n_heads:
            raise ConfigError(
                f"config key '{prefix}dim' ({self.dim}) must be divisible by {prefix}n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config keys '{prefix}dim'/'{prefix}n_heads' must give an even head dim for RoPE")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"config key '{prefix}n_kv_heads' ({self.kv_heads}) must divide {prefix}n_heads ({self.n_heads})"
            )
