"""Host tensors on 2 MB pages, for the memory the decode kernels stream every step.

Decode reads every weight panel and the requests' KV blocks once per step. On 4 KB pages each
new page costs a TLB miss (the panels of SmolLM2's layers span 100,000 pages, the KV pool
millions) and the hardware prefetcher starts over at every page boundary. Anonymous memory
marked MADV_HUGEPAGE is backed by the kernel's transparent huge pages where it has them
(`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise` or `always`). Same process,
huge pages against 4 KB copies: SmolLM2's 121 linears at M = 1 25.5 -> 20.8 ms (best of 9, in
a slow hour of the machine); decode attention over 30 layers' scattered KV blocks, 12 requests
of 100-768 tokens 21.2 -> 16.1 ms (best of 7).

Weights go through `to_huge_pages`, which packs them one after another into shared huge-page
chunks: most of SmolLM2's packed weights are under 2 MB each (a layer's Q4_1 panels 0.2-1.1
MB), and a mapping of its own that size gets no huge page at all. On this VM memory on 4 KB
pages also costs more the longer it sat untouched: reading 200 MB took ~10 ms back to back and
85-108 ms after one second away (huge pages: 7 and 20 ms), so every step after a pause or a
long prefill paid it for the weights.

Where the kernel has none, or on other platforms, these are plain tensors. The contents are
what torch.empty would give: callers zero or copy into them.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 * 1024 * 1024
_CHUNK = 32 * HUGE_PAGE    # the shared chunks weights are packed into
_ALIGN = 4096              # each weight starts on a page of its own


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor starting on a 2 MB boundary of memory advised for huge
    pages; a plain torch.empty below one huge page or where madvise cannot ask for them."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not huge_pages_supported():
        return torch.empty(shape, dtype=dtype)
    # A fresh private mapping (not malloc's heap, whose pages may already be faulted in as
    # 4 KB; not mmap's default shared one, which is shmem and takes no transparent huge pages),
    # one huge page longer so an aligned start fits; the tensor's storage keeps it mapped.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:   # a kernel without transparent huge pages: 4 KB pages, same contents
        pass
    return raw[start:start + nbytes].view(dtype).view(tuple(shape))


class _Chunks:
    """Bump allocation from huge-page chunks, for tensors that live as long as the model: a
    chunk is unmapped when the last tensor in it is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None   # uint8, the chunk being filled
        self._used = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > _CHUNK // 4:   # big enough for pages of its own
            return huge_page_empty(shape, dtype)
        with self._lock:
            start = -(-self._used // _ALIGN) * _ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = huge_page_empty((_CHUNK,), torch.uint8), 0
            self._used = start + nbytes
            raw = self._chunk[start:start + nbytes]
        return raw.view(dtype).view(tuple(shape))


_chunks = _Chunks()


def to_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor on huge pages, for a weight kept as long as the model
    (it shares a chunk with others: the whole chunk stays mapped while any of them lives)."""
    if not huge_pages_supported():
        return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    return _chunks.take(tensor.shape, tensor.dtype).copy_(tensor)
