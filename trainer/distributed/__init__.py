"""Every distributed concern of the trainer, so the model stays plain PyTorch.

    parallel      process groups (gloo | nccl), the per-attempt store, FSDP2 `fully_shard`, mixed
                  precision, compile, activation checkpointing, and the few collectives the loop uses
    torch_compat  the torch internals rekindle reaches into, each behind one checked function
"""
