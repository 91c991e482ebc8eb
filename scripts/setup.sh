#!/usr/bin/env bash
# Creates .venv and installs rekindle with its dev tools. Idempotent: a second run only checks.
# On machines without a GPU, torch is pinned to the CPU build 2.13.0, so the installer never reaches
# for a multi-GB CUDA build. Set REKINDLE_TORCH to override the torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${REKINDLE_VENV:-.venv}"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "rekindle needs Python >= 3.10 (found: $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.rekindle-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ -n "${REKINDLE_TORCH:-}" ]; then
  torch_req="$REKINDLE_TORCH"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_req="torch>=2.13"        # GPU machine: the default (CUDA) build
else
  torch_req="torch==2.13.0"      # CPU machine: the CPU build
fi
pip_setting() { "$VENV/bin/python" -m pip config get "global.$1" 2>/dev/null || true; }

# uv installs the same packages as pip (the same versions here) in seconds rather than a minute and a
# half; it is given pip's settings (local wheels, index, constraints). pip itself when uv cannot.
install() {
  if "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check uv 2>/dev/null; then
    local args=() link index constraint
    for link in ${PIP_FIND_LINKS:-$(pip_setting find-links)}; do args+=(--find-links "$link"); done
    index="${PIP_INDEX_URL:-$(pip_setting index-url)}"
    [ -n "$index" ] && args+=(--index-url "$index")
    constraint="${PIP_CONSTRAINT:-$(pip_setting constraint)}"
    [ -n "$constraint" ] && args+=(--constraint "$constraint")
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" "${args[@]}" "$@" && return 0
    echo "[setup] uv could not install; pip instead"
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

echo "[setup] installing $torch_req and rekindle[dev] into $VENV"
install "$torch_req" -e '.[dev]'
# uv writes no .pyc files (pip compiles all of them, at length). Where PYTHONDONTWRITEBYTECODE is set, a
# module without one is compiled again by every process that imports it, torch included: so import what
# a rank imports once here, writing the .pyc files of just those modules.
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -c "import trainer.loop, trainer.export, launch.supervisor, data.prepare"
echo "$want" > "$stamp"
