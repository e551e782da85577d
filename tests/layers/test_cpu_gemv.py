"""The small-M linear kernel (layers/cpu_gemv) against F.linear, and the hybrid Linear that
routes short steps to it and longer ones to oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tokenmill.kernels.huge_pages import HUGE_PAGE, huge_pages_supported
from tokenmill.layers.cpu_gemv import GEMV_MAX_ROWS, load_kernel
from tokenmill.layers.linear import Linear, onednn_available

pytestmark = pytest.mark.skipif(
    load_kernel() is None or not onednn_available(torch.device("cpu"), torch.float32),
    reason="no C++ compiler for the kernel, or torch without oneDNN")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, GEMV_MAX_ROWS + 8), in_features=st.integers(1, 700),
       panels=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_kernel_matches_f_linear(rows, in_features, panels, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(panels * 16, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    kernel = load_kernel()
    got = kernel.gemv_linear(x, kernel.pack_gemv_weight(weight))
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4,
                               atol=1e-4 * in_features ** 0.5)


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


def test_hybrid_linear_keeps_its_panels_on_huge_pages():
    layer = Linear(576, 1024)                     # 2.25 MB of panels: more than one huge page
    layer.weight.data.normal_()
    x = torch.randn(3, 576)
    expected = F.linear(x, layer.weight)
    layer.prepack(gemv=True)
    if huge_pages_supported():
        assert layer.gemv_weight.data_ptr() % HUGE_PAGE == 0
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)
