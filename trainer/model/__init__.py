"""The model, pure PyTorch (no parallelism here: trainer.distributed applies it), and its weights in
other formats.

    args          ModelArgs: the model's shape, also the `model` group of the config (torch-free)
    transformer   the Llama-style Transformer: RMSNorm, RoPE, SwiGLU, causal attention, grouped KV heads
    loss          the fused, chunked output projection + cross-entropy (never the full logits)
    hf            Hugging Face Llama directories, both ways (export, `model.init_from`)

Nothing is imported here, so reading the config's `model` group does not load torch."""
