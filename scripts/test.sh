#!/usr/bin/env bash
# The test suite: set up .venv (first time only), lint, then run every test (CPU, gloo, real
# processes, a loopback S3 server) in $REKINDLE_TEST_WORKERS pytest workers (default 2; one test
# file per worker at a time, so module fixtures are built once). Extra arguments go to pytest.
# pytest's output is also kept in reports/test-output.txt, and its report of the 15 slowest tests
# in reports/test-durations.txt (reports/ is git-ignored); the exit code is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check common trainer data launch scripts tests
# The many processes the tests start write the .pyc files they lack, so that each module is compiled
# once, not by each of them (where PYTHONDONTWRITEBYTECODE is set: these machines set it).
export PYTHONDONTWRITEBYTECODE=
mkdir -p reports
color=no
[ -t 1 ] && color=yes  # through tee pytest sees no terminal: colours on a terminal, stripped in the files
status=0
.venv/bin/python -m pytest -n "${REKINDLE_TEST_WORKERS:-2}" --dist loadfile --durations=15 --color="$color" "$@" \
    2>&1 | tee reports/test-output.txt || status=$?
sed -i 's/\x1b\[[0-9;]*m//g' reports/test-output.txt
# The "slowest 15 durations" section: from its header to the next section's.
awk '/^=+ slowest .*durations =+$/ {on = 1; print; next} on && /^=/ {exit} on' reports/test-output.txt \
    > reports/test-durations.txt
exit "$status"
