"""A request whose engine step failed (`finish_reason` "error" from the engine, e.g. out of device memory) gets an
HTTP 503 in the OpenAI error format with the engine's message, or, streamed, an error event and the end of the
stream; the server keeps serving. The engine process is replaced by `_Engine`, which answers each request the way
the engine process does over its socket: with the outputs it scripts."""

from __future__ import annotations

import asyncio
import json

from fastapi.testclient import TestClient

from tokenspeed.config import EngineConfig, ServerConfig
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.outputs import EngineOutput
from tokenspeed.engine.process import unpack
from tokenspeed.engine.tokenizer import ByteTokenizer
from tokenspeed.server.app import build_app
from tokenspeed.server.engine_client import EngineClient, EngineInfo

MESSAGE = "the engine ran out of device memory in a step with this request"


class _Engine:
    """Stands for the engine process behind the client's push socket: each added request gets `script(rid, n)`,
    delivered as the client's reader delivers the engine's outputs."""

    def __init__(self, client: EngineClient, script) -> None:
        self.client, self.script = client, script

    def send(self, data: bytes) -> None:
        msg = unpack(data)
        if msg["type"] == "add":
            rid, n = msg["id"], len(msg["prompt_ids"]) // 8
            asyncio.get_running_loop().call_soon(self.client._deliver, self.script(rid, n))


async def _sent(data: bytes) -> None:
    return None


def _client(script) -> EngineClient:
    client = EngineClient.__new__(EngineClient)
    client.config = EngineConfig.create(model="tiny-k3")
    client.processor = OutputProcessor(ByteTokenizer(512))
    client.queues, client.stats, client.dead = {}, None, None
    client.info = EngineInfo(max_model_len=256, vocab_size=512)
    engine = _Engine(client, script)
    client.push = type("Push", (), {"send": lambda self, data: (engine.send(data), _sent(data))[1]})()
    return client


def _failed(rid: str, n: int) -> list[EngineOutput]:
    return [EngineOutput(rid, [7], False, None, None, n, 0, 1),
            EngineOutput(rid, [], True, "error", None, n, 0, 1, error=MESSAGE)]


def _served(rid: str, n: int) -> list[EngineOutput]:
    return [EngineOutput(rid, [7, 8], True, "length", None, n, 0, 2)]


def test_failed_step_is_a_503_and_the_server_goes_on() -> None:
    scripts = [_failed]
    app = build_app(_client(lambda rid, n: scripts[-1](rid, n)), ServerConfig(), "m")
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable" and MESSAGE in err["message"]

        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] != "[DONE]"
        last = json.loads(events[-1])["error"]
        assert last["code"] == 503 and MESSAGE in last["message"]
        assert any("choices" in json.loads(e) for e in events[:-1])  # the token before the failure was streamed

        scripts.append(_served)  # the next request is served as usual
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert app.state.server.client.num_unfinished == 0
        assert 'tokenspeed:request_success_total{finished_reason="error",model_name="m"} 2.0' in http.get(
            "/metrics").text
