"""CPU paged attention: C++ kernels reading K/V in place through the block tables.

The reference backend gathers every decode's blocks into a padded copy per layer; with many
requests over a shared prefix that copy dominates the step. The decode kernel reads each block
where it lives (shared blocks stay in L2/L3), so decodes cost their arithmetic only. The
prefill kernel does the same for the causal attention of every chunk of a step, in one call,
without the gathered copy and the mask that SDPA needs once part of the context is cached. Sliding
windows and any non-fp32 or non-CPU input keep the reference path, which is also the test
oracle.

The kernel compiles on first use (torch.utils.cpp_extension, cached in the torch extensions
directory); without a working compiler `load_kernel()` returns None after one warning.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.kernels.cpp_build import AVX2_MATH, ENTRY_POINTS, WORK_SHARING, CpuExtension

# The kernel's parts, put in front of cpu_paged_kernel.cpp in this order (each uses the ones
# before it): the online softmax, a decode one request at a time, the row tiles, rows in lanes.
PARTS = tuple(Path(__file__).with_name(part) for part in (
    "paged_softmax.h", "paged_decode_rows.h", "paged_row_tiles.h", "paged_shared_lanes.h"))
KERNEL = CpuExtension("tokenmill_cpu_paged", Path(__file__).with_name("cpu_paged_kernel.cpp"),
                      ["paged_decode_attention", "paged_prefill_attention", "write_kv_slots",
                       "paged_attention_has_avx512", "paged_attention_use_avx512",
                       "entry_points"],
                      "cpu_paged attention kernel", "the torch reference backend",
                      headers=(AVX2_MATH, ENTRY_POINTS, WORK_SHARING, *PARTS))
load_kernel = KERNEL.load
# A chunk with nothing cached before it needs no gathered copy or mask: SDPA's causal flash
# kernel skips the masked blocks, and on an AVX2 machine from about 2048 tokens (the one-step
# long prompts) it beat the paged kernel with AVX2 tiles (30 layers, 3000 tokens: 3.26
# against 3.83 s; 1024: 0.46 against 0.39 s, 512: 0.16 against 0.10 s). With AVX-512 tiles
# the kernel is faster at every length (2-core Xeon, 3000 tokens: 1.48 against 1.63 s; 2048:
# 0.65 against 0.83 s), so there it takes them all.
SDPA_MIN_UNCACHED = 2048


def sdpa_min_uncached(kernel) -> int | None:
    """The shortest uncached chunk that SDPA takes instead of the kernel (None: none)."""
    return None if kernel is not None and kernel.paged_attention_has_avx512() else SDPA_MIN_UNCACHED


def _heads_contiguous(rows: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads in one contiguous run."""
    return rows.stride(-1) == 1 and rows.stride(-2) == rows.shape[-1]


class CpuPagedBackend(TorchReferenceBackend):
    """Reference backend whose fp32 CPU decodes run the paged C++ kernel."""

    name = "cpu_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernel = load_kernel()
        self.sdpa_from = sdpa_min_uncached(self.kernel)

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """A row copy a token in C++: index_copy_ took 3-6.5% of a prefill step; in one
        process, alternate prefills of 16 / 128 / 512 tokens 24.6 -> 23.5, 92.0 -> 88.3 and
        346.1 -> 346.9 ms."""
        if (self.kernel is not None and key.dtype == value.dtype == k_cache.dtype == torch.float32
                and k_cache.device.type == "cpu" and _heads_contiguous(key)
                and _heads_contiguous(value)):
            self.kernel.write_kv_slots(key, value, k_cache, v_cache, slot_mapping)
        else:
            super()._write_kv(key, value, k_cache, v_cache, slot_mapping)

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """query: [num_decodes, heads, head_dim] -> same shape."""
        if (self.kernel is None or query.dtype != torch.float32 or k_cache.dtype != torch.float32
                or query.device.type != "cpu"):
            return super()._decode(query, k_cache, v_cache, meta)
        query = query.contiguous()
        out = torch.empty_like(query)
        window = -1 if meta.sliding_window is None else meta.sliding_window
        self.kernel.paged_decode_attention(out, query, k_cache, v_cache,
                                           meta.decode_block_table, meta.decode_seq_lens,
                                           self.scale, window)
        return out

    def _prefills(self, query, key, value, k_cache, v_cache, meta, out) -> None:
        """All of the step's chunks in one kernel call (items across requests, one fork), each
        causal over its context read in place (no gathered copy, no mask tensor)."""
        if self._kernel_takes(query, k_cache, meta.sliding_window) and not any(
                self.sdpa_takes(span) for span in meta.prefills):
            spans, tables = meta.packed_prefills
            if self.kernel.paged_prefill_attention(out, query, k_cache, v_cache, spans, tables,
                                                   self.scale):
                return
        super()._prefills(query, key, value, k_cache, v_cache, meta, out)

    def _prefill(self, query, key, value, k_cache, v_cache, span, window) -> torch.Tensor:
        """query: [query_len, heads, head_dim] of one chunk -> same shape."""
        if self._kernel_takes(query, k_cache, window) and not self.sdpa_takes(span):
            out = torch.empty_like(query)
            spans = torch.tensor([[0, span.query_len, span.seq_len, 0]])
            if self.kernel.paged_prefill_attention(out, query, k_cache, v_cache, spans,
                                                   span.block_table, self.scale):
                return out
        return super()._prefill(query, key, value, k_cache, v_cache, span, window)

    def _kernel_takes(self, query: torch.Tensor, k_cache: torch.Tensor,
                      window: int | None) -> bool:
        return (self.kernel is not None and window is None and query.dtype == torch.float32
                and k_cache.dtype == torch.float32 and query.device.type == "cpu")

    def sdpa_takes(self, span) -> bool:
        """A long chunk with nothing cached before it, where SDPA is the faster path."""
        return self.sdpa_from is not None and span.seq_len == span.query_len >= self.sdpa_from
