"""Keep freed host memory for reuse instead of handing it back to the kernel.

Every forward allocates the same large temporaries (GEMM outputs, gathered KV blocks). glibc
serves allocations above its mmap threshold with fresh mmaps, and first touch of each page
faults; in a VM that cost more than the arithmetic (a batch-32 decode step spent more than half
its time there). So malloc never maps (M_MMAP_MAX 0) and trims only a free top above 2 GB:
those buffers come from, and go back to, the heap, which grows to the largest working set and
keeps it, and later steps reuse warm pages. vLLM's CPU docs reach the same end with tcmalloc via LD_PRELOAD;
mallopt does it in-process for any entry point.

Every thread shares the main heap (M_ARENA_MAX 1). Raising the mmap threshold instead (to
glibc's cap, 32 MB) had left bigger buffers mapped afresh whenever the free heap lacked room,
and a thread's own arena, grown in 64 MB heaps, rarely had it: the server's engine thread
mmapped a 3000-token prompt's MLP output (36.9 MB) in every layer, 9,000 page faults a layer,
0.1-0.15 s a prompt, in some server processes and not others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2 ** 31 - 1            # an int: mallopt takes a C int
_TOP_PAD = 64 * 1024 * 1024

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; returns False where there is no glibc. Call it
    before starting threads that allocate: a thread keeps the arena of its first malloc."""
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
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_TOP_PAD, _TOP_PAD),
        (_M_ARENA_MAX, 1)))
    _done = ok
    return ok
