#!/usr/bin/env bash
# The demo: set up .venv (first time only), then train the CPU demo model on the built-in corpus.
# Extra arguments are config overrides, e.g. `bash scripts/demo.sh train.steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONDONTWRITEBYTECODE=  # a module is compiled once, not at every start (see scripts/test.sh)
exec .venv/bin/python -m trainer configs/default.yaml "$@"
