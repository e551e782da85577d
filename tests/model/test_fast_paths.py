"""The optimized CPU paths (oneDNN packed linears, the AMX tile linears where the CPU has
them, the paged C++ decode kernel, fused norm, rotary and SiLU·mul, the layer plan) give the
same greedy tokens as the pure reference path, across batch sizes, chunked prefill and
prefix-cache hits. HF parity of the default (fast) path is in test_hf_parity.py."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.helpers.gil import longest_stall_beside
from tests.helpers.isa import switched_off
from tests.helpers.oracle import assert_kv_clean
from tokenmill.attention.cpu_paged import load_kernel
from tokenmill.layers import cpu_amx
from tokenmill.layers.cpu_amx import load_kernel as load_amx_kernel
from tokenmill.layers.cpu_fused import load_kernel as load_fused_kernel
from tokenmill.layers.cpu_gemv import GEMV_COMPACT_MAX_ROWS, GEMV_MAX_ROWS
from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel
from tokenmill import SamplingParams
from tokenmill.models.layer_plan import LayerPlan

SYSTEM = ("You are the help desk of a city library. Answer questions about opening hours, "
          "loans, renewals and the reading rooms briefly and politely. ") * 3
PROMPTS = [SYSTEM + q for q in ("When do you open on Sundays?", "Can I renew a loan twice?",
                                "Is there wifi?", "How many books may I borrow at once?")] + [
    "The capital of France is", "def add(a, b):", "Once upon a time there was",
    "1, 2, 3, 5, 8, 13,", "Write a limerick about a cat who learned to code in Python."]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
NO_CHUNKS = (torch.empty(0, 4, dtype=torch.long), torch.empty(0, dtype=torch.long))


@pytest.fixture(scope="module")
def reference_tokens(make_llm):
    reference = make_llm(attention_backend="torch", linear_backend="torch",
                         elementwise_backend="torch")
    model = reference.engine.core.worker.runner.model
    assert model.lm_head.packed_weight is None
    assert model.model.norm.kernel is None and model.model.rotary.kernel is None
    return [[o.outputs[0].token_ids] for o in
            (reference.generate([p], PARAMS)[0] for p in PROMPTS)]


def fast_path_active(llm) -> bool:
    """Every fast path this machine can run is on (the kernel needs a C++ compiler)."""
    model = llm.engine.core.worker.runner.model
    layer = model.model.layers[0]
    kernel = "cpu_paged" if load_kernel() is not None else "torch"
    gemv = load_gemv_kernel() is not None
    fused = load_fused_kernel() is not None
    # the layers' Q4_1 weights and the Q8_0 lm_head go on the AMX tiles (in the factored form)
    # instead of oneDNN's layout where the CPU has them (the layer plan too takes the layers'
    # from AMX_Q4_1_MIN_ROWS rows)
    amx = gemv and load_amx_kernel() is not None
    plan = model.model.layer_plan
    return (layer.self_attn.backend.name == kernel
            and all((m.amx_weight is not None) == amx for m in (layer.mlp.gate_up_proj,
                                                              model.lm_head))
            and (not amx or layer.mlp.gate_up_proj.amx_weight.mins is not None)    # Q4_1
            and (not amx or (model.lm_head.amx_weight.steps is not None            # Q8_0
                             and model.lm_head.amx_weight.mins is None))
            # the loop takes steps of every size the small-M kernel or the tiles take
            and (plan is None or (plan.takes(GEMV_MAX_ROWS) and plan.takes(2048) == amx))
            and all((m.packed_weight is not None) == (not amx) for m in (layer.mlp.gate_up_proj,
                                                                         model.lm_head))
            and layer.mlp.gate_up_proj.has_gemv_panels == gemv
            and model.lm_head.has_gemv_panels == gemv
            # the default model is Q4_1 with a Q8_0 embedding (the tied lm_head)
            and (layer.mlp.gate_up_proj.gemv_compact is not None) == gemv
            and (model.lm_head.gemv_compact is not None) == gemv
            # which then serves as the embedding table, the fp32 one dropped
            and (model.model.embed_tokens.panels is not None) == gemv
            and (model.model.embed_tokens.weight is None) == gemv
            # fp32 panels only for steps the compact ones do not take
            and all((linear.gemv_weight is not None)
                    == (gemv and GEMV_COMPACT_MAX_ROWS[linear.gemv_compact.dtype]
                        < GEMV_MAX_ROWS) for linear in (layer.mlp.gate_up_proj, model.lm_head))
            and (layer.input_layernorm.kernel is not None) == fused
            and (layer.mlp.act.kernel is not None) == fused
            and (model.model.rotary.kernel is not None) == fused
            and (model.model.layer_plan is not None) == (gemv and fused
                                                          and kernel == "cpu_paged"))


@pytest.mark.parametrize("options", [
    {},                                                      # defaults: batched, prefix cache on
    {"max_num_batched_tokens": 40, "max_prefill_chunk": 9},  # chunked prefill, mixed steps
    {"prefix_cache": False, "max_num_seqs": 3},              # small batches, no cache
], ids=["batched", "chunked", "small-batches-no-cache"])
def test_fast_path_greedy_equals_reference(make_llm, reference_tokens, options):
    llm = make_llm(**options)
    assert fast_path_active(llm)
    batched = llm.generate(PROMPTS, PARAMS)
    assert [[o.outputs[0].token_ids] for o in batched] == reference_tokens
    if options.get("prefix_cache", True):
        assert sum(o.num_cached_tokens > 0 for o in batched) >= 3
    assert_kv_clean(llm)


def test_fast_path_one_at_a_time_equals_reference(llm, reference_tokens):
    """Batch size 1 throughout (the M=1 GEMV and kernel paths)."""
    assert fast_path_active(llm)
    single = [[llm.generate([p], PARAMS)[0].outputs[0].token_ids] for p in PROMPTS]
    assert single == reference_tokens


@pytest.mark.parametrize("variant", ["no-bias", "qkv-bias", "tiles", "chunked"])
def test_layer_plan_is_bitwise_the_module_path(make_llm, monkeypatch, variant):
    """Steps through the LayerPlan (decode-only, prefills, and chunked prefills beside
    decodes, over the request's earlier chunks) give exactly the logprobs and prompt logprobs
    of the modules it flattens, at batch 1 and batched (no prefix cache: both runs compute the
    same shapes). SmolLM2 has no q|k|v bias; with one set on every layer (as Qwen2 has), the
    plan must add it as the module does. With AMX tiles from 3 rows, the batched steps run the
    linears on them in both paths (prefills of more than GEMV_MAX_ROWS tokens do anyway where
    the CPU has the tiles)."""
    chunked = {"max_num_batched_tokens": 40, "max_prefill_chunk": 9}
    llm = make_llm(prefix_cache=False, **(chunked if variant == "chunked" else {}))
    model = llm.engine.core.worker.runner.model.model
    if model.layer_plan is None:
        pytest.skip("the layer plan needs the C++ kernels")
    if variant == "tiles":
        if load_amx_kernel() is None:
            pytest.skip("no AMX tiles on this CPU")
        monkeypatch.setattr(cpu_amx, "AMX_Q4_1_MIN_ROWS", 3)
        monkeypatch.setattr(model, "layer_plan", LayerPlan.build(model.layers, model.rotary,
                                                                  model.norm))
        assert model.layer_plan.weights(5)[3].dtype == torch.uint8   # q|k|v's 4-bit levels
    if variant == "qkv-bias":
        gen = torch.Generator().manual_seed(0)
        for layer in model.layers:
            qkv = layer.self_attn.qkv_proj
            bias = torch.nn.Parameter(torch.randn(qkv.out_features, generator=gen) * 0.05,
                                      requires_grad=False)
            monkeypatch.setattr(qkv, "bias", bias)
        monkeypatch.setattr(model, "layer_plan", LayerPlan.build(model.layers, model.rotary,
                                                                  model.norm))
    runs = []   # (decodes, prefill chunks) of each step the plan ran
    original_run = LayerPlan.run
    monkeypatch.setattr(LayerPlan, "run", lambda self, hidden, positions, ctx: runs.append(
        (ctx.attn.num_decodes, len(ctx.attn.prefills))) or original_run(self, hidden, positions,
                                                                         ctx))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)

    prompt_lengths = []   # of the lone prefill and the batched one

    def generate():
        outputs = [llm.generate(PROMPTS[:1], params)[0], *llm.generate(PROMPTS[1:6], params)]
        prompt_lengths[:] = [len(outputs[0].prompt_token_ids),
                             sum(len(o.prompt_token_ids) for o in outputs[1:])]
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                for o in outputs]

    with_plan = generate()
    assert sum(chunks == 0 for _, chunks in runs) >= 2 * 11    # every decode step of both calls
    # and the prefills whose size the loop's kernels take (without AMX tiles, a step of more
    # than GEMV_MAX_ROWS tokens runs oneDNN's GEMM through the modules)
    prefills_in_loop = sum(model.layer_plan.takes(n) for n in prompt_lengths)
    assert prefills_in_loop >= (2 if load_amx_kernel() is not None else 1)
    assert sum(chunks > 0 for _, chunks in runs) >= prefills_in_loop
    if variant == "chunked":                                   # chunks beside decodes
        assert any(decodes > 0 and chunks > 0 for decodes, chunks in runs)
    monkeypatch.setattr(model, "layer_plan", None)
    assert generate() == with_plan
    assert_kv_clean(llm)


def test_compact_panels_leave_tokens_unchanged_and_rebuilt_ones_every_bit(make_llm):
    """The default model's weights are Q4_1/Q8_0 values: steps of up to 12 tokens stream them
    as compact panels. Batches of 1 to 12 requests (both sides of the switch) give the same
    tokens as with fp32 panels only and logprobs within rounding; with the Q4_1 weights
    rebuilt (not factored, where AVX-512 would factor steps of up to 6, 12 on AMD Zen 4 and 5),
    the same logprobs to the bit."""
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=2)
              for i in range(12)]
    prompts = (PROMPTS * 2)[:12]
    runs = {}
    for compact in (True, False):
        llm = make_llm(compact_panels=compact, prefix_cache=False)
        model = llm.engine.core.worker.runner.model
        expected = compact and load_gemv_kernel() is not None
        assert (model.lm_head.gemv_compact is not None) == expected               # Q8_0
        assert (model.model.embed_tokens.panels is not None) == expected   # tied to the lm_head
        assert (model.model.layers[0].mlp.down_proj.gemv_compact is not None) == expected
        modes = ("factored", "rebuilt") if compact else ("fp32",)
        for mode in modes:
            rebuilt = mode == "rebuilt" and load_gemv_kernel() is not None
            with switched_off(load_gemv_kernel().gemv_use_factored) if rebuilt else nullcontext():
                runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                              for o in [llm.generate(prompts[:1], params[0])[0],
                                        *llm.generate(prompts, params)]]
        assert_kv_clean(llm)
    assert runs["rebuilt"] == runs["fp32"]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(runs["factored"], runs["fp32"]):
        assert tokens == want_tokens
        for step, want_step in zip(logprobs, want_logprobs):
            assert step.keys() == want_step.keys()
            for token, entry in step.items():
                assert abs(entry.logprob - want_step[token].logprob) < 1e-3


def test_layer_loop_rejects_bad_steps_before_touching_the_cache(llm):
    """The C++ loop checks its inputs up front: an out-of-range slot, a missing layer's cache
    or a prefill chunk past the step's rows or its block tables is a clear error, not a write
    outside the cache, and the cache is left as it was."""
    model = llm.engine.core.worker.runner.model.model
    runner = llm.engine.core.worker.runner
    plan = model.layer_plan
    if plan is None:
        pytest.skip("the layer plan needs the C++ kernels")
    k_cache = runner.kv_caches[0][0]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    caches = [c for kv in runner.kv_caches for c in kv]
    before = [c.clone() for c in caches[:2]]
    dim = k_cache.shape[3]
    hidden = torch.randn(1, model.norm.weight.shape[0])
    cos, sin = torch.ones(4, dim), torch.zeros(4, dim)   # rotary tables of 4 positions
    table, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)

    def step(slot: int, caches: list, position: int = 0):
        return plan.loop.run_layers(hidden, plan.weights(1), plan.final_norm, caches,
                                    torch.tensor([position]), cos, sin, torch.tensor([slot]), 1,
                                    table, lens, *NO_CHUNKS, plan.eps, plan.heads, plan.kv_heads,
                                    plan.scale, -1, plan.entry_points)

    with pytest.raises(RuntimeError, match="slot out of range"):
        step(num_slots, caches)
    with pytest.raises(RuntimeError, match="2 caches per layer"):
        step(0, caches[:-2])
    with pytest.raises(RuntimeError, match="position 4 past the rotary tables"):
        step(0, caches, position=4)

    def prefill(chunk: list[int], block: int):
        return plan.loop.run_layers(hidden, plan.weights(1), plan.final_norm, caches,
                                    torch.tensor([0]), cos, sin, torch.tensor([0]), 0, table[:0],
                                    lens[:0], torch.tensor([chunk]), torch.tensor([block]),
                                    plan.eps, plan.heads, plan.kv_heads, plan.scale, -1,
                                    plan.entry_points)

    for chunk, block in (([0, 2, 2, 0], 0), ([0, 1, 1, 1], 0), ([0, 1, 1, 0], k_cache.shape[0])):
        with pytest.raises(RuntimeError, match="chunk 0 out of range|block id"):
            prefill(chunk, block)
    assert all(torch.equal(a, b) for a, b in zip(before, caches[:2]))
    assert_kv_clean(llm)


def test_layer_loop_lets_other_threads_run(llm):
    """A whole decode step is one C++ call: it must let the server's event loop run, or a
    token waits for the next step before it is streamed. Own small caches: the engine's are
    left alone."""
    model = llm.engine.core.worker.runner.model.model
    plan = model.layer_plan
    if plan is None:
        pytest.skip("the layer plan needs the C++ kernels")
    k_cache = llm.engine.core.worker.runner.kv_caches[0][0]
    caches = [torch.zeros(2, *k_cache.shape[1:]) for _ in range(2 * plan.num_layers)]
    rows = GEMV_MAX_ROWS   # the longest step the plan takes
    hidden = torch.randn(rows, model.norm.weight.shape[0])
    table = torch.zeros(rows, 1, dtype=torch.int64)
    lens, slots = torch.ones(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    duration, stall = longest_stall_beside(lambda: plan.loop.run_layers(
        hidden, plan.weights(rows), plan.final_norm, caches, slots, plan.rotary.cos,
        plan.rotary.sin, slots, rows, table, lens, *NO_CHUNKS, plan.eps, plan.heads,
        plan.kv_heads, plan.scale, -1, plan.entry_points))
    assert stall < duration / 4, (stall, duration)
