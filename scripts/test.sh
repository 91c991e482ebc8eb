#!/usr/bin/env bash
# The test suite: set up .venv (first time only), lint, then run every test (CPU, gloo, real
# processes, a loopback S3 server). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check trainer data launch scripts tests
exec .venv/bin/python -m pytest "$@"
