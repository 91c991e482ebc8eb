"""Hugging Face Llama interoperability: a rekindle model in the terms of transformers' `LlamaForCausalLM`,
both ways, without importing transformers.

This module owns the correspondence: the parameter names, the RoPE row order of the query and key
projections, the config.json fields that mirror `ModelArgs` (and the check that a Hugging Face model has
this run's shape), writing a model directory that `LlamaForCausalLM.from_pretrained` loads, and reading
one back (safetensors only, one file or sharded; a pickle is never loaded). Finding a checkpoint and the
tokenizer it was trained with is trainer.export's job; loading the weights into a run is the loop's.

RoPE: rekindle rotates the interleaved pairs (2i, 2i+1) of each head (`trainer.model.transformer.apply_rope`), HF
Llama the pairs (i, i + head_dim/2) (`rotate_half`), both by the angle position * theta^(-2i/head_dim).
The two models compute the same function when the rows of every query and key head are reordered so
that row 2i becomes row i and row 2i+1 becomes row i + head_dim/2: attention scores are dot products
of q and k, which a permutation applied to both leaves unchanged (the inverse of the `permute` in
transformers' convert_llama_weights_to_hf.py, which goes from Meta's interleaved order to HF's)."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save

from common import storage
from data.tokenizer import EOS  # the default end of every document, and so also what precedes one
from trainer.checkpoint import IncompatibleCheckpointError
from trainer.model.args import ModelArgs

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_IGNORED = ("rotary_emb.inv_freq",)  # buffers that older transformers versions saved with the weights


class HFModelError(IncompatibleCheckpointError):
    """A Hugging Face model that cannot become this run's model: missing, pickled, not Llama, or of another
    shape. Bad input: no restart can fix it."""


# ---------------------------------------------------------------------- names and the RoPE row order
def hf_names(args: ModelArgs) -> dict[str, str]:
    """rekindle parameter name -> HF Llama name, for every key of `Transformer(args).state_dict()`, in its
    order."""
    names = {"tok_embeddings.weight": _TOP["tok_embeddings.weight"]}
    for i in range(args.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _BLOCK.items()})
    return {**names, "norm.weight": _TOP["norm.weight"], "output.weight": _TOP["output.weight"]}


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter of `Transformer(args)`, by rekindle name."""
    d, hd, ffn = args.dim, args.head_dim, args.ffn_hidden
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d), "norm.weight": (d,),
                                          "output.weight": (args.vocab_size, d)}
    block = {"attention_norm.weight": (d,), "attention.wq.weight": (args.n_heads * hd, d),
             "attention.wk.weight": (args.kv_heads * hd, d), "attention.wv.weight": (args.kv_heads * hd, d),
             "attention.wo.weight": (d, args.n_heads * hd), "ffn_norm.weight": (d,),
             "feed_forward.w1.weight": (ffn, d), "feed_forward.w3.weight": (ffn, d),
             "feed_forward.w2.weight": (d, ffn)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def _rotary_heads(name: str, args: ModelArgs) -> int | None:
    """How many RoPE heads the rows of parameter `name` (rekindle name) hold; None if it is not rotated."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from rekindle's order (pairs 2i, 2i+1) to HF's (pairs i, i + head_dim/2)."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_halves`."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).reshape(w.shape)


def to_hf_state_dict(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """rekindle weights (a tied `output.weight` may be absent) -> HF Llama's names and row order; a tied
    `lm_head.weight` is left out, as `save_pretrained` does. Other names or shapes than `args` gives are
    an IncompatibleCheckpointError naming them."""
    shapes = expected_shapes(args)
    needed = [n for n in shapes if not (args.tie_embeddings and n == "output.weight")]
    wrong = [f"{n} is missing" for n in needed if n not in weights]
    wrong += [f"{n} is not a parameter of this model" for n in weights if n not in shapes]
    wrong += [f"{n} is {list(t.shape)}, the model arguments give {list(shapes[n])}"
              for n, t in weights.items() if n in shapes and tuple(t.shape) != shapes[n]]
    if wrong:
        raise IncompatibleCheckpointError(f"the weights do not fit model arguments {args}: {'; '.join(wrong)}")
    names = hf_names(args)
    out = {}
    for name in needed:
        heads = _rotary_heads(name, args)
        w = weights[name]
        out[names[name]] = (w if heads is None else interleaved_to_halves(w, heads)).contiguous()
    return out


def from_hf_state_dict(hf_weights: dict[str, torch.Tensor], hf_config: dict, args: ModelArgs,
                       source: str = CONFIG) -> dict[str, torch.Tensor]:
    """HF Llama weights -> the keys of `Transformer(args).state_dict()` (tied: `output.weight` is the
    embedding tensor itself), in rekindle's row order and the stored dtype (`load_state_dict` casts).
    `source`: where `hf_config` was read, for the messages. Raises HFModelError naming every field of
    the config and every tensor that does not fit `args`."""
    check_hf_shape(hf_config, args, source)
    names, shapes = hf_names(args), expected_shapes(args)
    tied = args.tie_embeddings
    needed = {ours: theirs for ours, theirs in names.items() if not (tied and ours == "output.weight")}
    known = set(names.values())
    wrong = [f"{theirs} is missing" for theirs in needed.values() if theirs not in hf_weights]
    wrong += [f"{name} has no counterpart in rekindle's model" for name in sorted(hf_weights)
              if name not in known and not name.endswith(_IGNORED)]
    wrong += [f"{theirs} is {list(hf_weights[theirs].shape)}, expected {list(shapes[ours])}"
              for ours, theirs in needed.items()
              if theirs in hf_weights and tuple(hf_weights[theirs].shape) != shapes[ours]]
    if wrong:
        raise HFModelError(f"the weights beside {source} do not fit this model: {'; '.join(wrong)}")
    out = {}
    for ours, theirs in names.items():
        if ours not in needed:
            continue
        heads = _rotary_heads(ours, args)
        w = hf_weights[theirs]
        out[ours] = w if heads is None else halves_to_interleaved(w, heads)
    if tied:
        out["output.weight"] = out["tok_embeddings.weight"]
    return {name: out[name] for name in names}  # in the model's order


# ---------------------------------------------------------------------- config.json
def _mirrored(args: ModelArgs) -> dict[str, tuple[str, Any]]:
    """config.json key -> (the rekindle setting it mirrors, its value): the fields that must agree for HF
    Llama and rekindle's Transformer to be the same function."""
    return {
        "model_type": ("rekindle's architecture", "llama"),
        "hidden_size": ("model.dim", args.dim),
        "num_hidden_layers": ("model.n_layers", args.n_layers),
        "num_attention_heads": ("model.n_heads", args.n_heads),
        "num_key_value_heads": ("model.n_kv_heads", args.kv_heads),
        "head_dim": ("model.dim / model.n_heads", args.head_dim),
        "intermediate_size": ("the FFN width of model.ffn_mult, model.multiple_of", args.ffn_hidden),
        "vocab_size": ("model.vocab_size", args.vocab_size),
        "tie_word_embeddings": ("model.tie_embeddings", args.tie_embeddings),
        "rope_theta": ("model.rope_theta", args.rope_theta),
        "rope_type": ("rekindle's RoPE", "default"),
        "rms_norm_eps": ("model.norm_eps", args.norm_eps),
        "hidden_act": ("rekindle's activation", "silu"),
        "attention_bias": ("rekindle's attention bias", False),
        "mlp_bias": ("rekindle's MLP bias", False),
    }


def _as_read(config: dict) -> dict[str, Any]:
    """The mirrored fields of a config.json, with LlamaConfig's defaults for absent ones; the RoPE base
    and type from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    return {
        "model_type": config.get("model_type"),
        "hidden_size": hidden,
        "num_hidden_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or head_dim,
        "intermediate_size": config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "hidden_act": config.get("hidden_act", "silu"),
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
    }


def check_hf_shape(hf_config: dict, args: ModelArgs, source: str = CONFIG) -> None:
    """Raise HFModelError listing every field of `hf_config` (read from `source`) that differs from
    what `args` gives, as `model.<key>=<ours> vs <config key>=<theirs> in <source>`. The context length
    (max_position_embeddings vs model.seq_len) may differ: RoPE has no learned positions."""
    theirs = _as_read(hf_config)
    wrong = [f"{setting}={ours!r} vs {key}={theirs[key]!r} in {source}"
             for key, (setting, ours) in _mirrored(args).items() if theirs[key] != ours]
    if wrong:
        raise HFModelError(f"the Hugging Face model is another model than this run's: {'; '.join(wrong)}: "
                           "set the model settings to the Hugging Face model's")


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32, eos_id: int | None = None) -> dict:
    """config.json of `args` as LlamaForCausalLM (transformers 4.45 and later read it). EOS also stands
    for BOS: in rekindle's data a document follows the previous one's end-of-text token."""
    fields = {key: value for key, (_, value) in _mirrored(args).items() if key != "rope_type"}
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        **fields,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},  # transformers 5
        "max_position_embeddings": args.seq_len,
        "initializer_range": args.init_std,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": dtype_name,  # transformers 4.x
        "dtype": dtype_name,
    }


def tokenizer_config(args: ModelArgs, eos_token: str = EOS) -> dict:
    """tokenizer_config.json for the dataset's tokenizer.json, whose document separator is `eos_token`."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos_token, "eos_token": eos_token,
            "model_max_length": args.seq_len, "clean_up_tokenization_spaces": False}


