"""Hugging Face Llama interoperability (trainer/model/hf.py and `python -m trainer.export ... --format hf`):
an exported checkpoint loads in transformers' LlamaForCausalLM with the same logits and the same greedy
continuation, and its tokenizer with it; a saved LlamaForCausalLM (one file or sharded) becomes
rekindle's Transformer with the same logits and loss; another shape, a pickle, a missing checkpoint and
bad arguments are clear errors. Tiny models built here: no network, no hub."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers import SOLO, TEXTS
from trainer.checkpoint import Checkpointer, IncompatibleCheckpointError, TrainState
from trainer.export import main
from trainer.model import hf
from trainer.model.transformer import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")  # the `hf` (and `dev`) extra

VOCAB = 320  # room for the test tokenizer's 300 tokens
SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, seq_len=32, init_std=0.1)


def rekindle_model(tied: bool, seed: int = 0, **changes) -> Transformer:
    """A random model whose norm weights are not all ones, so that they are checked too."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**SHAPE, "tie_embeddings": tied, **changes})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_checkpoint(root: Path, net: Transformer, **state) -> Path:
    """A committed checkpoint of `net` at step 3 (train_state.json records its arguments unless `state`
    says otherwise)."""
    state = {"model": asdict(net.args), **state}
    Checkpointer(str(root), SOLO).save(TrainState(step=3, **state), net, torch.optim.AdamW(net.parameters()))
    return root


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from data import tokenizer as tokenizers_

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizers_.save(tokenizers_.train(TEXTS, vocab_size=300), path)
    return path


def greedy(model: Transformer, prompt: torch.Tensor, new: int, eos: int | None) -> torch.Tensor:
    """rekindle's greedy continuation of one prompt (1, t), stopping after EOS as `generate` does."""
    tokens = prompt
    for _ in range(new):
        with torch.no_grad():
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        if eos is not None and nxt.item() == eos:
            break
    return tokens


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_the_same_logits_and_generation(tied, tmp_path, tokenizer_file, capsys):
    model = rekindle_model(tied)
    out = tmp_path / "hf"
    ckpt = save_checkpoint(tmp_path / "ck", model)
    assert main([str(ckpt), str(out), "--format", "hf", "--tokenizer", str(tokenizer_file)]) == 0
    said = capsys.readouterr().out
    assert "(Hugging Face LlamaForCausalLM" in said and f"tokenizer from {tokenizer_file}" in said
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied and "model.layers.1.self_attn.k_proj.weight" in f.keys()

    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    assert theirs.config.tie_word_embeddings is tied and theirs.dtype == torch.float32
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), atol=1e-4, rtol=0)
    prompt = tokens[:1, :8]
    eos = theirs.generation_config.eos_token_id
    generated = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8)
    assert generated.tolist() == greedy(model, prompt, 8, eos).tolist()

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == theirs.config.eos_token_id == eos is not None
    text = "def f(x):\n    return x * 2  # twice"
    assert tok.decode(tok(text)["input_ids"]) == text

    weights, config = hf.read_hf_llama(str(out))  # and back: the same parameters, bit for bit
    back = hf.from_hf_state_dict(weights, config, model.args)
    assert list(back) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(("tied", "sharded"), [(True, False), (False, True)], ids=["tied", "untied-sharded"])
def test_a_transformers_llama_loads_into_rekindle(tied, sharded, tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, initializer_range=0.1)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(str(tmp_path), max_shard_size="100KB" if sharded else "1GB")
    assert (tmp_path / hf.INDEX).exists() is sharded

    weights, hf_config = hf.read_hf_llama(str(tmp_path))
    args = ModelArgs(**{**SHAPE, "tie_embeddings": tied, "rope_theta": 500.0})  # seq_len 32 < their 64: allowed
    ours = Transformer(args).eval()
    ours.load_state_dict(hf.from_hf_state_dict(weights, hf_config, args, f"{tmp_path}/config.json"))
    assert (ours.output.weight is ours.tok_embeddings.weight) is tied

    tokens = torch.randint(0, VOCAB, (3, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens[:, :32]), theirs(tokens[:, :32]).logits, atol=1e-4, rtol=0)
        # HF shifts labels inside; rekindle is given the next tokens as targets (as the training step does)
        loss = theirs(input_ids=tokens[:, :32], labels=tokens[:, :32]).loss
        torch.testing.assert_close(ours(tokens[:, :31], targets=tokens[:, 1:32]), loss, atol=1e-5, rtol=0)


