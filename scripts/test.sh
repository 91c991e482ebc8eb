#!/usr/bin/env bash
# The test suite: set up .venv (first time only), lint, then run every test (CPU, gloo, real
# processes, a loopback S3 server) in $REKINDLE_TEST_WORKERS pytest workers (default 2; one test
# file per worker at a time, so module fixtures are built once). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check trainer data launch scripts tests
# The many processes the tests start write the .pyc files they lack, so that each module is compiled
# once, not by each of them (where PYTHONDONTWRITEBYTECODE is set: these machines set it).
export PYTHONDONTWRITEBYTECODE=
exec .venv/bin/python -m pytest -n "${REKINDLE_TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
