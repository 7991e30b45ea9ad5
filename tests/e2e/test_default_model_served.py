"""`tokenspeed serve` with no model argument serves the trained default model, and its prompt logprobs
(`/v1/completions` with echo + logprobs) reproduce the training-time held-out loss within 1%."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx

from tests.e2e.conftest import free_port, stop_server
from tokenspeed.models.default_model import default_model_path


def test_served_prompt_logprobs_reproduce_training_loss() -> None:
    import os
    import subprocess
    import sys
    import time

    from tests.e2e.conftest import Server

    evaluation = json.loads((Path(default_model_path()) / "eval.json").read_text())
    snippet = evaluation["snippets"][0]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port),
                             "--cache-memory-gb", "0.1", "--log-level", "warning"],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    server = Server(f"http://127.0.0.1:{port}", proc, None)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "kimi-k3-mini"
        body = {"model": "kimi-k3-mini", "prompt": snippet["text"], "max_tokens": 1, "echo": True, "logprobs": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        lps = reply["choices"][0]["logprobs"]["token_logprobs"]
        n = reply["usage"]["prompt_tokens"]
        loss = -sum(lps[1:n]) / (n - 1)  # prompt positions 1..n-1 (position 0 has no logprob)
        assert math.isclose(loss, snippet["train_time_loss"], rel_tol=0.01), (loss, snippet["train_time_loss"])
    finally:
        assert stop_server(server) == 0