def test_another_shape_names_every_differing_field(tmp_path):
    args = ModelArgs(**SHAPE)
    hf.check_hf_shape(hf.hf_config(args), args)  # what the exporter writes is this model
    config = {**hf.hf_config(args), "hidden_size": 128, "num_hidden_layers": 3, "rms_norm_eps": 1e-6}
    with pytest.raises(hf.HFModelError) as raised:
        hf.check_hf_shape(config, args, "DIR/config.json")
    assert isinstance(raised.value, IncompatibleCheckpointError)  # bad input: the trainer exits 2, no restart
    message = str(raised.value)
    for field in ("model.dim=64 vs hidden_size=128 in DIR/config.json",
                  "model.n_layers=2 vs num_hidden_layers=3 in DIR/config.json",
                  "model.norm_eps=1e-05 vs rms_norm_eps=1e-06 in DIR/config.json"):
        assert field in message
    assert "vocab_size" not in message

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5))
    theirs.save_pretrained(str(tmp_path / "m"))
    weights, config = hf.read_hf_llama(str(tmp_path / "m"))
    with pytest.raises(hf.HFModelError, match=r"model.n_kv_heads=2 vs num_key_value_heads=4 in .*m/config.json; "
                                              r"the FFN width .* vs intermediate_size=256"):
        hf.from_hf_state_dict(weights, config, args, f"{tmp_path}/m/config.json")


def test_pickled_and_missing_models_are_refused_unread(tmp_path):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf.hf_config(ModelArgs(**SHAPE))))
    (model_dir / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(hf.HFModelError, match=r"only as pickle files \(pytorch_model.bin\), which rekindle never"):
        hf.read_hf_llama(str(model_dir))
    with pytest.raises(hf.HFModelError, match="no Hugging Face model at .*nowhere"):
        hf.read_hf_llama(str(tmp_path / "nowhere"))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))
    with pytest.raises(hf.HFModelError, match="not a file of the directory"):
        hf.read_hf_llama(str(model_dir))


def test_bf16_export(tmp_path, capsys):
    model = rekindle_model(tied=True)
    out = tmp_path / "hf"
    assert main([str(save_checkpoint(tmp_path / "ck", model)), str(out), "--format", "hf", "--dtype", "bf16"]) == 0
    assert "no tokenizer.json written: the checkpoint records no dataset" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and config["eos_token_id"] is None
    assert not (out / "tokenizer.json").exists()
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    assert theirs.dtype == torch.bfloat16
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits.float(), model(tokens), atol=0.15, rtol=0.05)


def test_export_finds_the_tokenizer_of_the_dataset_it_was_trained_on(local_dataset, tmp_path, capsys):
    from trainer.config import load, save

    run = tmp_path / "run"  # the trainer's layout: run.dir/config.yaml and run.dir/checkpoints/step-N
    model = rekindle_model(tied=True)
    overrides = [f"run.dir={run}", f"data.path={local_dataset.root}", "data.cache_dir=" + str(tmp_path / "none")]
    save(load(None, overrides + [f"model.{k}={v}" for k, v in SHAPE.items()]), run / "config.yaml")
    # a checkpoint from before train_state.json kept the model arguments: config.yaml gives them
    save_checkpoint(run / "checkpoints", model, model={}, data={"manifest_sha256": local_dataset.manifest.sha256()})
    assert main([str(run / "checkpoints"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    captured = capsys.readouterr()
    assert f"tokenizer from {local_dataset.root}/tokenizer.json" in captured.out
    assert "records no model arguments: using the run's config.yaml" in captured.err
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == local_dataset.tokenizer_json()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == local_dataset.manifest.eos_id
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), atol=1e-4, rtol=0)


def test_cli_bad_input_exits_2_with_one_error_line(tmp_path, tokenizer_file, capsys):
    out = str(tmp_path / "hf")
    ckpt = str(save_checkpoint(tmp_path / "ck", rekindle_model(tied=True)))
    cases = {
        (str(tmp_path / "nowhere"), out, "--format", "hf"): f"no checkpoint at {tmp_path / 'nowhere'}",
        (ckpt, out, "--format", "hf", "--dtype", "fp16"): "invalid choice: 'fp16'",
        (ckpt, out, "--dtype", "bf16"): "--dtype, --tokenizer and --eos-token apply to --format hf only",
        (ckpt, out, "--format", "hf", "--tokenizer", str(tmp_path / "no.json")): "no.json: no such file",
        (ckpt, out, "--format", "hf", "--tokenizer", __file__): "is not a rekindle tokenizer.json",
        (ckpt, str(tokenizer_file), "--format", "hf"): "is a file: --format hf writes a directory",
    }
    for argv, why in cases.items():
        assert main(list(argv)) == 2, argv
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and why in errors[0], (argv, errors)
    assert not Path(out).exists()


def test_a_tokenizer_with_another_eos_token_is_exported_with_it(tmp_path, capsys):
    """Data prepared with a Hugging Face tokenizer whose document separator is `</s>`
    (`data.prepare --eos-token`): the export names that token and its id."""
    from tests.unit.test_data_formats import word_level_tokenizer

    tok = word_level_tokenizer(tmp_path / "tokenizer.json")
    ckpt, out = save_checkpoint(tmp_path / "ck", rekindle_model(tied=True)), tmp_path / "hf"
    assert main([str(ckpt), str(out), "--format", "hf", "--tokenizer", str(tok), "--eos-token", "</s>"]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    assert main([str(ckpt), str(tmp_path / "hf2"), "--format", "hf", "--tokenizer", str(tok)]) == 2  # no <|endoftext|>
    assert main([str(ckpt), str(tmp_path / "hf3"), "--format", "hf", "--eos-token", "</s>"]) == 2  # without a file
