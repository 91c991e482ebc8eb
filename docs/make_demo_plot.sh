#!/usr/bin/env bash
# Makes docs/demo-run.png: the CPU demo model (configs/default.yaml, shortened to 150 steps) on 2
# ranks under the launcher, with two real faults: rank 1 hangs at step 60 (REKINDLE_HANG_AT; the
# watchdog kills the group) and a rank is SIGKILLed once step 110 is logged. The launcher writes
# events.jsonl; `python -m trainer.plot` draws it with metrics.jsonl. About 5 minutes on 2 cores.
#
#   bash docs/make_demo_plot.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-${PYTHON:-.venv/bin/python}}"
RUN=runs/demo-faults
rm -rf "$RUN"
mkdir -p runs
REKINDLE_HANG_AT=60:1 OMP_NUM_THREADS=1 "$PY" -m launch --nproc-per-node 2 configs/default.yaml \
  run.dir="$RUN" train.steps=150 train.eval_every=50 checkpoint.every=25 fault.hang_timeout_s=15 \
  log.progress=false log.tensorboard=true > "$RUN.log" 2>&1 &
launcher=$!
# wait for step 110 to be logged, then SIGKILL one trainer process (a child of the launcher)
for _ in $(seq 1 1200); do
  if [ -f "$RUN/metrics.jsonl" ] && grep -q '"step": 110,' "$RUN/metrics.jsonl"; then
    victim=$(pgrep -P "$launcher" -f "trainer" | tail -1 || true)
    [ -n "$victim" ] && kill -9 "$victim" && echo "SIGKILLed trainer pid $victim after step 110"
    break
  fi
  sleep 0.5
done
wait "$launcher"
"$PY" -m trainer.plot "$RUN" -o docs/demo-run.png
tail -5 "$RUN.log"
