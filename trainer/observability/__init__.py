"""What a run says about itself.

    metrics       step timing and its breakdown, MFU, metrics.jsonl, TensorBoard
    display       the progress bar (or a printed line per logged record) on rank 0
    stragglers    per-rank work scores and the straggler verdicts
    wandb_log     the same scalars in Weights & Biases (optional)
    profiling     torch.profiler over chosen steps
    cost          device-hours and money per run and per token
    startup       start-up measurements kept across restarts (the matmul peak)
    logs          the one logging set-up: `[rekindle]` lines, rank-aware
"""
