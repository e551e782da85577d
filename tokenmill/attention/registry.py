"""Attention backend registry: name -> backend class (imported lazily), and "auto" resolution."""

from __future__ import annotations

import importlib

import torch

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("tokenmill.attention.torch_ref", "TorchReferenceBackend"),
    "cpu_paged": ("tokenmill.attention.cpu_paged", "CpuPagedBackend"),
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": the paged CPU kernel for fp32 on CPU when it compiles, else the reference."""
    if name != "auto":
        return name
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        from tokenmill.attention.cpu_paged import load_kernel
        if load_kernel() is not None:
            return "cpu_paged"
    return "torch"


def backend_class(name: str) -> type:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r} "
                         f"(known: auto, {', '.join(backend_names())})")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)