def generation_config(eos_id: int | None) -> dict:
    """generation_config.json: generation ends at EOS, which also pads a batch."""
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}


# ---------------------------------------------------------------------- the model directory
def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def write_hf_llama(out: str, weights: dict[str, torch.Tensor], args: ModelArgs, dtype: torch.dtype = torch.float32,
                   tokenizer_json: bytes | None = None, eos_id: int | None = None,
                   eos_token: str = EOS) -> dict[str, int]:
    """Write directory `out` (a path or URL) that `LlamaForCausalLM.from_pretrained` loads: model.safetensors
    in `dtype`, the tokenizer files (tokenizer.json only when given), generation_config.json and, last, so
    that a directory left half-written does not load, config.json. Returns {file name: bytes}."""
    hf = {name: w.to(dtype).contiguous() for name, w in to_hf_state_dict(weights, args).items()}
    files = {WEIGHTS: save(hf, metadata={"format": "pt"})}
    if tokenizer_json is not None:
        files[TOKENIZER] = tokenizer_json
    files[TOKENIZER_CONFIG] = _json(tokenizer_config(args, eos_token))
    files[GENERATION_CONFIG] = _json(generation_config(eos_id))
    files[CONFIG] = _json(hf_config(args, dtype, eos_id))
    fs, p = storage.filesystem(out)
    if fs.isfile(p):
        raise FileExistsError(f"{out} is a file: --format hf writes a directory")
    fs.makedirs(p, exist_ok=True)
    for name, data in files.items():
        storage.write_file(fs, storage.join(p, name), data)
    return {name: len(data) for name, data in files.items()}


