"""oneDNN packed linear layers against F.linear (the reference), and the switch itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tokenmill.layers import cpu_amx
from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel
from tokenmill.layers.linear import Linear, MergedLinear, onednn_available, \
    prepack_linears, resolve_linear_backend

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                reason="torch built without oneDNN")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), in_features=st.integers(1, 200),
       out_features=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_linear_matches_f_linear(rows, in_features, out_features, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    layer.weight.data.copy_(torch.randn(out_features, in_features, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.prepack()
    assert layer.weight is None and layer.packed_weight is not None
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * in_features ** 0.5)


def test_packed_linear_takes_strided_input():
    layer = Linear(64, 32)
    layer.weight.data.normal_()
    x = torch.randn(10, 128)[:, ::2]           # non-contiguous rows
    expected = F.linear(x, layer.weight)
    layer.prepack()
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)


def test_prepack_keeps_a_shared_weight_for_its_other_owner():
    """A tied lm_head shares the embedding's weight: packing the head must not drop it."""
    embedding = torch.nn.Embedding(50, 16)
    head = Linear(16, 50)
    head.weight = embedding.weight
    model = torch.nn.ModuleDict({"embed": embedding, "head": head,
                                 "merged": MergedLinear(16, [8, 4])})
    assert prepack_linears(model) == 2
    assert embedding.weight.shape == (50, 16)
    hidden = embedding(torch.tensor([3, 7]))
    torch.testing.assert_close(head(hidden), hidden @ embedding.weight.t(), rtol=1e-4, atol=1e-4)


def test_backend_resolution_and_errors():
    cpu = torch.device("cpu")
    expected = ("onednn" if load_gemv_kernel() is None
                else "amx" if cpu_amx.load_kernel() is not None else "hybrid")
    assert resolve_linear_backend("auto", cpu, torch.float32) == expected
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_linear_backend("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="linear_backend"):
        resolve_linear_backend("onednn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend"):
        resolve_linear_backend("blas", cpu, torch.float32)
