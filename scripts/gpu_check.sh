#!/usr/bin/env bash
# GPU check, at most ~5 minutes on one GPU: NCCL process group, bf16 mixed precision, per-block
# compile, a few hundred steps of the GPT-2-124M-shaped model on the built-in corpus; MFU printed.
#
#   bash scripts/gpu_check.sh [key=value ...]
#
# Uses $PYTHON (default: python3) when it already has torch with CUDA (e.g. a GPU image), else
# sets up .venv. On an offline GPU machine without omegaconf, put wheels in ./wheels first
# (`pip download omegaconf -d wheels` on a connected machine); they are installed from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  bash scripts/setup.sh
  PY=.venv/bin/python
fi
if ! "$PY" -c 'import omegaconf' 2>/dev/null && [ -d wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links wheels omegaconf
fi
NGPU="${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
"$PY" -c 'import torch; print("torch", torch.__version__, "| GPU:", torch.cuda.get_device_name(0), "| NCCL", torch.cuda.nccl.version())'
RUN_DIR="${RUN_DIR:-runs/gpu-check}"
rm -rf "$RUN_DIR"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
timeout 480 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" --rdzv-backend c10d \
  --rdzv-endpoint "127.0.0.1:$PORT" -m trainer configs/gpt2-124m.yaml \
  run.dir="$RUN_DIR" dist.backend=nccl dist.mixed_precision=bf16 dist.compile=true \
  train.steps=300 train.warmup_steps=30 train.global_batch=$((32 * NGPU)) train.micro_batch=32 \
  train.eval_every=0 train.log_every=25 checkpoint.every=0 checkpoint.resume=never log.progress=false "$@"
"$PY" - "$RUN_DIR" <<'PY'
import json, statistics, sys
records = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
steady = records[2:-1] or records
print(f"gpu_check: final loss {records[-1]['loss']:.3f}, eval {records[-1].get('eval_loss', float('nan')):.3f} | "
      f"median {statistics.median(r['tokens_per_s'] for r in steady):,.0f} tok/s, "
      f"MFU {100 * statistics.median(r['mfu'] for r in steady):.1f}% | peak mem {records[-1]['mem_mb']:,.0f} MB")
PY
