"""Tiny random-weight Llama / Qwen2 / Mistral checkpoints (HF directories) against transformers.

They cover what the default model does not: untied lm_head, Llama 3 RoPE scaling, q/k/v bias,
sliding-window attention, and loading Hugging Face safetensors directories.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers.oracle import assert_kv_clean, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.attention import cpu_paged
from tokenmill.layers import cpu_fused, cpu_gemv

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.3, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
}
NUM_TOKENS = 48


def write_tiny_model(directory, variant: str, tokenizer_dir) -> torch.nn.Module:
    import transformers
    config_name, model_name, extra = VARIANTS[variant]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():   # transformers initializes biases to zero: make q/k/v bias count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.3)
    model.save_pretrained(directory)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, directory / item.name)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_model_matches_transformers(variant, tmp_path, default_model):
    reference = write_tiny_model(tmp_path, variant, default_model.tokenizer_dir)
    llm = LLM(model=str(tmp_path), num_kv_blocks=128, block_size=4, max_num_batched_tokens=16)
    prompts = [list(range(100, 100 + n)) for n in (5, 13, 37)]  # 37 > the sliding window
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        tokens, logprobs = hf_greedy(reference, prompt, NUM_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == tokens
        got_logprobs = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs)) < 1e-3
    # with the C++ kernels, the decode steps above ran through the LayerPlan, so q/k/v bias,
    # the sliding window and RoPE scaling are checked on it too
    kernels = all(k.load() is not None for k in (cpu_paged.KERNEL, cpu_fused.KERNEL,
                                                  cpu_gemv.KERNEL))
    assert (llm.engine.core.worker.runner.model.model.layer_plan is not None) == kernels
    assert_kv_clean(llm)


def test_unknown_architecture_lists_supported(tmp_path, default_model):
    write_tiny_model(tmp_path, "llama", default_model.tokenizer_dir)
    config = (tmp_path / "config.json").read_text().replace("LlamaForCausalLM", "FancyNetLM")
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"model: architecture 'FancyNetLM' is not supported "
                                         r"\(supported: .*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(model=str(tmp_path), num_kv_blocks=128, block_size=4)


def round_to_q8_0(model: torch.nn.Module) -> None:
    """Every 2-D weight as GGUF Q8_0 values: d * q, q in -127..127, a d (fp16) for each 32
    inputs of a row, with 127 in every block (so d is the block's largest value over 127)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() != 2 or param.shape[1] % 32:
                continue
            blocks = param.view(param.shape[0], -1, 32)
            step = (blocks.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-4).half().float()
            levels = (blocks / step).round().clamp(-127, 127)
            levels[..., :1] = 127
            blocks.copy_(levels * step)


def test_q8_0_weights_on_the_tiles_in_the_layer_loop_match_transformers(tmp_path,
                                                                         default_model,
                                                                         monkeypatch):
    """A model whose linears are Q8_0 values takes them on the AMX tiles in the factored
    form with no minimums (from 3 rows here, so the batch's decode steps run them in the C++
    layer loop): greedy tokens equal to transformers', logprobs close, and the layer loop
    bitwise the modules it flattens."""
    from tokenmill.layers import cpu_amx
    from tokenmill.models.layer_plan import LayerPlan
    if cpu_amx.load_kernel() is None:
        pytest.skip("no AMX tiles on this CPU (or no C++ compiler)")
    monkeypatch.setattr(cpu_amx, "AMX_Q8_0_MIN_ROWS", 3)
    reference = write_tiny_model(tmp_path, "llama", default_model.tokenizer_dir)
    round_to_q8_0(reference)
    reference.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=128, block_size=4, prefix_cache=False)
    model = llm.engine.core.worker.runner.model.model
    down = model.layers[0].mlp.down_proj.amx_weight
    assert down is not None and down.steps is not None and down.mins is None   # Q8_0 records
    assert model.layer_plan.weights(5)[3].dtype == torch.int8   # q|k|v's byte records
    prompts = [list(range(100 + 7 * i, 110 + 7 * i)) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    runs = []
    original_run = LayerPlan.run
    monkeypatch.setattr(LayerPlan, "run",
                        lambda self, *args: runs.append(args[0].shape[0]) or original_run(self,
                                                                                          *args))
    with_plan = llm.generate(prompts, params)
    assert 5 in runs   # the batched decode steps ran in the loop, on the tiles
    for prompt, out in zip(prompts, with_plan):
        tokens, logprobs = hf_greedy(reference, prompt, 16)
        got = out.outputs[0]
        assert got.token_ids == tokens
        got_logprobs = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs)) < 1e-3
    monkeypatch.setattr(model, "layer_plan", None)
    without = llm.generate(prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in without] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in with_plan]
    assert_kv_clean(llm)
