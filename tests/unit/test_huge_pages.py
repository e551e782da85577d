"""kernels/huge_pages: tensors on memory advised for 2 MB pages, as the gemv weight panels and
the CPU KV cache are allocated."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.helpers.memory_maps import mapping_of, on_huge_page_memory, thp_enabled
from tokenmill.kernels.huge_pages import (HUGE_PAGE, huge_page_empty, huge_pages_supported,
                                          to_huge_pages)
from tokenmill.worker.model_runner import ModelRunner


@pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE on this platform")
def test_large_tensor_starts_on_a_huge_page_of_an_advised_mapping():
    tensor = huge_page_empty((3, 1024, 1024), torch.float32)   # 12 MB
    assert tensor.shape == (3, 1024, 1024) and tensor.dtype == torch.float32
    assert tensor.is_contiguous() and tensor.data_ptr() % HUGE_PAGE == 0
    tensor.fill_(1.5)
    if thp_enabled():
        smaps = mapping_of(tensor.data_ptr())
        assert smaps.get("THPeligible") == "1", smaps


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3000), cols=st.integers(1, 600),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       transpose=st.booleans(), seed=st.integers(0, 2**16))
def test_copy_is_exact_and_outlives_its_source(rows, cols, dtype, transpose, seed):
    gen = torch.Generator().manual_seed(seed)
    source = (torch.randn(rows, cols, generator=gen) * 100).to(dtype)
    if transpose:
        source = source.t()                       # a non-contiguous source
    copy = to_huge_pages(source)
    expected = source.clone()
    del source
    gc.collect()                                  # the mapping lives as long as the tensor
    assert copy.is_contiguous() and copy.dtype == dtype
    assert torch.equal(copy, expected)
    copy.add_(1)                                  # writable
    assert torch.equal(copy, expected + 1)


@pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE on this platform")
@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 3_000_000), min_size=1, max_size=12))
def test_small_weights_share_huge_page_memory_without_overlap(sizes):
    """Weights under a huge page each (a layer's Q4_1 panels) get one too: they are packed
    side by side in shared advised chunks, each on a page of its own, and each keeps its
    values while the others are written."""
    sources = [torch.full((n,), float(i), dtype=torch.float32) for i, n in enumerate(sizes)]
    copies = [to_huge_pages(s) for s in sources]
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * 4) for c in copies)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for i, copy in enumerate(copies):
        assert copy.data_ptr() % 4096 == 0 and torch.equal(copy, sources[i])
        if thp_enabled():
            assert on_huge_page_memory(copy)


@pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE on this platform")
def test_cpu_kv_cache_is_zeroed_and_on_huge_pages():
    spec = SimpleNamespace(num_kv_heads=3, head_dim=64, num_layers=2)
    runner = ModelRunner(None, spec, 16, torch.device("cpu"), torch.float32, frozenset())
    runner.allocate_kv_cache(300)                 # 3.5 MB per cache
    assert len(runner.kv_caches) == 2
    for cache in (c for pair in runner.kv_caches for c in pair):
        assert cache.shape == (300, 16, 3, 64) and cache.dtype == torch.float32
        assert cache.data_ptr() % HUGE_PAGE == 0 and not cache.any()
