"""Start-up timing of decode steps, for the draft policy's fixed step cost.

The adaptive draft policy needs F, a decode step's fixed cost in rows' worth
(spec/step_cost.py), and F belongs to the device and the model. Timing the served steps as
they come cannot give it: their row counts and context lengths rise and fall together, and
steps vary by more than a row's cost. So before the engine serves, it runs a small controlled
experiment: decode steps of one request and of `MANY` requests over the same shared
`CONTEXT`-token prompt (computed once, then found in the prefix cache), without drafts, and
fits F from the fastest step at each count. It takes about a second on a 2-core CPU.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.step_cost import fixed_rows_from

if TYPE_CHECKING:
    from tokenmill.engine.core import EngineCore

CONTEXT = 256      # tokens each timed request attends to, a typical chat context
SHORT_CONTEXT = 32  # the same without a prefix cache, where each request computes its own
MANY = 16          # rows of the larger timed steps
STEPS = 8          # timed decode steps per request set (the first, warming up, not counted)
ROUNDS = 2


def measure_fixed_rows(core: EngineCore) -> float | None:
    """F for this engine's device and model, or None where its limits leave no room for the
    experiment. Runs requests through `core`, which must be idle and without a drafter; its
    KV pool is left as found, bar the timed requests' cached blocks."""
    config, kv = core.config.scheduler, core.kv
    # without a prefix cache every request computes its whole prompt: keep it short
    context = min(CONTEXT if kv.prefix_cache else SHORT_CONTEXT, core.max_model_len - STEPS - 3)
    held = -(-(context + STEPS + 2) // kv.block_size)      # blocks one timed request holds
    shared = context // kv.block_size if kv.prefix_cache else 0
    room = (kv.num_blocks - shared) // (held - shared + 1)
    many = min(MANY, config.max_num_seqs, config.max_num_batched_tokens, room)
    if many < 2 or context < 1:
        return None
    vocab = core.worker.spec.vocab_size
    prompt = [(7 + 31 * i) % vocab for i in range(context)]
    times: dict[int, list[float]] = {1: [], many: []}
    for _ in range(ROUNDS):   # alternating, so a slow moment of the machine hits both
        for rows in times:
            times[rows] += _decode_step_times(core, prompt, rows)
    return fixed_rows_from(times) if all(times.values()) else None


def _decode_step_times(core: EngineCore, prompt: list[int], rows: int) -> list[float]:
    params = SamplingParams(max_tokens=STEPS + 1, ignore_eos=True, temperature=0)
    for i in range(rows):
        core.add_request(Request(f"calibration-{rows}-{i}", prompt + [i], params, frozenset(),
                                 seed=0, max_tokens=STEPS + 1, cache_salt="calibration"))
    times = []
    while core.has_unfinished:
        start = time.perf_counter()
        core.step()
        seconds = time.perf_counter() - start
        scheduled = core.last_scheduled
        if scheduled.is_decode_only and scheduled.total_num_scheduled_tokens == rows:
            times.append(seconds)
    core.step()   # hands the finished requests' ids to the worker, which drops their state
    return times[1:] or times
