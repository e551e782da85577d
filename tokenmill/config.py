"""Engine configuration: frozen dataclasses, validated once; the CLI flags are derived from them.

Each field carries its help text (and choices) in its metadata, so `tokenmill serve --help` and
`LLM(**kwargs)` speak the same names. Leaf module: imports nothing internal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt(DEFAULT_MODEL, "model: a known name (see `tokenmill pull --list`), a .gguf "
                      "file or a Hugging Face directory")
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model's own)")
    dtype: str = _opt("auto", "compute dtype ('auto': float32 on CPU, bfloat16 on CUDA)",
                      ("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("cpu", "torch device to run on (cpu, cuda, cuda:1, ...)")
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens (default: the "
                                     "model's context length)")
    seed: int = _opt(0, "seed for requests that do not set one")
    num_threads: int | None = _opt(None, "CPU threads for torch (default: all cores)")
    attention_backend: str = _opt("auto", "attention kernels ('auto': the paged C++ CPU kernel "
                                  "for float32 on CPU when it compiles, else the torch "
                                  "reference)", ("auto", "torch", "cpu_paged"))
    linear_backend: str = _opt("auto", "linear layers ('auto': 'amx' for float32 on a CPU with "
                               "AMX tiles, else 'hybrid' for float32 on CPU, else F.linear; "
                               "'hybrid': oneDNN packed weights plus a small-batch kernel, "
                               "twice the weight memory; 'amx': 'hybrid' with long steps on "
                               "the AMX tiles, for weights that are exactly two bf16 numbers "
                               "each (exact products, fp32 sums); 'onednn': oneDNN only)",
                               ("auto", "torch", "onednn", "hybrid", "amx"))
    compact_panels: bool = _opt(True, "with the 'hybrid' or 'amx' linears, also keep weights "
                                "that are exactly GGUF Q4_1 or Q8_0 values (as such a model "
                                "loads) in their blocks for short steps: a sixth (Q4_1) or "
                                "27% (Q8_0) of the bytes to stream, the same fp32 values "
                                "(steps of up to 6 tokens on AVX-512, one on AVX2, in the "
                                "factored form d (q.x) (+ m sum x): as accurate, not bit for "
                                "bit)")
    elementwise_backend: str = _opt("auto", "RMSNorm, rotary and SiLU·mul ('auto': fused C++ "
                                    "kernels for float32 on CPU when they compile, else "
                                    "torch ops)",
                                    ("auto", "torch", "cpu_fused"))

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must not be empty")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 f"must be >= 1, got {self.max_model_len}")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                 f"must be >= 1, got {self.num_threads}")
        _require(self.attention_backend in ("auto", "torch", "cpu_paged"), "attention_backend",
                 f"must be 'auto', 'torch' or 'cpu_paged', got {self.attention_backend!r}")
        _require(self.linear_backend in ("auto", "torch", "onednn", "hybrid", "amx"),
                 "linear_backend", "must be 'auto', 'torch', 'onednn', 'hybrid' or 'amx', got "
                 f"{self.linear_backend!r}")
        _require(self.elementwise_backend in ("auto", "torch", "cpu_fused"),
                 "elementwise_backend", f"must be 'auto', 'torch' or 'cpu_fused', got "
                 f"{self.elementwise_backend!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_memory: float | None = _opt(None, "KV cache size in GiB (default: a fraction of free "
                                         "memory, see --kv-cache-memory-fraction)")
    kv_cache_memory_fraction: float = _opt(0.2, "fraction of free memory given to the KV cache "
                                           "when --kv-cache-memory is not set")
    num_kv_blocks: int | None = _opt(None, "exact number of KV blocks (overrides the memory "
                                     "settings; for tests and tuning)")
    prefix_cache: bool = _opt(True, "reuse the KV cache of shared prompt prefixes (radix tree)")

    def __post_init__(self) -> None:
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", f"must be a power of two, got {self.block_size}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
                 f"must be > 0 GiB, got {self.kv_cache_memory}")
        _require(0 < self.kv_cache_memory_fraction <= 0.95, "kv_cache_memory_fraction",
                 f"must be in (0, 0.95], got {self.kv_cache_memory_fraction}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
                 f"must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    # 2048, with a 512-token idle step (below), since the twenty-third session. On the 2-core
    # Ice Lake a burst of 16 prompts (random's first wave, offline) got its last first token
    # 10-17% sooner in 2048-token steps than in 512-token ones; served, against the 512 budget
    # alone, random's TTFT p99 was lower on all seven seeds (0.70-0.94x), tok/s mostly higher
    # and p50 about the same; prose's TTFT p50 rose from ~0.5x to ~0.9x of vLLM's (a new
    # prompt waits for a longer step) (docs/benchmarks.md section 4). Earlier: 512 over 256 on an
    # AVX-512 Xeon (random 199.0 against 191.0 tok/s, TTFT p99 3.65 / 4.21 s).
    max_num_batched_tokens: int = _opt(2048, "token budget of one engine step (prefill chunks + "
                                       "decodes); only a prompt of unchunked_prefill_min "
                                       "tokens or more may exceed it")
    max_num_seqs: int = _opt(64, "most requests running at once")
    max_prefill_chunk: int | None = _opt(None, "most prompt tokens one request computes in a "
                                         "step (default: the whole step budget), except a "
                                         "prompt of unchunked_prefill_min tokens or more")
    # 2048: a 3000-token prompt in 256-token chunks stalled 8 decoding streams 12 times, about
    # 1 s each (5% of their gaps, so their ITL p99 was a stall: 969 ms); in one step it stalls
    # them once, for 8.7 s (ITL p99 82 ms), and the prompt's TTFT fell from 10.2 to 8.7 s. The
    # total stall is no longer either way; vLLM's default here stalls once too (7.2 s).
    unchunked_prefill_min: int = _opt(2048, "prefill a prompt with at least this many tokens "
                                      "left to compute in one step, past the token budget: "
                                      "running streams stall once for it instead of once per "
                                      "chunk (0: chunk every prompt)")
    # 512 under the 2048 budget: the first step of a burst stays short, so the head of the
    # queue answers as soon as with a 512 budget, and the rest of the burst shares larger,
    # faster steps. Larger than the budget (seventh session, 2048 over 256): random's TTFT
    # p50 1.22 -> 2.71 s, tok/s 150 -> 139. Fourteenth session (512 under 2048 against 512
    # alone, AVX-512 Xeon, 8 seeds against vLLM): TTFT p99 1.025x (1.09x), p50 0.97x (0.81x),
    # worst stall 1.7-1.9 s (0.5-0.6 s), as vLLM's; the other workloads unchanged.
    # Smaller, it bounds the prompts that join the head of the queue, not the head's own
    # prompt (cut, a 1,056-token shared_prefix prompt took three steps while fifteen requests
    # waited for its prefix).
    idle_batched_tokens: int = _opt(512, "token budget of a step in which no running request "
                                    "has output yet: larger, prompts arriving together share "
                                    "a step; smaller, the first of a burst answers sooner (its "
                                    "own prompt is not cut below a full step's chunk) and "
                                    "the rest take max_num_batched_tokens once a request "
                                    "streams (0: always max_num_batched_tokens)")
    policy: str = _opt("fcfs", "waiting-queue order: first come first served; by request "
                       "priority (lower value first, ties by arrival); or 'lpm', longest cached "
                       "prefix first (bounded so none starves)", ("fcfs", "priority", "lpm"))

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_prefill_chunk is None or self.max_prefill_chunk >= 1,
                 "max_prefill_chunk", f"must be >= 1, got {self.max_prefill_chunk}")
        _require(self.unchunked_prefill_min >= 0, "unchunked_prefill_min",
                 f"must be >= 0, got {self.unchunked_prefill_min}")
        _require(self.idle_batched_tokens >= 0, "idle_batched_tokens",
                 f"must be >= 0, got {self.idle_batched_tokens}")
        _require(self.policy in ("fcfs", "priority", "lpm"), "policy",
                 f"must be 'fcfs', 'priority' or 'lpm', got {self.policy!r}")

    @property
    def chunk_cap(self) -> int:
        return min(self.max_prefill_chunk or self.max_num_batched_tokens,
                   self.max_num_batched_tokens)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: drafts the model checks in the step that would have made one
    token; the sampler decides each position as it would have without them, so outputs are
    unchanged (seeded sampling included) and every accepted draft saves a step."""
    num_speculative_tokens: int = _opt(0, "draft tokens proposed per decoding request and step "
                                       "by n-gram lookup in its own prompt and output (0: off)")
    prompt_lookup_min: int = _opt(2, "shortest suffix of a request's tokens the n-gram "
                                  "proposer looks for in its history")
    prompt_lookup_max: int = _opt(4, "longest suffix the n-gram proposer looks for (it tries "
                                  "the longest first)")
    draft_policy: str = _opt("adaptive", "which proposed drafts a step checks: adaptive (those "
                             "whose measured chance of being kept pays for the rows they add "
                             "to the step) or all")
    draft_fixed_cost: float | None = _opt(None, "a decode step's fixed cost in rows' worth, "
                                          "which the adaptive policy weighs drafts against "
                                          "(default: timed at start-up, about a second; 5 "
                                          "where the KV cache or limits leave no room)")

    def __post_init__(self) -> None:
        _require(self.num_speculative_tokens >= 0, "num_speculative_tokens",
                 f"must be >= 0, got {self.num_speculative_tokens}")
        _require(self.prompt_lookup_min >= 1, "prompt_lookup_min",
                 f"must be >= 1, got {self.prompt_lookup_min}")
        _require(self.draft_policy in ("adaptive", "all"), "draft_policy",
                 f"must be 'adaptive' or 'all', got {self.draft_policy!r}")
        _require(self.draft_fixed_cost is None or self.draft_fixed_cost >= 0,
                 "draft_fixed_cost", f"must be >= 0, got {self.draft_fixed_cost}")
        _require(self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
                 f"must be >= prompt_lookup_min ({self.prompt_lookup_min}), got "
                 f"{self.prompt_lookup_max}")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpecConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    speculative: SpecConfig = dataclasses.field(default_factory=SpecConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (`max_num_seqs=8, block_size=32, ...`)."""
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        owner = {f.name: section for section, klass in SECTIONS.items()
                 for f in dataclasses.fields(klass)}
        for key, value in kwargs.items():
            if key not in owner:
                raise ValueError(f"{key}: unknown engine option (known: {', '.join(sorted(owner))})")
            by_section[owner[key]][key] = value
        return cls(**{name: SECTIONS[name](**vals) for name, vals in by_section.items()})

    def to_flat(self) -> dict[str, Any]:
        return {f.name: getattr(getattr(self, section), f.name)
                for section, klass in SECTIONS.items() for f in dataclasses.fields(klass)}
