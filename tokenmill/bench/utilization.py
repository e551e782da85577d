"""How much of the machine a serve run used: model-FLOPs utilization (MFU) against an fp32 GEMM
peak, and for one stream at a time memory-bandwidth utilization (MBU) against a copy bandwidth.

`tokenmill bench peak` measures the two ceilings on this machine (the best of torch.mm and
oneDNN's packed linear, and a tensor copy, on all of torch's threads); `tokenmill bench serve
--peak-gflops G --peak-gbps B` then reports, for the served model's shapes (its ModelSpec):
- MFU = tokens processed per second (prompt tokens the server computed, i.e. not served from
  its prefix cache when it reports that, plus output tokens) x 2 x the linears' weights a
  token passes through (lm_head included) / G. Attention's FLOPs are left out (they grow
  with the context): the figure is the weights' share of the work.
- MBU (concurrency 1 only: a lone stream reads every weight per token) = output tokens per
  second x (weight bytes + the mean context x K and V bytes per token) / B. The weight bytes
  default to fp32 (4 a weight); a server that streams smaller weights reads fewer, so pass
  --weight-bytes for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.bench.metrics import RequestRecord
from tokenmill.models.spec import ModelSpec, spec_from_hf_config


@dataclass(frozen=True)
class ModelCost:
    params: int                 # weights of the linears one token passes through
    kv_bytes_per_token: int     # fp32 K and V of one token over all layers

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "ModelCost":
        h, d = spec.hidden_size, spec.head_dim
        attention = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
        mlp = 3 * h * spec.intermediate_size
        return cls(params=spec.num_layers * (attention + mlp) + spec.vocab_size * h,
                   kv_bytes_per_token=spec.kv_elements_per_token * 4)   # fp32

    @property
    def flops_per_token(self) -> int:
        return 2 * self.params


def model_cost(model: str | None) -> ModelCost:
    """The cost of `model` (a known name, a .gguf file or a Hugging Face directory; None:
    tokenmill's default model), from its architecture alone (no weights loaded)."""
    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.models.gguf_loader import open_gguf, spec_from_gguf
    from tokenmill.models_hub import resolve
    source = resolve(model or DEFAULT_MODEL)
    spec = (spec_from_gguf(open_gguf(source.path)) if source.kind == "gguf"
            else spec_from_hf_config(source.path))
    return ModelCost.from_spec(spec)


@dataclass(frozen=True)
class Ceilings:
    gemm_gflops: float | None = None   # fp32 GEMM peak: MFU
    copy_gbps: float | None = None     # copy bandwidth: MBU (concurrency 1)


def mean_context(records: list[RequestRecord]) -> float | None:
    """The context an output token was computed over, averaged over every output token of the
    finished requests (a request of p prompt tokens and n outputs: p, p + 1, ... p + n - 1)."""
    tokens = weighted = 0
    for record in records:
        n = record.output_tokens
        if not record.ok or n <= 0:
            continue
        tokens += n
        weighted += n * record.prompt_len + n * (n - 1) / 2
    return weighted / tokens if tokens else None


def utilization(result: dict, records: list[RequestRecord], cost: ModelCost,
                ceilings: Ceilings, weight_bytes: float | None = None) -> dict:
    """The run's MFU (given a GEMM peak) and MBU (given a copy bandwidth, at concurrency 1)
    from its result line and records; a figure without its ceiling is None."""
    cache = result.get("server_prefix_cache") or {}
    computed_prompt = max(0, result["input_tokens"] - cache.get("hits", 0))
    duration = result["duration_s"]
    processed = (computed_prompt + result["output_tokens"]) / duration if duration else 0.0
    peak = ceilings.gemm_gflops
    figures = {"processed_tok_s": processed, "flops_per_token": cost.flops_per_token,
               "gemm_gflops": peak,
               "mfu": processed * cost.flops_per_token / (peak * 1e9) if peak else None,
               "copy_gbps": ceilings.copy_gbps, "weight_bytes": None,
               "decode_bytes_per_token": None, "mbu": None}
    context = mean_context(records)
    if result["settings"]["concurrency"] == 1 and ceilings.copy_gbps and context is not None:
        weights = 4.0 * cost.params if weight_bytes is None else weight_bytes
        per_token = weights + context * cost.kv_bytes_per_token
        figures.update(weight_bytes=weights, decode_bytes_per_token=per_token,
                       mbu=result["output_tok_s"] * per_token / (ceilings.copy_gbps * 1e9))
    return figures


def _best_gflops(run, flops: float, rounds: int) -> float:
    run()   # warm: first-call packing and page faults are not the machine's rate
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best


def _gemm_candidates(size: int):
    """(label, run, flops) of the fp32 GEMMs torch has here: torch.mm (MKL on x86 builds)
    and, where torch has oneDNN, its linear on a weight prepacked as the engine's Linear packs
    it. On an AMD Zen 4 torch.mm peaked at 185-191 GFLOP/s where oneDNN's packed linear ran
    the same product at 221-223: a peak from torch.mm alone overstated every MFU there."""
    import torch
    for m, k, n in ((size, size, size), (size, 576, 3072)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        yield f"{m}x{k}x{n}", (lambda a=a, b=b, out=out: torch.mm(a, b, out=out)), 2.0 * m * k * n
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        return
    x, weight = torch.randn(size, 576), torch.randn(3072, 576)
    try:
        packed = reorder(weight, 16)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:   # a build whose oneDNN cannot pack fp32 weights
        return
    yield (f"{size}x576x3072 oneDNN packed",
           lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
           2.0 * size * 576 * 3072)


def measure_ceilings(rounds: int = 5, size: int = 2048, copy_mb: int = 256) -> dict:
    """This machine's fp32 GEMM peak (the best of `rounds` over torch.mm of `size`-square
    matrices and of a transformer-like [size, 576] x [576, 3072], and oneDNN's linear of that
    shape on a prepacked weight) and its copy bandwidth (a `copy_mb` MB tensor copied, far
    beyond the caches; as STREAM counts Copy, the bytes read plus the bytes written per
    second)."""
    import torch
    best_gemm, best_shape = 0.0, ""
    for label, run, flops in _gemm_candidates(size):
        gflops = _best_gflops(run, flops, rounds)
        if gflops > best_gemm:
            best_gemm, best_shape = gflops, label
    src = torch.ones(copy_mb * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        best_copy = max(best_copy, 2 * src.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return {"gemm_gflops": best_gemm, "gemm_shape": best_shape, "copy_gbps": best_copy,
            "threads": torch.get_num_threads()}
