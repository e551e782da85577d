"""A real `tokenmill serve` subprocess on 127.0.0.1 with the real default model."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
FAST_START = ("--kv-cache-memory", "0.25", "--max-model-len", "2048")


class Server:
    def __init__(self, *args: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        tokenmill = Path(sys.executable).with_name("tokenmill")
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen([str(tokenmill), "serve", "--port", str(self.port),
                                      *FAST_START, *args], stdout=self.log, stderr=None)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("server did not become healthy")

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: series name (labels dropped) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            match = re.match(r"^([\w:]+)(?:\{[^}]*\})? (\S+)$", line)
            if match and not line.startswith("#"):
                values[match.group(1)] = float(match.group(2))
        return values

    def wait_idle(self, timeout: float = 10) -> dict[str, float]:
        """Wait until nothing runs and no KV block is held by a request."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["tokenmill:num_requests_running"] == 0
                    and m["tokenmill:num_requests_waiting"] == 0
                    and m["tokenmill:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="session")
def server():
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
