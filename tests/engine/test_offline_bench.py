"""`tokenmill bench offline` end to end: runs, counts tokens right, writes its JSON line."""

from __future__ import annotations

import json

from tokenmill.cli import main


def test_offline_bench_writes_a_json_line(tmp_path, capsys):
    out = tmp_path / "offline.jsonl"
    args = ["bench", "offline", "--num-prompts", "4", "--input-len-min", "20",
            "--input-len-max", "40", "--prefix-len", "32", "--output-len", "6",
            "--kv-cache-memory", "0.1", "--max-model-len", "512", "--json", str(out)]
    assert main(args) == 0
    assert main(args) == 0   # appends
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2
    result = lines[0]
    assert result["num_prompts"] == 4 and result["output_tokens"] == 24
    assert 4 * (32 + 20) <= result["input_tokens"] <= 4 * (32 + 40)
    assert result["output_tok_s"] > 0 and result["num_steps"] >= 6
    # The shared 32-token prefix is two full blocks: later prompts find them cached.
    assert result["prefix_cache_hits"] >= 16
    assert result["prefill_tokens_computed"] < result["input_tokens"]
    assert "output" in capsys.readouterr().out
