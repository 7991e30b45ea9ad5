"""A real `tokenspeed serve` process on a free port, shared by the tests of a module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    api_key: str | None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def start_server(*flags: str, api_key: str | None = None, timeout: float = 120.0) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenspeed.cli", "serve", "tiny-k3", "--port", str(port),
           "--cache-memory-gb", "0.05", "--log-level", "warning", *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return Server(url, proc, api_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy in time")


def stop_server(server: Server, timeout: float = 60.0) -> int:
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout)
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """With asynchronous scheduling forced on (the GPU default), so the server tests also cover steps launched
    before the previous one is read back (aborts, metrics, streams); `test_default_model_served` and the queue-cap
    test run the CPU default (synchronous)."""
    srv = start_server("--max-model-len", "2048", "--page-size", "8", "--async-scheduling", "on", api_key="test-key")
    yield srv
    assert stop_server(srv) == 0
