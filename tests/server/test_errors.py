"""Client mistakes come back in OpenAI's error shape with the right status and `param`."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]


def _error(response, status: int, param: str | None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


def test_malformed_json(http):
    response = http.post("/v1/chat/completions", content=b'{"messages": [',
                         headers={"Content-Type": "application/json"})
    _error(response, 400, None)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),                                          # missing
    ({"messages": "hi"}, "messages"),                                        # wrong type
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "n": "two"}, "n"),
    ({"messages": USER, "top_p": 5}, "top_p"),                               # out of range
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": 5000}, "max_tokens"),                  # > max_model_len
    ({"messages": USER, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": USER, "stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_chat_bad_fields(http, body, param):
    _error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 10 ** 9]}, "prompt"),                                    # unknown token id
    ({"prompt": [7] * 2100}, "prompt"),                                      # > max_model_len
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
])
def test_completion_bad_fields(http, body, param):
    _error(http.post("/v1/completions", json=body), 400, param)


def test_unknown_model_is_404(http, client):
    _error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": USER}),
           404, "model")
    _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    import openai
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")


def test_body_too_large_is_413(http):
    response = http.post("/v1/completions", json={"prompt": "a" * (5 * 1024 * 1024)})
    _error(response, 413, None)


def test_unknown_route_is_404_json(http):
    _error(http.get("/v1/nothing-here"), 404, None)


def test_server_still_serves_after_errors(client, server):
    out = client.completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert server.wait_idle()["tokenmill:num_requests_running"] == 0
