"""Workload plans: exact token lengths under the served model's tokenizer, determinism."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.serve import BenchSettings, build_warmup
from tokenmill.bench.workloads import WorkloadArgs, build_plan, parse_len


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from tokenmill.bench.workloads import HFTextTokenizer
    return HFTextTokenizer(default_model.tokenizer_dir)


def _count(tokenizer, session, turn):
    return len(tokenizer.encode((session.system or "") + turn.text))


def test_prompts_have_exact_token_lengths(tokenizer):
    plan = build_plan("random", WorkloadArgs(num_requests=6, input_len=(5, 300)), tokenizer)
    assert plan.concurrency == 16 and len(plan.sessions) == 6
    for session in plan.sessions:
        turn = session.turns[0]
        assert _count(tokenizer, session, turn) == turn.input_len
        assert 5 <= turn.input_len <= 300 and 64 <= turn.output_len <= 256


def test_prose_prompts_are_documentation_passages_within_the_length(tokenizer):
    args = WorkloadArgs(num_requests=5, input_len=(40, 200), output_len=(30, 30), seed=3)
    plan = build_plan("prose", args, tokenizer)
    assert plan.endpoint == "chat" and plan.concurrency == 16
    texts = []
    for session in plan.sessions:
        turn = session.turns[0]
        assert not turn.exact_len and turn.output_len == 30
        assert turn.input_len == len(tokenizer.encode(turn.text)) and turn.input_len <= 200
        task, _, passage = turn.text.partition("\n\n")
        assert task.endswith(".") and len(passage.split()) > 5
        texts.append(turn.text)
    assert len(set(texts)) == 5
    assert [s.turns[0].text for s in build_plan("prose", args, tokenizer).sessions] == texts
    with pytest.raises(ValueError, match="input length 10"):
        build_plan("prose", WorkloadArgs(num_requests=1, input_len=(10, 10)), tokenizer)


def test_shared_prefix_and_long_interference_shapes(tokenizer):
    plan = build_plan("shared_prefix", WorkloadArgs(num_requests=3, prefix_len=100,
                                                    input_len=(7, 7)), tokenizer)
    assert len({s.system for s in plan.sessions}) == 1
    assert len({s.turns[0].text for s in plan.sessions}) == 3
    assert all(_count(tokenizer, s, s.turns[0]) == 107 for s in plan.sessions)
    plan = build_plan("long_interference", WorkloadArgs(num_requests=2, long_len=600), tokenizer)
    groups = [s.group for s in plan.sessions]
    assert groups == ["stream", "stream", "long"] and plan.sessions[-1].after_first_tokens
    assert _count(tokenizer, plan.sessions[-1], plan.sessions[-1].turns[0]) == 600


def test_plans_are_deterministic_under_seed(tokenizer):
    def texts(seed):
        plan = build_plan("multiturn", WorkloadArgs(num_requests=2, num_turns=3, seed=seed),
                          tokenizer)
        return [t.text for s in plan.sessions for t in s.turns]
    assert texts(1) == texts(1) and texts(1) != texts(2) and len(texts(1)) == 6


def test_warmup_never_caches_a_measured_runs_system_prompt(tokenizer):
    # Seeds are run one after another on one server: no warm-up may share the system prompt
    # of a nearby seed's measured run, or that run measures a warm prefix cache.
    def sizes(seed):
        return WorkloadArgs(seed=seed, num_requests=3, prefix_len=48, input_len=(4, 4))
    measured = {build_plan("shared_prefix", sizes(seed), tokenizer).sessions[0].system
                for seed in range(8)}
    assert len(measured) == 8
    for seed in range(1, 4):
        warm = build_warmup(BenchSettings("http://unused", "shared_prefix", warmup=2,
                                          sizes=sizes(seed)), tokenizer)
        assert len(warm.sessions) == 2 and warm.sessions[0].system not in measured
    assert build_warmup(BenchSettings("http://unused", "random", sizes=sizes(1)),
                        tokenizer) is None


def test_trace_file(tokenizer, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(e) for e in [
        {"prompt_len": 20, "output_len": 5, "arrival_time": 10.5},
        {"prompt": " hello world", "output_len": 3, "arrival_time": 10.0}]) + "\n")
    plan = build_plan("trace", WorkloadArgs(trace=trace), tokenizer)
    assert [s.arrival for s in plan.sessions] == [0.0, 0.5]
    assert [s.turns[0].input_len for s in plan.sessions] == [2, 20]
    trace.write_text('{"output_len": 3}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        build_plan("trace", WorkloadArgs(trace=trace), tokenizer)


def test_parse_len():
    assert parse_len("12") == (12, 12) and parse_len("3:9") == (3, 9)
    with pytest.raises(ValueError):
        parse_len("9:3")


def test_one_seed_gives_each_workload_its_own_prompts(tokenizer):
    # The bench runs every workload of a seed on one server: a prompt that began like another
    # workload's would be served from the prefix cache (16-token blocks) and flatter its TTFT.
    sizes = WorkloadArgs(seed=5, num_requests=3, input_len=(40, 60), output_len=(4, 4),
                         num_turns=2, prefix_len=48, long_len=64)
    firsts = {}
    for name in ("decode1", "random", "shared_prefix", "multiturn", "long_interference"):
        plan = build_plan(name, sizes, tokenizer)
        for session in plan.sessions:
            for turn in session.turns:
                ids = tokenizer.encode((session.system or "") + turn.text)[:16]
                assert firsts.setdefault(tuple(ids), name) == name, (name, firsts[tuple(ids)])
