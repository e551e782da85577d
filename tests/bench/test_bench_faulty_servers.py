"""Servers that fail, drop or talk nonsense are counted as failures; the tool never crashes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from tokenmill.bench.serve import BenchSettings, run_bench
from tokenmill.bench.workloads import WorkloadArgs

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Connection: close\r\n\r\n")
ERROR_BODY = b'{"error": {"message": "boom"}}'
REPLIES = {
    "close": b"",
    "500": (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(ERROR_BODY)) + ERROR_BODY,
    "drop": SSE_HEAD + b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n',
    "garbage": SSE_HEAD + b"data: {not json\n\n",
    "error_event": SSE_HEAD + b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n',
}


class FakeServer:
    """A raw asyncio HTTP server on its own thread that answers every request with `reply`."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(self.reply)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from tokenmill.bench.workloads import HFTextTokenizer
    return HFTextTokenizer(default_model.tokenizer_dir)


def _bench(url: str, tokenizer, workload: str = "random", requests_file=None, **sizes) -> dict:
    sizes = {"num_requests": 3, "input_len": (8, 8), "output_len": (4, 4), **sizes}
    settings = BenchSettings(url, workload, model="m", concurrency=2, timeout_s=10,
                             sizes=WorkloadArgs(**sizes), requests_file=requests_file)
    return run_bench(settings, tokenizer)


@pytest.mark.parametrize("mode", sorted(REPLIES))
def test_misbehaving_server_counts_failures(mode, tokenizer):
    server = FakeServer(REPLIES[mode])
    try:
        result = _bench(server.url, tokenizer)
    finally:
        server.stop()
    assert (result["num_ok"], result["num_failed"]) == (0, 3)
    assert result["errors"], result


def test_failed_turn_fails_the_rest_of_its_conversation(tokenizer, tmp_path):
    server = FakeServer(REPLIES["500"])
    try:
        result = _bench(server.url, tokenizer, "multiturn", tmp_path / "requests.jsonl",
                        num_requests=2, num_turns=3)
    finally:
        server.stop()
    assert (result["num_ok"], result["num_failed"]) == (0, 6)
    assert any("HTTP 500" in e for e in result["errors"])
    # per request: each conversation's first turn was sent and failed, the rest never sent
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted((d["session"], d["turn"]) for d in lines) == \
        [(s, t) for s in range(2) for t in range(3)]
    assert all(d["status"] == "failed" for d in lines)
    for d in lines:
        assert (d["start_ms"] is None) == (d["turn"] > 0), d
        assert "HTTP 500" in d["error"] if d["turn"] == 0 else "earlier turn" in d["error"]


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_closed_port_counts_failures(tokenizer):
    result = _bench(_closed_port_url(), tokenizer)
    assert (result["num_ok"], result["num_failed"]) == (0, 3)
    assert "ConnectError" in result["errors"][0]


def test_closed_port_without_model_is_a_clear_cli_error(capsys):
    from tokenmill.cli import main
    code = main(["bench", "serve", "--base-url", _closed_port_url(), "--num-requests", "1"])
    assert code == 2
    assert "pass --model" in capsys.readouterr().err
