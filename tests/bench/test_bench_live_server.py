"""Every workload, scaled down, against a real `tokenmill serve` on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import Server
from tokenmill.cli import main


FIELDS = ("label", "workload", "endpoint", "base_url", "model", "date", "settings", "num_ok",
          "num_failed", "num_cancelled", "num_length_mismatch", "usage_reported", "duration_s",
          "input_tokens", "output_tokens", "output_tok_s", "input_tok_s", "requests_s",
          "goodput_requests_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "errors")


@pytest.fixture(scope="module")
def server():
    # with n-gram drafts: every workload below also checks them under the bench's fixed-length
    # requests (min_tokens, ignore_eos) and streaming
    srv = Server("--max-model-len", "4096", "--num-speculative-tokens", "3")
    yield srv
    srv.stop()


def _bench(server, tmp_path, *flags: str, command: str = "serve") -> list[dict]:
    results = tmp_path / "results.jsonl"
    code = main(["bench", command, "--base-url", server.url, "--results", str(results),
                 "--warmup", "1", *flags])
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert code == 0, lines[-1]["errors"]
    return lines


def _check(result: dict, num_requests: int) -> None:
    assert all(field in result for field in FIELDS)
    assert result["num_failed"] == 0 and result["num_ok"] == num_requests, result["errors"]
    assert result["num_length_mismatch"] == 0 and result["usage_reported"]
    assert result["output_tok_s"] > 0 and result["ttft_ms"]["p99"] is not None
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[key]) == {"p50", "p90", "p99", "mean", "max"}


WORKLOADS = {
    "decode1": ["--num-requests", "2", "--input-len", "16", "--output-len", "8"],
    "random": ["--num-requests", "4", "--input-len", "8:48", "--output-len", "4:10",
               "--endpoint", "chat", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"],
    "shared_prefix": ["--num-requests", "4", "--prefix-len", "64", "--input-len", "8",
                      "--output-len", "6"],
    "multiturn": ["--num-requests", "2", "--num-turns", "2", "--input-len", "12",
                  "--output-len", "6"],
    "prose": ["--num-requests", "3", "--input-len", "48:64", "--output-len", "24"],
}
EXPECTED = {"decode1": 2, "random": 4, "shared_prefix": 4, "multiturn": 4, "prose": 3}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_workload(server, tmp_path, workload):
    [result] = _bench(server, tmp_path, "--workload", workload, "--label", "t",
                      *WORKLOADS[workload])
    _check(result, EXPECTED[workload])
    if workload == "random":
        assert result["endpoint"] == "chat"
        assert result["goodput_requests_s"] == pytest.approx(result["requests_s"])
    if workload == "shared_prefix":
        assert result["input_tokens"] == 4 * (64 + 8)


def test_per_request_lines_agree_with_the_summary(server, tmp_path):
    details = tmp_path / "requests.jsonl"
    flags = ["--workload", "multiturn", "--num-requests", "2", "--num-turns", "2",
             "--input-len", "12", "--output-len", "6", "--label", "m", "--seed", "7"]
    [result] = _bench(server, tmp_path, *flags, "--save-requests", str(details))
    _check(result, 4)
    lines = [json.loads(line) for line in details.read_text().splitlines()]
    assert len(lines) == 4                                    # the warm-up is not written
    assert {(d["session"], d["turn"]) for d in lines} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for d in lines:
        assert (d["label"], d["workload"], d["seed"], d["status"]) == ("m", "multiturn", 7, "ok")
        assert d["output_tokens"] == 6 and len(d["itl_ms"]) >= 1
        assert 0 < d["ttft_ms"] <= d["e2e_ms"]
        assert d["ttft_ms"] + sum(d["itl_ms"]) == pytest.approx(d["e2e_ms"], abs=50)
    first = {d["session"]: d for d in lines if d["turn"] == 0}
    for d in lines:                        # a turn is sent once the one before has ended
        if d["turn"] == 1:
            assert d["start_ms"] >= first[d["session"]]["start_ms"] + first[d["session"]]["e2e_ms"]
    ttfts = sorted(d["ttft_ms"] for d in lines)
    assert result["ttft_ms"]["p50"] == pytest.approx((ttfts[1] + ttfts[2]) / 2, abs=0.01)
    assert result["ttft_ms"]["max"] == pytest.approx(ttfts[-1], abs=0.01)


def test_long_interference(server, tmp_path):
    [result] = _bench(server, tmp_path, "--workload", "long_interference", "--num-requests",
                      "2", "--input-len", "16", "--output-len", "24", "--long-len", "600")
    _check(result, 3)
    assert result["groups"]["long"]["num_ok"] == 1
    assert result["groups"]["stream"]["itl_ms"]["max"] is not None


def test_trace_and_request_rate(server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 5, "arrival_time": 0}\n'
                     '{"prompt": " The sky is", "output_len": 4, "arrival_time": 0.3}\n')
    [result] = _bench(server, tmp_path, "--workload", "trace", "--trace", str(trace))
    _check(result, 2)
    assert result["duration_s"] >= 0.3
    result = _bench(server, tmp_path, "--workload", "random", "--request-rate", "20",
                    "--num-requests", "3", "--input-len", "8", "--output-len", "4")[-1]
    _check(result, 3)
    assert result["settings"]["request_rate"] == 20


def test_max_duration_cuts_off_without_failures(server, tmp_path):
    results = tmp_path / "results.jsonl"
    main(["bench", "serve", "--base-url", server.url, "--results", str(results), "--warmup",
          "0", "--workload", "decode1", "--num-requests", "3", "--input-len", "8",
          "--output-len", "2000", "--max-duration", "1"])
    result = json.loads(results.read_text())
    assert result["num_failed"] == 0 and result["num_cancelled"] == 1
    assert result["duration_s"] < 5
    idle = server.wait_idle()  # the cut-off request was aborted on the server
    assert idle["tokenmill:num_requests_running"] == 0


def test_sweep_plot_and_compare(server, tmp_path, capsys):
    import matplotlib.image
    flags = ["--workload", "random", "--num-requests", "3", "--input-len", "8",
             "--output-len", "4", "--concurrencies", "1,3"]
    _bench(server, tmp_path, *flags, "--label", "a", command="sweep")
    lines = _bench(server, tmp_path, *flags, "--label", "b", command="sweep")
    assert [r["settings"]["concurrency"] for r in lines] == [1, 3, 1, 3]
    png = (tmp_path / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert matplotlib.image.imread(tmp_path / "results.png").ndim == 3
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "results.jsonl"), "--baseline", "a"]) == 0
    table = capsys.readouterr().out
    assert "ratios against a" in table and "1.00x" in table
    assert main(["bench", "plot", str(tmp_path / "results.jsonl"), "--out",
                 str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes().startswith(b"\x89PNG")


def test_the_result_shows_the_servers_drafts(server, tmp_path, capsys):
    # A 135M model repeats itself on random words: n-gram drafts are proposed and kept.
    [result] = _bench(server, tmp_path, "--workload", "decode1", "--num-requests", "1",
                      "--input-len", "32", "--output-len", "64")
    _check(result, 1)
    drafts = result["server_spec_decode"]
    assert 0 < drafts["accepted"] <= drafts["drafts"], drafts
    assert drafts["acceptance_rate"] == drafts["accepted"] / drafts["drafts"]
    assert "server drafts:" in capsys.readouterr().out
    # the fixed step cost the adaptive policy measured at start-up, exported
    assert 0 < server.metrics()["tokenmill:spec_decode_step_fixed_rows"] < 100


def test_streamed_greedy_chat_with_drafts_equals_the_engine_without(server, llm):
    # Drafts make a step stream several tokens at once; the text must not change.
    from openai import OpenAI

    from tokenmill import SamplingParams
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count: one two three, one two three, one two"}]
    kept_before = server.metrics()["tokenmill:spec_decode_num_accepted_tokens_total"]
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                            max_tokens=48, temperature=0, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    assert "".join(chunks) == expected.text
    assert server.metrics()["tokenmill:spec_decode_num_accepted_tokens_total"] > kept_before
    assert len([c for c in chunks if c]) < len(expected.token_ids)   # chunks of several tokens


def test_a_seed_run_twice_shows_the_servers_prefix_cache(server, tmp_path, capsys):
    # The second run of the same prompts is served from the prefix cache: the result line
    # says so (from the server's own counters), so such a run is not taken for speed.
    flags = ["--workload", "random", "--num-requests", "4", "--input-len", "64:96",
             "--output-len", "4", "--seed", "4242"]
    first, second = (_bench(server, tmp_path, *flags)[-1] for _ in range(2))
    for result in (first, second):
        _check(result, 4)
        assert result["server_prefix_cache"]["queries"] >= result["input_tokens"]
    assert first["server_prefix_cache"]["hit_rate"] < 0.25
    assert second["server_prefix_cache"]["hit_rate"] > 0.5
    assert "server prefix cache:" in capsys.readouterr().out


def test_utilization_against_given_ceilings(server, tmp_path, capsys):
    from tokenmill.bench.utilization import model_cost
    cost = model_cost(None)
    details = tmp_path / "requests.jsonl"
    peaks = ["--peak-gflops", "100", "--peak-gbps", "20"]
    [lone] = _bench(server, tmp_path, "--workload", "decode1", "--num-requests", "2",
                    "--input-len", "16", "--output-len", "8", "--save-requests", str(details),
                    *peaks)
    _check(lone, 2)
    use = lone["utilization"]
    processed = (lone["input_tokens"] - lone["server_prefix_cache"]["hits"]
                 + lone["output_tokens"]) / lone["duration_s"]
    assert use["processed_tok_s"] == pytest.approx(processed)
    assert use["mfu"] == pytest.approx(processed * 2 * cost.params / 100e9)
    requests = [json.loads(line) for line in details.read_text().splitlines()]
    contexts = [d["input_tokens"] + i for d in requests for i in range(d["output_tokens"])]
    per_token = 4 * cost.params + sum(contexts) / len(contexts) * cost.kv_bytes_per_token
    assert use["decode_bytes_per_token"] == pytest.approx(per_token)
    assert use["mbu"] == pytest.approx(lone["output_tok_s"] * per_token / 20e9)
    assert "MFU" in capsys.readouterr().out
    # many streams at once: MFU only, over the prompt tokens the prefix cache did not serve
    shared = _bench(server, tmp_path, "--workload", "shared_prefix", "--num-requests", "4",
                    "--prefix-len", "64", "--input-len", "8", "--output-len", "4", *peaks)[-1]
    hits = shared["server_prefix_cache"]["hits"]
    assert hits > 0 and shared["utilization"]["mbu"] is None
    assert shared["utilization"]["processed_tok_s"] == pytest.approx(
        (shared["input_tokens"] - hits + shared["output_tokens"]) / shared["duration_s"])
