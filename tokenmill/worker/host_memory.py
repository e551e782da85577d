"""Keep freed host memory for reuse instead of handing it back to the kernel.

Every forward allocates the same large temporaries (GEMM outputs, gathered KV blocks). glibc
serves allocations above its mmap threshold with fresh mmaps, and first touch of each page
faults; in a VM that cost more than the arithmetic (a batch-32 decode step spent more than half
its time there). Raising the mmap and trim thresholds makes those buffers come from, and go
back to, the heap, so later steps reuse warm pages. vLLM's CPU docs reach the same end with
tcmalloc via LD_PRELOAD; mallopt does it in-process for any entry point.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024   # glibc caps the threshold here on 64-bit
_TRIM_THRESHOLD = 2 ** 31 - 1            # an int: mallopt takes a C int
_TOP_PAD = 64 * 1024 * 1024

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; returns False where there is no glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.info("no glibc mallopt here: host allocations keep the platform default")
        return False
    ok = all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        (_M_TOP_PAD, _TOP_PAD)))
    _done = ok
    return ok
