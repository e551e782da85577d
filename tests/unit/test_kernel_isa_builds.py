"""The kernels built as an older CPU would build them (-march=native minus AVX-512, minus AVX2
as well): they must still compile, and give what this machine's build gives. An AVX-512 path
that leaks a name into the common code otherwise only breaks on the other machine, where the
kernel silently falls back to the reference path."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tokenmill.attention.cpu_paged as cpu_paged
import tokenmill.layers.cpu_amx as cpu_amx
import tokenmill.layers.cpu_gemv as cpu_gemv
from tokenmill.kernels.cpp_build import CpuExtension, compile_cpu_extension

pytestmark = pytest.mark.skipif(
    cpu_paged.load_kernel() is None or cpu_gemv.load_kernel() is None,
    reason="no C++ compiler for the kernels")

WITHOUT = {"avx2": ("-mno-avx512f", "-mno-amx-tile"),
           "sse": ("-mno-avx512f", "-mno-amx-tile", "-mno-avx2", "-mno-fma")}


def build(kernel: CpuExtension, isa: str):
    return compile_cpu_extension(f"{kernel.prefix}_{isa}", kernel.source, kernel.functions,
                                 kernel.name, kernel.fallback,
                                 kernel.extra_cflags + WITHOUT[isa], kernel.headers,
                                 kernel.keep_gil)


@pytest.fixture(scope="module")
def builds():
    """Every (kernel, isa) build, compiled side by side (one compiler per core)."""
    wanted = [(kernel, isa) for isa in WITHOUT
              for kernel in (cpu_gemv.KERNEL, cpu_paged.KERNEL, cpu_amx.KERNEL)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        modules = list(pool.map(lambda item: build(*item), wanted))
    return {(kernel.prefix, isa): module for (kernel, isa), module in zip(wanted, modules)}


@pytest.mark.parametrize("isa", WITHOUT)
def test_kernels_build_and_agree_without_avx512(isa, builds):
    gen = torch.Generator().manual_seed(1)
    gemv, native_gemv = builds[cpu_gemv.KERNEL.prefix, isa], cpu_gemv.load_kernel()
    assert gemv is not None and not gemv.gemv_use_avx512(True)
    weight, x = torch.randn(64, 96, generator=gen), torch.randn(20, 96, generator=gen)
    expected = native_gemv.gemv_linear(x, native_gemv.pack_gemv_weight(weight))
    torch.testing.assert_close(gemv.gemv_linear(x, gemv.pack_gemv_weight(weight)), expected)
    if isa == "avx2":   # one row of Q4_1 panels in the factored form: each build its own layout
        d = torch.rand(64, 3, 1, generator=gen).half().float() / 64
        q = torch.randint(0, 16, (64, 3, 32), generator=gen).float()
        q[..., 0], q[..., 1] = 0, 15   # a GGUF block's levels span 0..15
        q4 = (d * q + (-8 * d).half().float()).reshape(64, 96)
        row = x[:1].contiguous()
        assert torch.equal(gemv.gemv_linear(row, gemv.pack_gemv_q4(q4)),
                           native_gemv.gemv_linear(row, native_gemv.pack_gemv_q4(q4)))

    attention, native = builds[cpu_paged.KERNEL.prefix, isa], cpu_paged.load_kernel()
    assert attention is not None and not attention.paged_attention_has_avx512()
    k_cache, v_cache = (torch.randn(50, 16, 3, 64, generator=gen) for _ in range(2))
    table = torch.randperm(50, generator=gen)[:20].contiguous()
    query = torch.randn(100, 9, 64, generator=gen)
    expected, got = torch.empty_like(query), torch.empty_like(query)
    chunks = torch.tensor([[0, 60, 200, 0], [60, 40, 300, 0]])   # two requests, one table
    assert native.paged_prefill_attention(expected, query, k_cache, v_cache, chunks, table, 0.125)
    if attention.paged_prefill_attention(got, query, k_cache, v_cache, chunks, table, 0.125):
        # AVX2 tiles: the same FMAs in the same order as the native build's tiles
        assert isa == "avx2" and torch.equal(got, expected)
    else:
        assert isa == "sse"   # no AVX2: the caller's reference path takes prefill chunks
    decode_query, lens = query[:4].contiguous(), torch.tensor([300, 17, 160, 64])
    tables = table.repeat(4, 1)
    for kernel, out in ((native, expected[:4]), (attention, got[:4])):
        kernel.paged_decode_attention(out, decode_query, k_cache, v_cache, tables, lens, 0.125, -1)
    torch.testing.assert_close(got[:4], expected[:4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", WITHOUT)
def test_the_amx_kernel_builds_without_the_tiles_and_takes_no_weight(isa, builds):
    amx = builds[cpu_amx.KERNEL.prefix, isa]
    assert amx is not None and not amx.amx_available()
    weight = torch.zeros(16, 32)   # exactly Q4_1, Q8_0 and two bf16 numbers: refused all the same
    assert amx.pack_amx_q4_1(weight, False) == [] and amx.pack_amx_q8_0(weight, False) == []
    assert amx.pack_amx_weight(weight).numel() == 0
