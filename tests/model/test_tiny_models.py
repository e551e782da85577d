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
    # with the C++ kernels, the decode steps above ran through the DecodePlan, so q/k/v bias,
    # the sliding window and RoPE scaling are checked on it too
    kernels = all(k.load() is not None for k in (cpu_paged.KERNEL, cpu_fused.KERNEL,
                                                  cpu_gemv.KERNEL))
    assert (llm.engine.core.worker.runner.model.model.decode_plan is not None) == kernels
    assert_kv_clean(llm)


def test_unknown_architecture_lists_supported(tmp_path, default_model):
    write_tiny_model(tmp_path, "llama", default_model.tokenizer_dir)
    config = (tmp_path / "config.json").read_text().replace("LlamaForCausalLM", "FancyNetLM")
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"model: architecture 'FancyNetLM' is not supported "
                                         r"\(supported: .*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(model=str(tmp_path), num_kv_blocks=128, block_size=4)
