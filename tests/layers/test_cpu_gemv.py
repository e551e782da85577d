"""The small-M linear kernel (layers/cpu_gemv) against F.linear, its compact Q4_1/Q8_0 panels
against its fp32 panels, and the hybrid Linear that routes short steps to it and longer ones
to oneDNN."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from tests.helpers.gil import longest_stall_beside
from tests.helpers.isa import avx2_tiles, switched_off
from tests.helpers.memory_maps import on_huge_page_memory, thp_enabled
from tokenmill.kernels.huge_pages import huge_pages_supported
from tokenmill.layers.cpu_gemv import GEMV_COMPACT_MAX_ROWS, GEMV_MAX_ROWS, load_kernel
from tokenmill.layers.embedding import Embedding
from tokenmill.layers.linear import Linear, onednn_available

pytestmark = pytest.mark.skipif(
    load_kernel() is None or not onednn_available(torch.device("cpu"), torch.float32),
    reason="no C++ compiler for the kernel, or torch without oneDNN")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 392), in_features=st.integers(1, 700),
       panels=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_kernel_matches_f_linear(rows, in_features, panels, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(panels * 16, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    kernel = load_kernel()
    got = kernel.gemv_linear(x, kernel.pack_gemv_weight(weight))
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4,
                               atol=1e-4 * in_features ** 0.5)


def test_kernel_lets_other_threads_run():
    """The server's event loop streams tokens while the engine thread is inside a kernel."""
    kernel = load_kernel()
    packed = kernel.pack_gemv_weight(torch.randn(4096, 4096))
    x = torch.randn(384, 4096)
    duration, stall = longest_stall_beside(lambda: [kernel.gemv_linear(x, packed)
                                                    for _ in range(3)])
    assert stall < duration / 4, (stall, duration)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 20), in_features=st.integers(1, 300), panels=st.integers(1, 13),
       seed=st.integers(0, 2**16))
