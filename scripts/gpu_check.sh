#!/usr/bin/env bash
# GPU check, at most 8 minutes on one GPU: NCCL process group, bf16 mixed precision, per-block
# compile and fused AdamW on the Llama-1B-shaped model (configs/llama-1b.yaml) on the built-in
# corpus; prints the matmul peak, tokens/s, MFU and peak memory, and the date and GPU to record.
# With 2 GPUs or more, then in-process recovery with NCCL (scripts/gpu_inprocess_check.py: a rank
# SIGKILLed, the others keep their processes; at most 4 minutes); with one GPU it says it was skipped.
#
#   bash scripts/gpu_check.sh [key=value ...]          # e.g. train.micro_batch=8 on a 141 GB H200
#   CONFIG=configs/gpt2-124m.yaml STEPS=300 bash scripts/gpu_check.sh
#
# Python: $PYTHON (default python3) when it already has torch with CUDA (a GPU image), else
# scripts/setup.sh makes .venv. Missing dependencies (omegaconf, tokenizers, tqdm, numpy, fsspec,
# xxhash) are installed from ./wheels when that folder exists, else from the package index. An
# offline machine (our H200 image has no omegaconf): fill ./wheels on a connected one with
# `bash scripts/fetch_wheels.sh 3.12` and carry it along.
#
# The summary line is printed from metrics.jsonl even when the run fails or hits the time limit;
# the exit status is the trainer's (124: the limit).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
CONFIG="${CONFIG:-configs/llama-1b.yaml}"
STEPS="${STEPS:-120}"
if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "[gpu_check] $PY has no CUDA torch: setting up .venv"
  bash scripts/setup.sh
  PY=.venv/bin/python
fi
missing=$("$PY" - <<'PY'
import importlib.util
need = {"omegaconf": "omegaconf", "tokenizers": "tokenizers", "tqdm": "tqdm", "numpy": "numpy", "fsspec": "fsspec",
        "xxhash": "xxhash"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -d wheels ]; then
    echo "[gpu_check] installing $missing from ./wheels"
    "$PY" -m pip install --quiet --no-index --find-links wheels $missing
  else
    echo "[gpu_check] installing $missing from the package index"
    "$PY" -m pip install --quiet $missing
  fi
fi
NGPU="${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
"$PY" - <<'PY'
import datetime, torch
from trainer.observability.metrics import measure_matmul_peak
name = torch.cuda.get_device_name(0)
peak = measure_matmul_peak(1.0, 8192, torch.bfloat16, device="cuda")
print(f"gpu_check: {datetime.date.today()} | {name} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} | measured bf16 matmul {peak / 1e12:.0f} TFLOP/s")
PY
RUN_DIR="${RUN_DIR:-runs/gpu-check}"
rm -rf "$RUN_DIR"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# The config's global batch is per GPU here, so more GPUs mean proportionally more tokens per step.
GLOBAL=$("$PY" -c "from trainer.config import load; print(load('$CONFIG').train.global_batch)")
rc=0
timeout --kill-after=30 480 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" --rdzv-backend c10d \
  --rdzv-endpoint "127.0.0.1:$PORT" -m trainer "$CONFIG" \
  run.dir="$RUN_DIR" dist.backend=nccl dist.mixed_precision=bf16 dist.compile=true dist.fused_adamw=fused \
  train.steps="$STEPS" train.warmup_steps=20 train.global_batch=$((GLOBAL * NGPU)) \
  train.eval_every=0 train.eval_batches=2 train.log_every=10 checkpoint.every=0 checkpoint.resume=never \
  log.progress=false "$@" || rc=$?
[ "$rc" -eq 0 ] || echo "[gpu_check] the trainer exited with $rc (124: the 480 s limit)"
[ -s "$RUN_DIR/metrics.jsonl" ] || { echo "[gpu_check] no metrics were written"; exit "$((rc ? rc : 1))"; }
"$PY" - "$RUN_DIR" <<'PY'
import json, statistics, sys
records = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
steady = records[2:-1] or records  # drop compile/warm-up windows and the final (eval + checkpoint) one
mfu = statistics.median(r["mfu"] for r in steady)
print(f"gpu_check: final loss {records[-1]['loss']:.3f}, eval {records[-1].get('eval_loss', float('nan')):.3f} | "
      f"median {statistics.median(r['tokens_per_s'] for r in steady):,.0f} tok/s, MFU {100 * mfu:.1f}% "
      f"(vs nominal dense bf16 peak; goal >= 45%) | step {statistics.median(r['step_time_s'] for r in steady):.3f}s "
      f"= fwd/bwd {statistics.median(r['fwd_bwd_s'] for r in steady):.3f} + optim "
      f"{statistics.median(r['optim_s'] for r in steady):.3f} + data {statistics.median(r['data_wait_s'] for r in steady):.3f}"
      f" | peak mem {records[-1]['mem_mb']:,.0f} MB")
PY
# In-process recovery with NCCL: the communicators aborted and formed again (needs 2 GPUs or more).
irc=0
timeout --kill-after=30 240 "$PY" scripts/gpu_inprocess_check.py --gpus "$NGPU" || irc=$?
[ "$irc" -eq 2 ] && irc=0  # fewer than 2 GPUs: skipped, and said
[ "$rc" -ne 0 ] || rc=$irc
exit "$rc"
