"""Worker: owns the device, the model and the KV cache memory; runs steps through ModelRunner."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.models.loader import load_model
from tokenmill.models.spec import ModelSpec
from tokenmill.outputs import RunnerOutput, SchedulerOutput
from tokenmill.worker.host_memory import keep_freed_memory, release_freed_memory
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GIB = 1024 ** 3


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, kind: str,
                 path: Path, eos_token_ids: frozenset[int]) -> None:
        if model_config.num_threads:
            torch.set_num_threads(model_config.num_threads)
        self.device = torch.device(model_config.device)
        keep_freed_memory()  # before the model and KV cache: every host buffer benefits
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.cache_config = cache_config
        model, self.spec, self.max_model_len = load_model(
            kind, path, self.dtype, self.device, model_config.max_model_len,
            model_config.attention_backend, model_config.linear_backend,
            model_config.elementwise_backend, model_config.compact_panels)
        # The tokenizer's EOS and the model's (generation config / GGUF) all end a request.
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(self.spec.eos_token_ids)
        self.runner = ModelRunner(model, self.spec, cache_config.block_size, self.device,
                                  self.dtype, self.eos_token_ids)
        release_freed_memory()  # the loader's unpacked weights, before the KV cache is sized
        self.num_kv_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks)

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.cache_config.block_size * self.spec.kv_elements_per_token * element

    def _num_kv_blocks(self) -> int:
        config = self.cache_config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory * _GIB
        else:
            budget = available_memory(self.device) * config.kv_cache_memory_fraction
        num = int(budget // self.bytes_per_block)
        if num < 1:
            raise ValueError(f"kv_cache_memory: {budget / _GIB:.4f} GiB holds no KV block "
                             f"({self.bytes_per_block} bytes each)")
        return num

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(scheduled)


def spec_summary(spec: ModelSpec) -> str:
    return (f"{spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, vocab {spec.vocab_size}")
