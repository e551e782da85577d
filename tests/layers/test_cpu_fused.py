"""The fused CPU elementwise kernels (layers/cpu_fused) against the torch reference ops of
RMSNorm, RotaryEmbedding and SiLU·mul, and the backend resolution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.cpu_fused import load_kernel, resolve_elementwise_backend
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler for the kernels")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), hidden=st.integers(1, 200), with_residual=st.booleans(),
       seed=st.integers(0, 2**16))
def test_add_rms_norm_matches_reference(rows, hidden, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    want_normed, want_sum = norm(x, residual)
    norm.kernel = load_kernel()
    x_before = x.clone()
    got_normed, got_sum = norm(x, residual)
    torch.testing.assert_close(got_normed, want_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_sum, want_sum)  # the add itself is exact
    assert torch.equal(x, x_before)        # inputs are not written


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), half=st.integers(1, 300), scale=st.sampled_from([0.1, 3.0, 40.0]),
       seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_reference(rows, half, scale, seed):
    """Wide inputs too: e^-x saturates at both ends (|x| up to ~200) without inf or nan."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * half, generator=gen) * scale
    act = SiluAndMul()
    want = act(gate_up)
    act.kernel = load_kernel()
    before = gate_up.clone()
    got = act(gate_up)
    assert got.shape == (rows, half)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.equal(gate_up, before)


@pytest.mark.parametrize("rows,half", [(1, 9000), (3, 2999), (8, 1536), (5, 17)])
def test_silu_and_mul_split_by_elements_is_the_one_thread_result(rows, half):
    """Chunks of elements (a row cut anywhere, even mid-row) give bitwise the values of one
    thread's pass, and every output is written."""
    gate_up = torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(rows)) * 3
    kernel, threads = load_kernel(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = kernel.silu_and_mul(gate_up)
        torch.set_num_threads(1)
        whole = kernel.silu_and_mul(gate_up)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, whole)
    torch.testing.assert_close(split, SiluAndMul()(gate_up), rtol=2e-6, atol=1e-6)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(RuntimeError, match="even"):
        load_kernel().silu_and_mul(torch.randn(2, 7))


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 70), heads=st.integers(1, 12), half_dim=st.integers(1, 40),
       extra=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_rotate_half_is_bitwise_the_reference(tokens, heads, half_dim, extra, seed):
    """On a strided view of a wider row (q|k inside qkv), as the attention layer calls it."""
    gen = torch.Generator().manual_seed(seed)
    dim = 2 * half_dim
    rope = RotaryEmbedding(dim, 512, 10000.0)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    row = torch.randn(tokens, heads * dim + extra, generator=gen)
    x = row[:, :heads * dim].view(tokens, heads, dim)
    want = RotaryEmbedding.rotate(rope.tables(positions, torch.float32), x)
    rope.kernel = load_kernel()
    tables = rope.tables(positions, torch.float32)
    assert tables.kernel is not None
    got = RotaryEmbedding.rotate(tables, x)
    assert got.is_contiguous() and torch.equal(got, want)


def test_kernels_reject_bad_shapes():
    kernel = load_kernel()
    with pytest.raises(RuntimeError, match="weight"):
        kernel.add_rms_norm(torch.randn(2, 8), torch.empty(0), torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="residual shape"):
        kernel.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin"):
        kernel.rotate_half(torch.randn(2, 3, 8), torch.randn(2, 6), torch.randn(2, 6))


def test_backend_resolution():
    cpu = torch.device("cpu")
    assert resolve_elementwise_backend("auto", cpu, torch.float32) == "cpu_fused"
    assert resolve_elementwise_backend("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_elementwise_backend("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="elementwise_backend"):
        resolve_elementwise_backend("cpu_fused", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="elementwise_backend"):
        resolve_elementwise_backend("triton", cpu, torch.float32)
