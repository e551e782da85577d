"""Utilization figures of the bench: the model's cost from its shapes (checked against the
Hugging Face model's own linears), the mean decode context, MFU/MBU arithmetic, the ceilings."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.utilization import (Ceilings, ModelCost, mean_context, measure_ceilings,
                                         model_cost, utilization)
from tokenmill.cli import main


def test_the_cost_counts_every_linear_a_token_passes_through(hf_oracle):
    cost = model_cost(None)   # tokenmill's default model, the oracle's weights
    linears = [m for m in hf_oracle.modules() if isinstance(m, torch.nn.Linear)]
    assert cost.params == sum(m.weight.numel() for m in linears)   # lm_head included
    assert cost.flops_per_token == 2 * cost.params
    config = hf_oracle.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert cost.kv_bytes_per_token == (2 * config.num_hidden_layers
                                       * config.num_key_value_heads * head_dim * 4)


def _done(prompt: int, outputs: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(input_len=prompt + 5, prompt_tokens=prompt, output_tokens=outputs,
                         start=0.0, first_token=0.1, end=0.2 if ok else None)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 300), st.booleans()),
                max_size=12))
def test_mean_context_averages_every_output_tokens_context(requests):
    records = [_done(p, n, ok) for p, n, ok in requests]
    contexts = [p + i for p, n, ok in requests if ok for i in range(n)]
    expected = sum(contexts) / len(contexts) if contexts else None
    assert mean_context(records) == pytest.approx(expected)


def _result(concurrency: int, hits: int | None) -> dict:
    return {"input_tokens": 1000, "output_tokens": 500, "duration_s": 10.0,
            "output_tok_s": 50.0, "settings": {"concurrency": concurrency},
            "server_prefix_cache": None if hits is None else {"hits": hits, "queries": 1000}}


def test_mfu_counts_the_prompt_tokens_the_server_computed():
    cost = ModelCost(params=1_000_000, kv_bytes_per_token=1000)
    use = utilization(_result(16, hits=600), [_done(100, 50)], cost, Ceilings(gemm_gflops=1.0))
    assert use["processed_tok_s"] == pytest.approx((1000 - 600 + 500) / 10.0)
    assert use["mfu"] == pytest.approx(90.0 * 2e6 / 1e9)
    assert use["mbu"] is None                 # many streams share each weight read
    plain = utilization(_result(16, hits=None), [], cost, Ceilings(gemm_gflops=1.0))
    assert plain["processed_tok_s"] == pytest.approx(150.0)   # no counters: all computed


def test_mbu_of_a_lone_stream_reads_the_weights_and_its_context():
    cost = ModelCost(params=1_000_000, kv_bytes_per_token=1000)
    records = [_done(100, 3), _done(200, 1)]   # contexts 100, 101, 102, 200: mean 125.75
    use = utilization(_result(1, hits=None), records, cost, Ceilings(copy_gbps=2.0))
    assert use["mfu"] is None                 # no GEMM peak given
    assert use["weight_bytes"] == 4e6 and use["decode_bytes_per_token"] == 4e6 + 125750
    assert use["mbu"] == pytest.approx(50.0 * (4e6 + 125750) / 2e9)
    compact = utilization(_result(1, hits=None), records, cost, Ceilings(copy_gbps=2.0),
                          weight_bytes=1e6)
    assert compact["mbu"] == pytest.approx(50.0 * (1e6 + 125750) / 2e9)


def test_the_ceilings_are_measured(tmp_path, capsys):
    small = measure_ceilings(rounds=1, size=256, copy_mb=16)
    assert small["gemm_gflops"] > 0 and small["copy_gbps"] > 0
    assert small["gemm_shape"] in ("256x256x256", "256x576x3072", "256x576x3072 oneDNN packed")
    assert small["threads"] == torch.get_num_threads()
    out = tmp_path / "peak.jsonl"
    assert main(["bench", "peak", "--rounds", "1", "--json", str(out)]) == 0
    [line] = [json.loads(text) for text in out.read_text().splitlines()]
    assert f"{line['gemm_gflops']:.1f} GFLOP/s" in capsys.readouterr().out
    assert line["copy_gbps"] > 0 and line["date"]


def test_bad_utilization_flags_are_named(tmp_path, capsys):
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--workload", "decode1"]
    for flag in ("--peak-gflops", "--peak-gbps", "--weight-bytes"):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, flag, "0"])
        assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert main(["bench", "peak", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err
    missing = str(tmp_path / "no-such-model.gguf")
    assert main([*base, "--peak-gflops", "100", "--model-shapes", missing]) == 2
    assert "--model-shapes" in capsys.readouterr().err
