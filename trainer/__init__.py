"""The training process (one per rank): `python -m trainer CONFIG [key=value ...]`, alone or under
torchrun or `python -m launch`.

    __main__      the command line: errors -> exit codes (trainer.protocol)
    config        the run configuration (schema: how a key is declared; model_args: the `model` group)
    loop          train(): build -> resume -> while: train_step -> after_step -> finish
    resume_rules  which config keys a resume may change (and which it refuses)
    lease         one job per run.dir / checkpoint.dir (LEASE.json, renewed; stale ones taken over)
    step          one optimizer step -> StepResult; the non-finite guard
    optim         AdamW and the learning-rate schedule
    evaluate      the held-out loss and when it is due
    model, loss   the Llama-style transformer and its fused output layer + cross-entropy
    parallel      process group, FSDP2, mixed precision, compile, activation checkpointing
    checkpoint/   sharded checkpoints: format, commit (no collectives), spool, staging, checkpointer
    storage       fsspec access shared with data/: local or not, whole-file writes, checksums, unreachable,
                  request timeouts and the stall watch (storage.*)
    metrics       step timing, MFU, metrics.jsonl / TensorBoard, progress; profiling: torch.profiler
    protocol      the contract with the launcher: env vars, exit codes, heartbeats, events.jsonl
    fault         preemption (SIGTERM), dying with the launcher, fault injection for tests
    process, logs /proc and process life; the one logging set-up
    startup       start-up measurements kept across the launcher's restarts (the matmul peak)
    export, hf    weights out: safetensors, or a Hugging Face Llama directory (hf: both directions)
    plot, cost, host, testing   the run plot; cost; malloc/THP; loopback S3 and a pausable TCP proxy
"""
