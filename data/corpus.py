"""The built-in corpus: the Python standard library's own source files, tokenized once into a
cache directory and reused. Nothing is downloaded; every Python installation carries this text."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import sys
import sysconfig
from pathlib import Path

from data import tokenizer as tokenizers_
from data.prepare import prepare
from data.shards import MANIFEST

log = logging.getLogger("rekindle.data")

CORPUS_VERSION = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("REKINDLE_CACHE") or Path.home() / ".cache" / "rekindle")


def source_files(max_bytes: int, root: Path | None = None) -> list[Path]:
    """Stdlib .py files (tests and site-packages excluded) in a fixed shuffled order, up to max_bytes.

    root: the standard library's directory (default: this interpreter's); only the path below it is
    looked at for the exclusions (Python may live under e.g. /home/tester)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])

    def excluded(name: str) -> bool:  # a directory or file below root
        return name == "site-packages" or name.startswith(("test", "idle_test"))

    found = []  # os.walk, skipping the excluded trees: the tests are most of the stdlib, and rglob walks them
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not excluded(d)]
        found += [Path(directory, n) for n in names if n.endswith(".py") and not excluded(n)]
    return shuffled_up_to(found, max_bytes)


def shuffled_up_to(files: list[Path], max_bytes: int) -> list[Path]:
    """`files` in a fixed shuffled order (packages mixed, so the held-out tail resembles the rest), the
    first of them until they hold max_bytes."""
    files = sorted(files)
    random.Random(0).shuffle(files)
    chosen, total = [], 0
    for p in files:
        if total >= max_bytes:
            break
        chosen.append(p)
        total += p.stat().st_size
    return chosen


def read_source(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def ensure_builtin(vocab_size: int, megabytes: float, cache_dir: str | Path | None = None,
                   progress: bool = True) -> Path:
    """Return the directory of the prepared built-in corpus, building it on first use.

    Safe to call from many processes at once: one builds under a file lock, the others wait and reuse it.
    """
    files = source_files(int(megabytes * 1e6))
    if not files:
        raise RuntimeError(f"no Python standard library sources found under {sysconfig.get_paths()['stdlib']}")
    key = json.dumps([CORPUS_VERSION, sys.version_info[:2], vocab_size,
                      [(p.name, p.stat().st_size) for p in files]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir or default_cache_dir())
    out = root / f"builtin-v{vocab_size}-{digest}"
    if (out / MANIFEST).exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (out / MANIFEST).exists():
            return out
        if progress:
            log.info("building the built-in corpus: %d stdlib files -> %s", len(files), out)
        tok = tokenizers_.train((read_source(p) for p in files), vocab_size)
        prepare((read_source(p) for p in files), str(out), tok, progress=progress, total_docs=len(files))
    return out
