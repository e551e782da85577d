"""Keep freed host memory for reuse instead of handing it back to the kernel.

Every forward allocates the same large temporaries (GEMM outputs, gathered KV blocks). glibc
serves allocations above its mmap threshold with fresh mmaps, and first touch of each page
faults; in a VM that cost more than the arithmetic (a batch-32 decode step spent more than half
its time there). So malloc never maps (M_MMAP_MAX 0) and trims only a free top above 2 GB:
those buffers come from, and go back to, the heap, which grows to the largest working set and
keeps it, and later steps reuse warm pages. vLLM's CPU docs reach the same end with tcmalloc
via LD_PRELOAD; mallopt does it in-process for any entry point.

The one time freed memory should go back is after loading: the loader's fp32 weights (540 MB
for SmolLM2-135M) are freed once packed into panels and tiles, and a heap that keeps
everything would hold them for the process's life, and count them against the memory the KV
cache is sized from (release_freed_memory).

Every thread shares the main heap (M_ARENA_MAX 1). Raising the mmap threshold instead (to
glibc's cap, 32 MB) had left bigger buffers mapped afresh whenever the free heap lacked room,
and a thread's own arena, grown in 64 MB heaps, rarely had it: the server's engine thread
mmapped a 3000-token prompt's MLP output (36.9 MB) in every layer, 9,000 page faults a layer,
0.1-0.15 s a prompt, in some server processes and not others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2 ** 31 - 1            # an int: mallopt takes a C int
_TOP_PAD = 64 * 1024 * 1024

_done = False


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; returns False where there is no glibc. Call it
    before starting threads that allocate: a thread keeps the arena of its first malloc."""
    global _done
    if _done:
        return True
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        logger.info("no glibc mallopt here: host allocations keep the platform default")
        return False
    ok = all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_TOP_PAD, _TOP_PAD),
        (_M_ARENA_MAX, 1)))
    _done = ok
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc malloc_trim), after collecting
    Python's garbage so that unreachable buffers are freed first. For after loading, before
    sizing the KV cache; returns False where there is no glibc."""
    gc.collect()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
