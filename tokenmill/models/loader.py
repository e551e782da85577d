"""Load a model from a GGUF file or a Hugging Face directory into our model classes."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from tokenmill.attention import cpu_paged
from tokenmill.attention.registry import resolve_backend_name
from tokenmill.kernels.cpp_build import load_in_parallel
from tokenmill.layers import cpu_amx, cpu_fused, cpu_gemv
from tokenmill.layers.cpu_fused import enable_fused_elementwise, resolve_elementwise_backend
from tokenmill.layers.linear import prepack_linears, resolve_linear_backend
from tokenmill.models import gguf_loader, layer_plan
from tokenmill.models.registry import model_class
from tokenmill.models.spec import ModelSpec, spec_from_hf_config

# The C++ kernels a CPU fp32 model may run (attention, linears, elementwise, layer loop).
CPU_KERNELS = [cpu_paged.KERNEL, cpu_gemv.KERNEL, cpu_fused.KERNEL, layer_plan.LOOP,
               cpu_amx.KERNEL]


def _iter_safetensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name).to(dtype)


def resolve_max_model_len(spec: ModelSpec, requested: int | None) -> int:
    if requested is None:
        return spec.max_position_embeddings
    if requested > spec.max_position_embeddings:
        raise ValueError(f"max_model_len: {requested} exceeds the model's context length "
                         f"{spec.max_position_embeddings}")
    return requested


def load_model(kind: str, path: Path, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None, attention_backend: str = "auto",
               linear_backend: str = "auto", elementwise_backend: str = "auto",
               compact_panels: bool = True) -> tuple[nn.Module, ModelSpec, int]:
    """Build the model for `path` (kind "gguf" or "hf") with weights in `dtype` on `device`.

    The backends are names from attention/registry.py, layers/linear.py and layers/cpu_fused.py
    ("auto" picks the fastest that runs here); "onednn" linears are packed once the weights
    are in, and "hybrid" ones with `compact_panels` also get Q4_1/Q8_0 panels where exact;
    "amx" ones are "hybrid" with AMX tiles in place of oneDNN's layout where exact.

    Returns the model, its spec and the resolved max_model_len.
    """
    if device.type == "cpu":   # what "auto" may pick, built at once; in any dtype the sampler's
        # greedy pick (cpu_fused) takes the fp32 logits, so no request waits on its build
        load_in_parallel(CPU_KERNELS if dtype == torch.float32 else [cpu_fused.KERNEL])
    if kind == "gguf":
        reader = gguf_loader.open_gguf(path)
        spec = gguf_loader.spec_from_gguf(reader)
        weights = gguf_loader.iter_gguf_weights(reader, spec, dtype)
    else:
        spec = spec_from_hf_config(path)
        weights = _iter_safetensors(path, dtype)
    max_positions = resolve_max_model_len(spec, max_model_len)
    cls = model_class(spec.architecture)
    backend = resolve_backend_name(attention_backend, device, dtype)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(spec, max_positions, backend)
        finally:
            torch.set_default_dtype(previous)
    model.load_weights((name, w.to(device)) for name, w in weights)
    linear = resolve_linear_backend(linear_backend, device, dtype)
    if linear in ("onednn", "hybrid", "amx"):
        prepack_linears(model, gemv=linear in ("hybrid", "amx"), compact=compact_panels,
                        amx=linear == "amx")
        model.embed_from_lm_head()
    if resolve_elementwise_backend(elementwise_backend, device, dtype) == "cpu_fused":
        enable_fused_elementwise(model)
    model.build_layer_plan()
    return model.eval(), spec, max_positions


