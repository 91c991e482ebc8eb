#!/usr/bin/env bash
# Wheels of rekindle's runtime dependencies (all but torch) for an offline machine whose image has
# torch with CUDA but not all of these: the H200 image of our device machines has no omegaconf, and
# nothing can be fetched there. Run this on a connected machine; `scripts/gpu_check.sh` then installs
# what its Python lacks from ./wheels (git-ignored: carry the folder along with the checkout).
#
#   bash scripts/fetch_wheels.sh [PYTHON_VERSION]     # default 3.12 (the H200 image's python3)
#
# Versions are the ones installed in .venv (the tested set) when it exists, else the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
PACKAGES="omegaconf PyYAML tqdm fsspec xxhash tokenizers numpy"  # omegaconf 2.4 vendors its antlr4 runtime
SPECS=$("$PY" - $PACKAGES <<'PY'
import importlib.metadata as md
import sys
out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        out.append(name)
print(" ".join(out))
PY
)
mkdir -p wheels
echo "[fetch_wheels] for Python $PYV (manylinux x86_64): $SPECS"
# --no-deps: exactly this list (their own dependencies are in it or on any PyTorch image)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest wheels --python-version "$PYV" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 $SPECS
ls -1 wheels
du -sh wheels
