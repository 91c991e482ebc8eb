"""The training process (one per rank): `python -m trainer CONFIG [key=value ...]`, alone or under
torchrun or `python -m launch`. Grouped by job; each package's own docstring is its index.

    __main__        the command line: errors -> exit codes (trainer.runtime.protocol)
    loop            train(): build -> resume -> while: train_step -> after_step -> finish
    run             Run (built once), Progress (changes per step), Meters (per attempt); build()
    resume          the start state, from the memory tier or the durable tier; the meters
    records         the metrics records: exchanged between ranks, written by rank 0, straggler verdicts
    step            one optimizer step, checked (health/) -> StepResult; the non-finite guard
    optim           AdamW and the learning-rate schedule
    evaluate        the held-out loss and when it is due
    config/         the run configuration: each key declared once, loaded, validated; resume rules
    model/          the Llama-style transformer and its fused loss (pure PyTorch); Hugging Face weights
    distributed/    process groups, FSDP2, mixed precision, compile, activation checkpointing
    checkpoint/     sharded checkpoints (format, commit, checkpointer) and the memory tier
    observability/  metrics, MFU, progress, TensorBoard / W&B, stragglers, profiling, cost, logging
    runtime/        the contract with the launcher (protocol), preemption and faults, leases, scratch dirs
    recovery/       in-process recovery: leave the failed generation, re-form the groups, restore, go on
    health/         faults that crash nothing: anomalous steps replayed, data skipped, corruption named
    contract        all that launch/ imports from the trainer
    export, plot    commands: `python -m trainer.export` (safetensors, Hugging Face), `python -m trainer.plot`
What data/ and launch/ share with the trainer (storage, processes, exit codes, timings) is in common/.
"""