def read_hf_llama(directory: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights (HF names) and config.json of a Hugging Face model directory (a path or URL):
    model.safetensors, or the shards model.safetensors.index.json names. Weights only in pickle files
    (pytorch_model.bin, ...) are refused, never unpickled: loading a pickle can run any code."""
    fs, p = storage.filesystem(directory)
    with storage.unreachable_as(HFModelError, f"cannot read {directory}"):
        if not fs.isdir(p):
            raise HFModelError(f"no Hugging Face model at {directory}: it does not exist or is not a directory")
        present = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(p, detail=False)}
        if CONFIG not in present:
            raise HFModelError(f"{directory} is not a Hugging Face model directory: it has no {CONFIG}")
        config = _read_json(fs, storage.join(p, CONFIG), f"{directory}/{CONFIG}")
        if INDEX in present:
            files = _shard_files(_read_json(fs, storage.join(p, INDEX), f"{directory}/{INDEX}"), present, directory)
        elif WEIGHTS in present:
            files = {WEIGHTS: None}
        else:
            pickles = sorted(name for name in present if name.endswith(PICKLE_SUFFIXES))
            if pickles:
                raise HFModelError(
                    f"{directory} holds its weights only as pickle files ({', '.join(pickles)}), which rekindle never "
                    "loads (unpickling can run arbitrary code): convert them to safetensors where you trust them, "
                    "e.g. `LlamaForCausalLM.from_pretrained(DIR).save_pretrained(OUT)`")
            raise HFModelError(f"{directory} holds no {WEIGHTS} and no {INDEX}")
        weights: dict[str, torch.Tensor] = {}
        for name, names in files.items():
            tensors = _read_safetensors(fs, storage.join(p, name), f"{directory}/{name}")
            lacking = sorted(set(names or ()) - set(tensors))
            if lacking:
                raise HFModelError(f"{directory}/{INDEX} places {', '.join(lacking[:3])} in {name}, which lacks it")
            weights.update(tensors)
    return weights, config


def _read_json(fs: Any, path: str, where: str) -> dict:
    try:
        value = json.loads(fs.cat_file(path))
    except ValueError as e:
        raise HFModelError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise HFModelError(f"{where} does not hold a JSON object")
    return value


def _shard_files(index: dict, present: set[str], directory: str) -> dict[str, list[str]]:
    """{shard file: the tensor names the index places in it}; every file a plain name in `directory`."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFModelError(f"{directory}/{INDEX} has no weight_map")
    files: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", ".."):
            raise HFModelError(f"{directory}/{INDEX} names {name!r} for {tensor}: not a file of the directory")
        if not name.endswith(".safetensors"):
            raise HFModelError(f"{directory}/{INDEX} names {name} for {tensor}: only safetensors files are loaded")
        if name not in present:
            raise HFModelError(f"{directory}/{INDEX} names {name}, which is not there")
        files.setdefault(name, []).append(tensor)
    return files


def _read_safetensors(fs: Any, path: str, where: str) -> dict[str, torch.Tensor]:
    try:
        if storage.is_local(fs):
            return load_file(storage.local_path(path))
        return load(fs.cat_file(path))
    except SafetensorError as e:
        raise HFModelError(f"{where} is not a readable safetensors file: {e}") from None
