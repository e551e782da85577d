"""Bad input gets a ValueError naming the field; the engine keeps serving everyone else."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.oracle import assert_kv_clean
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import FinishReason


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n"),
    (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"), (dict(logprobs=99), "logprobs"),
    (dict(presence_penalty=5), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_tokens=9, max_tokens=3), "min_tokens"), (dict(stop=[""]), "stop"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_serving(llm):
    engine = llm.engine
    engine.add_request("good", "Count to five:", SamplingParams(temperature=0, max_tokens=8))
    too_long = list(range(100, 100 + engine.max_model_len))
    with pytest.raises(ValueError, match=r"^prompt: 2048 tokens leave no room"):
        engine.add_request("long", too_long, SamplingParams())
    with pytest.raises(ValueError, match=r"^max_tokens: 4000 is too large"):
        engine.add_request("big", "hi", SamplingParams(max_tokens=4000))
    with pytest.raises(ValueError, match=r"^logit_bias: token id 999999"):
        engine.add_request("bias", "hi", SamplingParams(logit_bias={999999: 1.0}))
    with pytest.raises(ValueError, match=r"^prompt: token id -1"):
        engine.add_request("ids", [5, -1], SamplingParams())
    with pytest.raises(ValueError, match=r"^prompt: must not be empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role"):
        engine.add_request("chat", None, SamplingParams(), messages=[{"role": "wizard"}])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 8
    assert_kv_clean(llm)


def test_unknown_model_name():
    with pytest.raises(ValueError, match=r"^model: unknown model name 'no-such-model'"):
        LLM(model="no-such-model")


def test_corrupt_gguf(tmp_path, default_model):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_model.path.read_bytes()[:5_000_000])
    with pytest.raises(ValueError, match=r"^model: cannot read GGUF file"):
        LLM(model=str(broken), num_kv_blocks=16, max_model_len=256)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match=r"^model: cannot read GGUF file"):
        LLM(model=str(garbage), num_kv_blocks=16, max_model_len=256)


def test_engine_options_name_the_field():
    with pytest.raises(ValueError, match=r"^block_size: must be a power of two"):
        LLM(block_size=12)
    with pytest.raises(ValueError, match=r"^max_num_seqs: "):
        LLM(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^kv_cache_mb: unknown engine option"):
        LLM(kv_cache_mb=3)
    with pytest.raises(ValueError, match=r"^draft_fixed_cost: must be >= 0"):
        LLM(num_speculative_tokens=3, draft_fixed_cost=-1.0)


def test_a_failed_step_errors_only_its_requests(llm, monkeypatch):
    engine = llm.engine
    worker = engine.core.worker
    real_execute = worker.execute
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device failure")
        return real_execute(scheduled)

    monkeypatch.setattr(worker, "execute", flaky)
    engine.add_request("doomed", "Hello", SamplingParams(temperature=0, max_tokens=4))
    doomed = [o for o in engine.step() if o.finished]
    assert doomed and doomed[0].outputs[0].finish_reason == FinishReason.ERROR
    after = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(after.outputs[0].token_ids) == 4
    assert_kv_clean(llm)


def test_cli_reports_bad_flags_clearly():
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "hi",
                             "--temperature", "-1"], capture_output=True, text=True)
    assert result.returncode == 2 and "error: temperature: must be >= 0" in result.stderr
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "hi",
                             "--model", "nope"], capture_output=True, text=True)
    assert result.returncode == 2 and "error: model: unknown model name 'nope'" in result.stderr
