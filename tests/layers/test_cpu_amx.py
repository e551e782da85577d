"""The AMX tile linear (layers/cpu_amx) against the float64 product and F.linear, the weights
it refuses, and the Linear that routes long steps to it. Runs only where the CPU has AMX
bf16 tiles (a Sapphire Rapids-class Xeon); elsewhere the "amx" backend is never chosen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tests.helpers.gil import longest_stall_beside
from tests.helpers.memory_maps import on_huge_page_memory, thp_enabled
from tokenmill.kernels.huge_pages import huge_pages_supported
from tokenmill.layers.cpu_amx import (AMX_MIN_ROWS, AMX_Q4_1_MIN_ROWS, AMX_Q8_0_MIN_ROWS,
                                     amx_linear, load_kernel, pack_amx_weight)
from tokenmill.layers.cpu_gemv import GEMV_MAX_ROWS
from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel
from tokenmill.layers.linear import Linear

pytestmark = pytest.mark.skipif(load_kernel() is None,
                                reason="no AMX bf16 tiles on this CPU (or no C++ compiler)")


def two_bf16_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 values (11 significant bits) as fp32: each is exactly hi + lo in bf16."""
    return (torch.randn(rows, cols, generator=gen) * 0.1).half().float()


def q4_1_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Q4_1 values as a GGUF file loads them: (d * q) + m in fp32, q in 0..15, a d and m (fp16)
    for each 32 inputs of a row (m the block's minimum, d a fifteenth of its range: both levels
    occur)."""
    levels = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen).float()
    levels[..., 0], levels[..., 1] = 0, 15
    step = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.01 + 1e-4).half().float()
    low = (-7.5 * step * (1 + 0.2 * torch.randn(rows, cols // 32, 1, generator=gen))).half().float()
    return (levels * step + low).reshape(rows, cols)


def q8_0_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Q8_0 values as a GGUF file loads them: d * q in fp32, q in -127..127, a d (fp16) for
    each 32 inputs of a row (127 occurs: d is the block's largest value over 127)."""
    levels = torch.randint(-127, 128, (rows, cols // 32, 32), generator=gen).float()
    levels[..., 0] = 127
    step = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.01 + 1e-4).half().float()
    return (levels * step).reshape(rows, cols)


WEIGHTS = {"two_bf16": two_bf16_weight, "q4_1": q4_1_weight, "q8_0": q8_0_weight}
FACTORED = ("q4_1", "q8_0")


def max_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    return (got.double() - x.double() @ weight.double().T).abs().max().item()


def roundoff_slack(x: torch.Tensor, weight: torch.Tensor) -> float:
    """A few fp32 unit roundoffs of the largest sum of |x w|: what a dot product's error may
    be for no fault of its own. F.linear's distance alone can be far smaller when its roundings
    happen to cancel (a 480-term hi + lo dot, seed 2182: 6.9e-7, the tiles' 3.0e-6)."""
    return 2**-22 * (x.double().abs() @ weight.double().abs().T).max().item()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), blocks=st.integers(1, 20), col_tiles=st.integers(1, 13),
       seed=st.integers(0, 2**16), kind=st.sampled_from(sorted(WEIGHTS)))
def test_as_accurate_as_an_fp32_gemm(rows, blocks, col_tiles, seed, kind):
    """Exact products summed in fp32: no further from the float64 product than F.linear's
    fp32 GEMM (within a factor of two: the sums run in another order), at every shape the
    tiles cut, partial row tiles and one or two leftover column tiles included; Q4_1 weights
    and Q8_0 weights in their factored form, the others as hi + lo tiles."""
    gen = torch.Generator().manual_seed(seed)
    weight = WEIGHTS[kind](col_tiles * 16, blocks * 32, gen)
    x = torch.randn(rows, blocks * 32, generator=gen)
    packed = pack_amx_weight(weight)
    assert packed is not None and (packed.steps is not None) == (kind in FACTORED)
    assert (packed.mins is not None) == (kind == "q4_1")
    got = amx_linear(x, packed)
    assert got.shape == (rows, col_tiles * 16)
    reference_error = max_error(F.linear(x, weight), x, weight)
    assert max_error(got, x, weight) <= 2 * reference_error + roundoff_slack(x, weight)


def test_bf16_and_q4_1_weights_are_taken_and_exact():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=gen)
    bf16 = torch.randn(48, 64, generator=gen).bfloat16().float()   # one bf16 number each
    q4_1 = q4_1_weight(48, 64, gen)
    for weight, factored in ((bf16, False), (q4_1, True), (q4_1, False)):
        packed = pack_amx_weight(weight, factored)
        assert packed is not None and (packed.steps is not None) == factored
        assert max_error(amx_linear(x, packed), x, weight) <= \
            2 * max_error(F.linear(x, weight), x, weight) + roundoff_slack(x, weight)


@pytest.mark.skipif(not (huge_pages_supported() and thp_enabled()),
                    reason="no transparent huge pages for madvised memory here")
def test_packed_weights_sit_on_huge_page_memory():
    """Every step streams them whole: each part is on memory advised for 2 MB pages."""
    gen = torch.Generator().manual_seed(5)
    for weight, factored in ((q4_1_weight(192, 256, gen), True),
                             (q8_0_weight(192, 256, gen), True),
                             (two_bf16_weight(192, 256, gen), False)):
        packed = pack_amx_weight(weight, factored)
        parts = [packed.tiles, packed.steps, packed.mins, packed.records]
        assert all(on_huge_page_memory(p) for p in parts if p is not None and p.numel())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), blocks=st.integers(1, 12), col_tiles=st.integers(1, 8),
       seed=st.integers(0, 2**16), kind=st.sampled_from(FACTORED))
