"""Offline throughput benchmark: N random prompts through the engine, no server.

Prompts are random token ids of uniformly drawn lengths; outputs have a fixed length
(ignore_eos). Reports output / input tokens per second and the time per engine step, split
into pure-decode steps (with their batch size) and steps that carry prefill.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


@dataclass
class StepRecord:
    seconds: float
    num_tokens: int
    num_requests: int
    num_decodes: int       # requests that computed exactly one token


@dataclass
class OfflineResult:
    num_prompts: int
    input_tokens: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    input_tok_s: float
    num_steps: int
    step_ms_mean: float
    decode_step_ms_p50: float | None
    decode_batch_mean: float | None
    prefix_cache_hit_rate: float
    prefix_cache_hits: int
    prefill_tokens_computed: int
    config: dict = field(default_factory=dict)
    decode_step_ms_by_batch: dict = field(default_factory=dict)


def random_prompts(engine: LLMEngine, num: int, min_len: int, max_len: int,
                   seed: int, prefix_len: int = 0) -> list[list[int]]:
    """Random token prompts; with `prefix_len`, all share one random prefix of that length
    (a system prompt) before their own part of min_len..max_len tokens."""
    rng = random.Random(seed)
    special = set(engine.tokenizer.hf.all_special_ids)
    vocab = [t for t in range(engine.tokenizer.vocab_size) if t not in special]
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num)]


def run_steps(engine: LLMEngine) -> list[StepRecord]:
    records = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        scheduled = engine.core.last_scheduled
        counts = scheduled.num_scheduled_tokens.values()
        records.append(StepRecord(time.perf_counter() - start, scheduled.total_num_scheduled_tokens,
                                  len(counts), sum(1 for c in counts if c == 1)))
    return records


def summarize(records: list[StepRecord], prompts: list[list[int]], output_len: int,
              seconds: float, engine: LLMEngine) -> OfflineResult:
    decode_steps = [r for r in records if r.num_decodes == r.num_requests and r.num_requests]
    by_batch: dict[int, list[float]] = {}
    for r in decode_steps:
        by_batch.setdefault(r.num_requests, []).append(r.seconds * 1000)
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = output_len * len(prompts)
    stats = engine.stats()
    return OfflineResult(
        num_prompts=len(prompts), input_tokens=input_tokens, output_tokens=output_tokens,
        seconds=seconds, output_tok_s=output_tokens / seconds, input_tok_s=input_tokens / seconds,
        num_steps=len(records),
        step_ms_mean=1000 * statistics.fmean(r.seconds for r in records),
        decode_step_ms_p50=(statistics.median(r.seconds for r in decode_steps) * 1000
                            if decode_steps else None),
        decode_batch_mean=(statistics.fmean(r.num_requests for r in decode_steps)
                           if decode_steps else None),
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        prefix_cache_hits=stats.prefix_cache_hits,
        prefill_tokens_computed=sum(r.num_tokens - r.num_decodes for r in records),
        config=engine.config.to_flat() | engine.describe(),
        decode_step_ms_by_batch={b: round(statistics.median(v), 2)
                                 for b, v in sorted(by_batch.items())})


def run_offline(config: EngineConfig, num_prompts: int, min_len: int, max_len: int,
                output_len: int, seed: int, prefix_len: int = 0) -> OfflineResult:
    engine = LLMEngine(config)
    warmup = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    engine.add_request("warmup", [1] * 16, warmup)
    run_steps(engine)
    prompts = random_prompts(engine, num_prompts, min_len, max_len, seed, prefix_len)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    stats_before = engine.stats()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    records = run_steps(engine)
    result = summarize(records, prompts, output_len, time.perf_counter() - start, engine)
    result.prefix_cache_hits -= stats_before.prefix_cache_hits
    return result


def print_result(result: OfflineResult) -> None:
    print(f"prompts {result.num_prompts}: {result.input_tokens} input tokens, "
          f"{result.output_tokens} output tokens in {result.seconds:.2f} s")
    print(f"output {result.output_tok_s:.1f} tok/s | input {result.input_tok_s:.1f} tok/s | "
          f"{result.num_steps} steps, {result.step_ms_mean:.1f} ms/step mean")
    if result.decode_step_ms_p50 is not None:
        print(f"pure-decode steps: p50 {result.decode_step_ms_p50:.1f} ms at mean batch "
              f"{result.decode_batch_mean:.1f}")
    print(f"prefill tokens computed {result.prefill_tokens_computed}; prefix cache hit rate "
          f"{result.prefix_cache_hit_rate:.1%} ({result.prefix_cache_hits} tokens)")


def write_json(result: OfflineResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(asdict(result)) + "\n")