def test_a_row_comes_out_bitwise_the_same_whatever_rows_share_its_step(rows, in_features,
                                                                      panels, seed):
    # Batch composition must not move greedy output: every path (one row against several
    # panels side by side, a few rows in one tile, row groups over K blocks) sums a row's
    # products in the same order.
    gen = torch.Generator().manual_seed(seed)
    kernel = load_kernel()
    packed = kernel.pack_gemv_weight(torch.randn(panels * 16, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    together = kernel.gemv_linear(x, packed)
    for row in range(rows):
        alone = kernel.gemv_linear(x[row:row + 1].contiguous(), packed)
        assert torch.equal(alone, together[row:row + 1]), row
    for size in (2, 3):
        assert torch.equal(kernel.gemv_linear(x[:size].contiguous(), packed), together[:size])


@pytest.mark.parametrize("rows", [1, 3, 12, 200])
def test_output_is_bitwise_the_same_on_any_number_of_threads(rows):
    # The threads take the panels in chunks from a shared counter (kernels/work_sharing.h), so
    # which thread computes a panel varies from call to call; that must not change a bit of
    # the result, with fp32 or compact panels, nor leave a panel out.
    gen = torch.Generator().manual_seed(rows)
    kernel = load_kernel()
    weight = q4_1_weight(gen, 37 * 16, 96)   # 37 panels: chunks do not divide them evenly
    x = torch.randn(rows, 96, generator=gen)
    panels = [kernel.pack_gemv_weight(weight), kernel.pack_gemv_q4(weight)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [kernel.gemv_linear(x, p) for p in panels]
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for packed, want in zip(panels, expected):
                for _ in range(3):
                    assert torch.equal(kernel.gemv_linear(x, packed), want), threads
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(expected[0], F.linear(x, weight), rtol=1e-4, atol=1e-3)


def test_kernel_rejects_what_it_cannot_take():
    kernel = load_kernel()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.pack_gemv_weight(torch.randn(24, 8))
    packed = kernel.pack_gemv_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.gemv_linear(torch.randn(2, 9), packed)


@pytest.mark.parametrize("out_features,bias", [(96, True), (96, False), (100, True)])
def test_hybrid_linear_equals_reference_on_both_sides_of_the_switch(out_features, bias):
    gen = torch.Generator().manual_seed(out_features)
    layer = Linear(72, out_features, bias=bias)
    layer.weight.data.copy_(torch.randn(out_features, 72, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=gen))
    reference = {rows: torch.randn(rows, 72, generator=gen)
                 for rows in (1, 5, 8, 40, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 300)}
    expected = {rows: F.linear(x, layer.weight, layer.bias) for rows, x in reference.items()}
    layer.prepack(gemv=True)
    # out_features 100 is not a multiple of 16: that layer stays on oneDNN at every size
    assert (layer.gemv_weight is not None) == (out_features % 16 == 0)
    for rows, x in reference.items():
        torch.testing.assert_close(layer(x), expected[rows], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("out_features", [1024, 64])   # 2.25 MB and 144 KB of panels
def test_hybrid_linear_keeps_its_panels_on_huge_pages(out_features):
    layer = Linear(576, out_features)
    layer.weight.data.normal_()
    x = torch.randn(3, 576)
    expected = F.linear(x, layer.weight)
    layer.prepack(gemv=True)
    if huge_pages_supported() and thp_enabled():
        assert on_huge_page_memory(layer.gemv_weight)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)


def q4_1_parts(gen: torch.Generator, out_features: int,
               in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 weight's d, q, m ([out, blocks, 1], [out, blocks, 32], [out, blocks, 1]): one
    fp16 d and m per 32 inputs of a row, q in 0..15 (levels 0 and 15 in every block, as the
    quantizer makes them)."""
    blocks = (out_features, in_features // 32, 1)
    d = (torch.rand(blocks, generator=gen) * 0.01 + 1e-4).half().float()
    m = (torch.randn(blocks, generator=gen) * 0.05).half().float()
    q = torch.randint(0, 16, (*blocks[:2], 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    return d, q[..., torch.randperm(32, generator=gen)], m


def q4_1_weight(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    """Weights as a Q4_1 GGUF loads them: (d * q) + m in fp32."""
    d, q, m = q4_1_parts(gen, out_features, in_features)
    return (d * q + m).reshape(out_features, in_features)


def q8_0_parts(gen: torch.Generator, out_features: int,
               in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 weight's d and q ([out, blocks, 1], [out, blocks, 32]): one fp16 d per 32 inputs,
    q in -127..127 (the largest weight of a block at level 127 or -127, as the quantizer
    makes it)."""
    d = (torch.rand(out_features, in_features // 32, 1, generator=gen) * 0.01 + 1e-4).half().float()
    q = torch.randint(-126, 127, (out_features, in_features // 32, 32), generator=gen).float()
    q[..., 0] = 127 * (torch.randint(0, 2, q.shape[:2], generator=gen) * 2 - 1)
    return d, q[..., torch.randperm(32, generator=gen)]


def q8_0_weight(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    """As a Q8_0 GGUF loads them: d * q in fp32."""
    d, q = q8_0_parts(gen, out_features, in_features)
    return (d * q).reshape(out_features, in_features)


FORMATS = {"q4_1": (q4_1_weight, "pack_gemv_q4", torch.uint8),
           "q8_0": (q8_0_weight, "pack_gemv_q8", torch.int8)}


def packed(fmt: str, gen: torch.Generator, panels: int,
           blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight of `panels` x 16 rows and `blocks` x 32 inputs in format `fmt`, and its
    compact panels."""
    make, packer, _ = FORMATS[fmt]
    weight = make(gen, panels * 16, blocks * 32)
    return weight, getattr(load_kernel(), packer)(weight)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 48), blocks=st.integers(1, 24), panels=st.integers(1, 9),
       seed=st.integers(0, 2**16))
@example(rows=7, blocks=3, panels=5, seed=1)     # Q8_0: the half-panel tiles' smallest...
@example(rows=12, blocks=18, panels=3, seed=2)   # ...and largest row count
@example(rows=13, blocks=2, panels=2, seed=3)    # and the row groups again above them
@example(rows=24, blocks=3, panels=3, seed=4)    # AVX-512: the tallest tile...
@example(rows=25, blocks=2, panels=3, seed=5)    # ...two groups of tall tiles...
@example(rows=41, blocks=5, panels=2, seed=6)    # ...and the staged slice past them
def test_compact_panels_give_bitwise_the_fp32_panels_output(fmt, rows, blocks, panels, seed):
    # The packer recovers every block's scales and levels, and the kernel rebuilds the same
    # fp32 weights and sums them in the same order: not close, equal; and a row's result
    # still does not depend on the rows beside it. (Short Q4_1 steps take the factored form
    # by default where the build has AVX-512: the next test.)
    gen = torch.Generator().manual_seed(seed)
    kernel = load_kernel()
    weight, compact = packed(fmt, gen, panels, blocks)
    assert compact.dtype == FORMATS[fmt][2] and compact.numel() > 0
    assert compact.numel() <= weight.numel() * 17 // 16   # at most 1.0625 bytes a weight
    x = torch.randn(rows, blocks * 32, generator=gen)
    with switched_off(kernel.gemv_use_factored):
        together = kernel.gemv_linear(x, compact)
        assert torch.equal(together, kernel.gemv_linear(x, kernel.pack_gemv_weight(weight)))
        for row in range(rows):
            assert torch.equal(kernel.gemv_linear(x[row:row + 1].contiguous(), compact),
                               together[row:row + 1]), row


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=25, deadline=None)
@given(panels=st.integers(1, 6), blocks=st.integers(1, 20),
       shape=st.sampled_from([(0,), (1,), (37,), (3, 5)]), seed=st.integers(0, 2**16))
def test_compact_panels_give_back_the_rows_they_hold(fmt, panels, blocks, shape, seed):
    # The embedding of a tied lm_head reads its rows from the panels (layers/embedding.py):
    # every row the same fp32 value as the weight's, whichever column of its panel it is.
    gen = torch.Generator().manual_seed(seed)
    weight, compact = packed(fmt, gen, panels, blocks)
    ids = torch.randint(0, panels * 16, shape, generator=gen)
    assert torch.equal(load_kernel().compact_panel_rows(compact, ids), F.embedding(ids, weight))


@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_panel_rows_reject_ids_out_of_range(fmt):
    _, compact = packed(fmt, torch.Generator().manual_seed(3), 2, 2)
    for bad in (32, -1):
        with pytest.raises(RuntimeError, match=f"id {bad} out of range"):
            load_kernel().compact_panel_rows(compact, torch.tensor([0, bad]))
    with pytest.raises(RuntimeError, match="int64 ids"):
        load_kernel().compact_panel_rows(compact, torch.tensor([0], dtype=torch.int32))


def test_embedding_reads_its_rows_from_panels_of_its_own_table_only():
    gen = torch.Generator().manual_seed(5)
    table = q8_0_weight(gen, 48, 64)
    embedding = Embedding(48, 64)
    embedding.weight.data.copy_(table)
    other = load_kernel().pack_gemv_q8(q8_0_weight(gen, 48, 64))
    with pytest.raises(ValueError, match="do not hold this table"):
        embedding.read_from_panels(other)
    assert embedding.panels is None and torch.equal(embedding.weight, table)
    embedding.read_from_panels(load_kernel().pack_gemv_q8(table))
    assert embedding.weight is None
    ids = torch.tensor([47, 0, 16, 15, 47])
    assert torch.equal(embedding(ids), table[ids])


FACTORED = load_kernel() is not None and load_kernel().gemv_use_factored(True)
AVX512_TILES = load_kernel() is not None and load_kernel().gemv_use_avx512(True)


def factored_parts(fmt: str, gen: torch.Generator, out_features: int,
                   in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight of format fmt and the magnitudes of its terms (|d q| + |m|, or |d q|)."""
    if fmt == "q4_1":
        d, q, m = q4_1_parts(gen, out_features, in_features)
        weight, magnitude = d * q + m, (d * q).abs() + m.abs()
    else:
        d, q = q8_0_parts(gen, out_features, in_features)
        weight, magnitude = d * q, (d * q).abs()
    return weight.reshape(out_features, in_features), magnitude.reshape(out_features, in_features)


ROUTES = {"default": nullcontext, "avx2": lambda: avx2_tiles(load_kernel().gemv_use_avx512)}


@pytest.mark.skipif(not FACTORED, reason="the kernel was built without AVX2 here")
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 13), blocks=st.integers(1, 48), panels=st.integers(1, 9),
       seed=st.integers(0, 2**16))
@example(rows=1, blocks=48, panels=9, seed=0)    # panels side by side, then one
@example(rows=2, blocks=3, panels=4, seed=2)     # the AVX2 route's first rebuilt step
@example(rows=6, blocks=3, panels=3, seed=1)     # the AVX-512 route's largest factored step...
@example(rows=7, blocks=3, panels=3, seed=3)     # ...and on Zen 4 and 5 its one-panel tiles...
@example(rows=12, blocks=5, panels=3, seed=4)    # ...up to 12 rows...
@example(rows=13, blocks=3, panels=2, seed=5)    # ...then the rebuilt weights
def test_factored_form_is_within_the_rounding_bound_and_batch_invariant(route, fmt, rows,
                                                                       blocks, panels, seed):
    # Short steps (up to 6 rows on the AVX-512 route, 12 on AMD Zen 4 and 5, one on AVX2),
    # y = sum over blocks of d (q . x) (+ m sum(x), Q4_1). Each output must be within the rounding bound of
    # a dot product of that length (k + 2 blocks + 2 roundings of the terms' magnitudes) of the
    # exact result, whatever the weights' offsets m: a lost or misplaced m term, scale or block
    # is far outside it. A row's result must not depend on the rows beside it; longer steps
    # hand over to the rebuilt weights (bitwise the fp32 panels). The AVX2 route's one row is
    # bitwise the AVX-512 route's (each lane the same operations in the same order).
    gen = torch.Generator().manual_seed(seed)
    kernel = load_kernel()
    weight, magnitudes = factored_parts(fmt, gen, panels * 16, blocks * 32)
    compact = getattr(kernel, FORMATS[fmt][1])(weight)
    x = torch.randn(rows, blocks * 32, generator=gen)
    with ROUTES[route]():
        factored_rows = kernel.gemv_factored_max_rows()
        got = kernel.gemv_linear(x, compact)
        alone = [kernel.gemv_linear(x[row:row + 1].contiguous(), compact) for row in range(rows)]
    assert factored_rows >= 1
    if rows == 1 and route == "avx2" and AVX512_TILES:
        assert torch.equal(got, kernel.gemv_linear(x, compact))
    if rows > factored_rows:
        assert torch.equal(got, kernel.gemv_linear(x, kernel.pack_gemv_weight(weight)))
        return
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ magnitudes.double().T
    bound = (blocks * 32 + 2 * blocks + 2) * 2.0 ** -24 * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    for row in range(rows):
        assert torch.equal(alone[row], got[row:row + 1]), row


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a race needs two threads")
def test_q4_1_packer_gives_the_same_panels_on_every_thread_count():
    """Q4_1 packed (and packs, in AVX2 builds) columns c and c + 8 of a panel into one
    byte; when the packer's threads
    split the rows mid-panel (48 rows: 24 and 24 on two threads), both wrote that byte at once
    and now and then one's nibbles were lost (about one pack in 6,000 here): the model got
    wrong weights and no error. Many packs of such a weight must all equal a one-thread pack."""
    weight = q4_1_weight(torch.Generator().manual_seed(0), 3 * 16, 64)
    pack = load_kernel().pack_gemv_q4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = pack(weight)
    finally:
        torch.set_num_threads(threads)
    differing = sum(not torch.equal(pack(weight), alone) for _ in range(40_000))
    assert differing == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_packers_refuse_weights_they_cannot_rebuild_exactly(fmt):
    make, packer, _ = FORMATS[fmt]
    gen = torch.Generator().manual_seed(7)
    pack = getattr(load_kernel(), packer)
    weight = make(gen, 32, 96)
    assert pack(weight).numel() > 0
    nudged = weight.clone()
    nudged[17, 40] = torch.nextafter(nudged[17, 40], torch.tensor(1.0))   # one ulp, one weight
    assert pack(nudged).numel() == 0
    assert pack(torch.randn(32, 96, generator=gen)).numel() == 0       # plain fp32 weights
    assert pack(make(gen, 32, 96)[:, :80].contiguous()).numel() == 0   # K not whole blocks
    with pytest.raises(RuntimeError, match="compact panels do not match"):
        load_kernel().gemv_linear(torch.randn(2, 64), pack(weight))



def test_q4_1_panels_take_fp16_scales_only():
    """The panels keep a block's scales in fp16, as GGUF stores them: Q4_1 (Q8_0, below) values
    whose d or m is no fp16 number get no compact panels (the caller keeps the fp32 ones)."""
    gen = torch.Generator().manual_seed(11)
    pack = load_kernel().pack_gemv_q4
    d, q, m = q4_1_parts(gen, 32, 96)
    assert pack((d * q + m).reshape(32, 96)).numel() > 0
    fp32_d = d.clone()
    fp32_d[5, 1] *= 1 + 2 ** -12   # below fp16's precision (a d one fp32 ulp off may rebuild
    assert pack((fp32_d * q + m).reshape(32, 96)).numel() == 0   # the same weights as its fp16)
    fp32_m = m.clone()
    fp32_m[30, 2] = torch.nextafter(fp32_m[30, 2], torch.tensor(1.0))   # m is a weight (q = 0)
    assert pack((d * q + fp32_m).reshape(32, 96)).numel() == 0


def test_q8_0_panels_take_fp16_steps_only():
    gen = torch.Generator().manual_seed(12)
    pack = load_kernel().pack_gemv_q8
    d = (torch.rand(32, 3, 1, generator=gen) * 0.01 + 1e-4).half().float()
    q = torch.randint(-126, 127, (32, 3, 32), generator=gen).float()
    q[..., 0] = 127
    assert pack((d * q).reshape(32, 96)).numel() > 0
    d[7, 2] *= 1 + 2 ** -12
    assert pack((d * q).reshape(32, 96)).numel() == 0

def test_hybrid_linear_takes_compact_panels_for_short_steps_only():
    gen = torch.Generator().manual_seed(3)
    weight = q4_1_weight(gen, 64, 128)
    layers = {}
    for compact in (False, True):
        layers[compact] = Linear(128, 64)
        layers[compact].weight.data.copy_(weight)
        layers[compact].prepack(gemv=True, compact=compact)
    assert layers[False].gemv_compact is None
    assert layers[True].gemv_compact.dtype == torch.uint8
    limit = GEMV_COMPACT_MAX_ROWS[torch.uint8]
    assert layers[True].small_step_panels(limit) is layers[True].gemv_compact
    # fp32 panels are kept only for the kernel's steps too long for the compact ones
    assert (layers[True].gemv_weight is not None) == (limit < GEMV_MAX_ROWS)
    assert layers[True].small_step_panels(limit + 1) is layers[True].gemv_weight
    for rows in (1, 3, limit, limit + 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 5):
        x = torch.randn(rows, 128, generator=gen)
        torch.testing.assert_close(layers[True](x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
        with switched_off(load_kernel().gemv_use_factored):   # rebuilt weights: the same bits
            assert torch.equal(layers[True](x), layers[False](x)), rows


@pytest.mark.skipif(not AVX512_TILES, reason="the kernel was built without AVX-512 here")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 160), blocks=st.integers(1, 20), tail=st.integers(0, 31),
       panels=st.integers(1, 24), fmt=st.sampled_from(["fp32", *FORMATS]),
       seed=st.integers(0, 2**16))
@example(rows=40, blocks=9, tail=5, panels=7, fmt="fp32", seed=0)   # 4 row groups, 3 slices
@example(rows=90, blocks=2, tail=0, panels=3, fmt="fp32", seed=1)   # 8: no spread prefetch
@example(rows=24, blocks=18, tail=0, panels=5, fmt="q4_1", seed=2)  # compact, two groups
@example(rows=40, blocks=6, tail=0, panels=7, fmt="q4_1", seed=4)   # staged: 4 groups
@example(rows=30, blocks=5, tail=0, panels=3, fmt="q8_0", seed=3)   # staged: 3 groups, a
#                                                                     short last slice, 1 panel
def test_avx512_tiles_give_bitwise_the_avx2_tiles_output(rows, blocks, tail, panels, fmt, seed):
    # Where the build has AVX-512 the kernel takes its own tiles (bigger, another row
    # grouping, other prefetches); each output must still be the same FMAs in the same
    # order, so the two must agree bit for bit, and greedy output cannot depend on the CPU.
    gen = torch.Generator().manual_seed(seed)
    kernel = load_kernel()
    if fmt == "fp32":
        in_features = blocks * 32 + tail
        packed = kernel.pack_gemv_weight(torch.randn(panels * 16, in_features, generator=gen))
    else:
        make, packer, _ = FORMATS[fmt]
        in_features = blocks * 32
        packed = getattr(kernel, packer)(make(gen, panels * 16, in_features))
    x = torch.randn(rows, in_features, generator=gen)
    with switched_off(kernel.gemv_use_factored):   # the AVX-512 route's own form
        got = kernel.gemv_linear(x, packed)
        with avx2_tiles(kernel.gemv_use_avx512):
            assert torch.equal(got, kernel.gemv_linear(x, packed))
