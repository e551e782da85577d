"""Linear layers. Weights are [out_features, in_features], as in Hugging Face checkpoints.

Ways to run them (`linear_backend`):
- "torch": F.linear on the plain weight (MKL sgemm on CPU); the reference.
- "onednn": the weight reordered once, after loading, into oneDNN's blocked layout and run with
  oneDNN's packed GEMM. On CPU fp32 this was 1.2-2.5x faster than F.linear for the decode-sized
  batches (M = 1..64) of SmolLM2's shapes and reads the weights at the machine's memory
  bandwidth at M = 1 (the lm_head GEMV: 8.9 -> 4.5 ms); F.linear reached half of it.
- "hybrid": "onednn", plus our kernel (layers/cpu_gemv.py; AVX2 or AVX-512 tiles) for steps of
  at most GEMV_MAX_ROWS tokens (384, or 128 with AVX-512), where it is faster than oneDNN (it
  streams the weights at memory bandwidth at M = 1 and runs near the FMA peak from M = 16). It
  keeps a second copy of each weight in the kernel's panel layout: twice the weight memory for
  the linear layers.
  Weights that are exactly Q4_1 or Q8_0 values (as such a GGUF loads) also get compact panels
  for steps of at most GEMV_COMPACT_MAX_ROWS tokens: the same fp32 values and output, for a
  fifth (Q4_1) or a quarter (Q8_0) of the bytes to stream. Where those take every step the
  kernel takes (AVX-512), the fp32 panels are not kept: SmolLM2 loads ~540 MB lighter.
- "amx": "hybrid", with longer steps on the AMX tile unit (layers/cpu_amx.py) for weights
  that are exactly Q4_1 values (from AMX_Q4_1_MIN_ROWS tokens) or two bf16 numbers each (from
  AMX_MIN_ROWS): exact products summed in fp32, as accurate as oneDNN's fp32 GEMM. Shorter
  decode-only steps keep the small-M kernel through the layer plan. Those weights keep no
  oneDNN copy; the others do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.huge_pages import to_huge_pages
from tokenmill.layers import cpu_amx
from tokenmill.layers.cpu_gemv import GEMV_MAX_ROWS, GEMV_COMPACT_MAX_ROWS, gemv_supported
from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel

LINEAR_BACKENDS = ("auto", "torch", "onednn", "hybrid", "amx")
# oneDNN picks its blocked layout for an expected batch size; 16 was as good as any other at
# every M from 1 to 512 in a sweep on the target CPU (M is the number of tokens in the step).
_ONEDNN_BATCH_HINT = 16


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": for fp32 on CPU, "amx" where the CPU has the tiles and both kernels compile, else
    "hybrid" when the small-step kernel compiles, else "onednn"; F.linear elsewhere."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend: unknown backend {name!r} "
                         f"(known: {', '.join(LINEAR_BACKENDS)})")
    if name == "auto":
        if not onednn_available(device, dtype):
            return "torch"
        if load_gemv_kernel() is None:
            return "onednn"
        return "amx" if cpu_amx.load_kernel() is not None else "hybrid"
    if name in ("onednn", "hybrid", "amx") and not onednn_available(device, dtype):
        raise ValueError(f"linear_backend: {name!r} needs float32 on CPU with oneDNN, got "
                         f"{dtype} on {torch.device(device).type}")
    if name in ("hybrid", "amx") and load_gemv_kernel() is None:
        raise ValueError(f"linear_backend: {name!r} needs the cpu_gemv kernel, which did not "
                         "compile (see the warning above)")
    if name == "amx" and cpu_amx.load_kernel() is None:
        raise ValueError("linear_backend: 'amx' needs a CPU with AMX bf16 tiles and its kernel "
                         "(see the warning above if it did not compile)")
    return name


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)
        self.packed_weight: torch.Tensor | None = None   # oneDNN layout, set by prepack()
        self.gemv_weight: torch.Tensor | None = None     # cpu_gemv panels, set by prepack()
        #   (none where the compact ones below take every step the kernel takes)
        self.gemv_compact: torch.Tensor | None = None    # the same in Q4_1/Q8_0 blocks, if exact
        self.amx_weight: cpu_amx.AmxWeight | None = None  # cpu_amx bf16 tiles, if exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        rows = x.shape[0]
        if (self.has_gemv_panels and rows <= GEMV_MAX_ROWS
                and (self.amx_weight is None or rows < self.amx_weight.min_rows)):
            panels = self.small_step_panels(rows)
            out = load_gemv_kernel().gemv_linear(x.contiguous(), panels)
            return out if self.bias is None else out.add_(self.bias)
        if self.amx_weight is not None:
            out = cpu_amx.amx_linear(x.contiguous(), self.amx_weight)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight,
                                                      self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def has_gemv_panels(self) -> bool:
        """Whether cpu_gemv takes every step of up to GEMV_MAX_ROWS tokens (prepack keeps
        compact panels alone only where they take all of those)."""
        return self.gemv_weight is not None or self.gemv_compact is not None

    def small_step_panels(self, num_tokens: int) -> torch.Tensor | None:
        """The cpu_gemv panels for a step of `num_tokens` (compact ones for the fewest)."""
        compact = self.gemv_compact
        if compact is not None and num_tokens <= GEMV_COMPACT_MAX_ROWS[compact.dtype]:
            return compact
        return self.gemv_weight

    def prepack(self, gemv: bool = False, compact: bool = False, amx: bool = False) -> None:
        """Reorder the loaded weight for oneDNN (and, with `gemv`, into the small-M kernel's
        panels where its shape allows; with `compact` as well, Q4_1 or Q8_0 panels where they
        rebuild every weight exactly, and then no fp32 panels if those take every step the
        kernel takes; with `amx`, into AMX tiles instead of oneDNN's layout where those hold
        every weight exactly) and drop the plain copy; a weight shared with another module (a
        tied lm_head) lives on there."""
        if gemv and gemv_supported(self.weight):   # streamed whole every decode step
            kernel = load_gemv_kernel()
            if compact:
                self.gemv_compact = _compact_panels(kernel, self.weight.detach())
            covered = (self.gemv_compact is not None
                       and GEMV_COMPACT_MAX_ROWS[self.gemv_compact.dtype] >= GEMV_MAX_ROWS)
            if not covered:   # fp32 panels for the steps compact ones do not take
                self.gemv_weight = to_huge_pages(kernel.pack_gemv_weight(self.weight.detach()))
        if amx:
            self.amx_weight = cpu_amx.pack_amx_weight(self.weight.detach())
        if self.amx_weight is None:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                         _ONEDNN_BATCH_HINT)
        del self.weight
        self.weight = None


class MergedLinear(Linear):
    """Several projections of the same input in one GEMM (q|k|v, gate|up).

    `load_shard(index, w)` fills the rows of part `index`; fewer, larger GEMMs are faster on
    CPU than three small ones.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(part_sizes), bias)
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]

    def load_shard(self, index: int, weight: torch.Tensor, is_bias: bool = False) -> None:
        start, size = self.part_offsets[index], self.part_sizes[index]
        target = self.bias if is_bias else self.weight
        assert target is not None, "checkpoint has a bias this layer does not"
        assert weight.shape[0] == size, f"part {index}: {tuple(weight.shape)} rows != {size}"
        target.data[start:start + size].copy_(weight)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.part_sizes, dim=-1)


def _compact_panels(kernel, weight: torch.Tensor) -> torch.Tensor | None:
    """Q4_1 panels, else Q8_0 ones, if either rebuilds every weight exactly (the packers
    return an empty tensor when not)."""
    for pack in (kernel.pack_gemv_q4, kernel.pack_gemv_q8):
        packed = pack(weight)
        if packed.numel():
            return to_huge_pages(packed)
    return None


def prepack_linears(model: nn.Module, gemv: bool = False, compact: bool = False,
                    amx: bool = False) -> int:
    """Switch every Linear in `model` to the oneDNN path (and with `gemv`, the small-M kernel
    for short steps; `compact`: its compact panels where exact; `amx`: the AMX tiles instead
    of oneDNN where exact); returns how many were packed."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for module in linears:
        module.prepack(gemv, compact, amx)
    return len(linears)