def test_records_give_the_bf16_tiles_result_to_the_bit(rows, blocks, col_tiles, seed, kind):
    """Steps of every size take the levels from the column groups' records (Q4_1's in four
    bits with d and m beside them, Q8_0's a byte each with d), rebuilt as the bf16 tiles in L1:
    the same products and scalings in the same order as from bf16 level tiles (packed only on
    request, as this oracle), so the same bits, at every shape (a last group of one or two
    column tiles, a partial row tile, runs of row tiles sharing a block's levels included)."""
    gen = torch.Generator().manual_seed(seed)
    weight = WEIGHTS[kind](col_tiles * 16, blocks * 32, gen)
    packed = pack_amx_weight(weight)
    assert packed.tiles.numel() == 0   # the records only
    assert packed.records.dtype == (torch.uint8 if kind == "q4_1" else torch.int8)
    x = torch.randn(rows, blocks * 32, generator=gen)
    kernel = load_kernel()
    pack = kernel.pack_amx_q4_1 if kind == "q4_1" else kernel.pack_amx_q8_0
    tiles, steps, mins, _ = pack(weight, True)
    from_records = amx_linear(x, packed)
    assert torch.equal(from_records, kernel.amx_linear_factored(x, tiles, steps, mins))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(17, 300), seed=st.integers(0, 2**16))
def test_a_row_gets_the_same_bits_in_every_step(rows, seed):
    """A Q4_1 row's output does not depend on the step around it: each row's products and
    readouts are its own, from one row up to a long step's row tiles."""
    gen = torch.Generator().manual_seed(seed)
    packed = pack_amx_weight(q4_1_weight(96, 128, gen))
    x = torch.randn(rows, 128, generator=gen)
    whole = amx_linear(x, packed)
    for first, last in ((0, 1), (rows - 16, rows), (rows // 2, rows // 2 + 40)):
        assert torch.equal(amx_linear(x[first:last].contiguous(), packed), whole[first:last])


@pytest.mark.parametrize("weight", [
    torch.randn(32, 64, generator=torch.Generator().manual_seed(1)),   # 24-bit fp32 values
    torch.ones(24, 64).half().float(),     # 24 rows: not whole 16-column tiles
    torch.ones(32, 48).half().float(),     # 48 inputs: not whole 32-step tiles
], ids=["fp32", "rows", "inputs"])
def test_weights_it_cannot_take_exactly_are_refused(weight):
    assert pack_amx_weight(weight) is None


def test_hi_lo_tiles_refuse_a_subnormal_lo():
    weight = torch.full((16, 32), 1.0 + 2.0 ** -10) * 2.0 ** -120   # lo a bf16 subnormal
    assert pack_amx_weight(weight, factored=False) is None
    assert pack_amx_weight(weight).steps is not None   # as Q4_1: d = 0, m = the value


@pytest.mark.parametrize("kind, min_rows", [("two_bf16", AMX_MIN_ROWS),
                                             ("q4_1", AMX_Q4_1_MIN_ROWS),
                                             ("q8_0", AMX_Q8_0_MIN_ROWS)])
def test_linear_routes_long_steps_to_the_tiles_and_keeps_onednn_for_other_weights(kind, min_rows):
    gen = torch.Generator().manual_seed(5)
    exact, plain = Linear(96, 64, bias=True), Linear(96, 64)
    exact.weight.data.copy_(WEIGHTS[kind](64, 96, gen))
    exact.bias.data.copy_(torch.randn(64, generator=gen))
    plain.weight.data.copy_(torch.randn(64, 96, generator=gen))
    weights = {id(m): m.weight.detach().clone() for m in (exact, plain)}
    for module in (exact, plain):
        module.prepack(gemv=True, compact=False, amx=True)
    assert exact.amx_weight is not None and exact.packed_weight is None
    assert exact.amx_weight.min_rows == min_rows
    assert plain.amx_weight is None and plain.packed_weight is not None
    for rows in (1, min_rows - 1, min_rows, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 700):
        x = torch.randn(rows, 96, generator=gen)
        for module, bias in ((exact, exact.bias), (plain, None)):
            expected = F.linear(x, weights[id(module)], bias)
            torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)
        # the route itself: bitwise the kernel that should have taken the step
        if rows >= min_rows:
            routed = amx_linear(x, exact.amx_weight)
        else:
            routed = load_gemv_kernel().gemv_linear(x, exact.small_step_panels(rows))
        assert torch.equal(exact(x), routed.add_(exact.bias))


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_kernel_lets_other_threads_run(kind):
    """The server's event loop streams tokens while the engine thread is in the kernel."""
    gen = torch.Generator().manual_seed(7)
    packed = pack_amx_weight(WEIGHTS[kind](3072, 1024, gen))
    x = torch.randn(1024, 1024, generator=gen)
    duration, stall = longest_stall_beside(lambda: [amx_linear(x, packed) for _ in range(3)])
    assert stall < duration / 4, (stall, duration)


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
@pytest.mark.parametrize("rows, inputs", [(700, 1536), (333, 576), (40, 96)])
def test_every_thread_count_gives_the_same_bits(kind, rows, inputs):
    """Long steps share their row blocks out among the threads, each splitting its own rows
    and taking the others' last items when done: every (row tile, column group) is computed
    once, from its own rows, whatever the thread count."""
    gen = torch.Generator().manual_seed(rows + inputs)
    weight = WEIGHTS[kind](576, inputs, gen)
    packed = pack_amx_weight(weight)
    x = torch.randn(rows, inputs, generator=gen)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(amx_linear(x, packed))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    assert max_error(outputs[0], x, weight) <= (2 * max_error(F.linear(x, weight), x, weight)
                                                + roundoff_slack(x, weight))
