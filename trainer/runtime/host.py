"""Host (CPU-side) process settings that change training speed: the glibc allocator and transparent
huge pages for its heap.

Why: a training step allocates and frees the same large activation buffers every step. glibc serves
blocks above its mmap threshold (at most 32 MiB) with fresh `mmap`s and returns them on free, so
every step first-touches, page-faults and zeroes them again; on a virtual machine each fault is
expensive. Keeping freed memory in the heap (no mmap for large blocks, no trimming) removes those
faults; the price is that the process keeps its peak heap until it exits, which a trainer does
anyway. The gain grows with the size of a step's activations: the fused loss (`trainer/model/loss.py`)
does not materialise the default model's full logits, so that model gains little from either setting, while
models with larger activations still do (docs/performance.md,
"Design choices": malloc tuning).

Huge pages: with the above, every buffer of a step lives in the heap, mapped in 4 KiB pages; the
matmuls and element-wise kernels that stream through several MiB of activations miss the TLB often.
After the first step (when the heap has grown to its steady size) `huge_pages_for_heap()` asks the
kernel to back the heap with 2 MiB transparent huge pages (`madvise(MADV_HUGEPAGE)`, then
`MADV_COLLAPSE` to convert what is already mapped, Linux 6.1+): fewer TLB misses in every later
step, for a collapse that is paid once (docs/performance.md, "Design choices": malloc tuning), at a
launcher's first start only: after a restart it would add to every recovery (trainer.loop). Where
THP is off (`never`) or the kernel is older, the calls fail and nothing changes. The same effect as
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in the launch environment, from inside the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def tune_malloc() -> bool:
    """Tell glibc malloc to keep large freed blocks (no mmap, no trim). Returns False where there is no
    glibc (other libcs, macOS) or the call fails; then nothing changes."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the largest int threshold (2 GiB - 1) means "never trim".
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def huge_pages_for_heap() -> int:
    """Back the process heap ([heap] in /proc/self/maps) with transparent huge pages, converting what
    is already mapped. Returns the bytes advised; 0 where there is no heap, no glibc or no THP."""
    libc = _libc()
    madvise = getattr(libc, "madvise", None)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return 0
    heap = next((line.split()[0] for line in maps.splitlines() if line.endswith("[heap]")), None)
    if madvise is None or heap is None:
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    start, end = (int(x, 16) for x in heap.split("-"))
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE  # whole huge pages inside
    if hi <= lo or madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
        return 0
    madvise(lo, hi - lo, MADV_COLLAPSE)  # best effort: without it, only new pages of the range are huge
    return hi - lo
