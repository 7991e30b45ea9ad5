"""`tokenspeed serve` end to end with the official `openai` client (tiny-k3 on the CPU).

Scenarios: chat (plain and streamed), completions (text and token ids, echo, logprobs), a tool round trip in the
prompt, cached tokens on a second turn, every error case (400, 401, 404, 503), a client disconnect that leaves
no running request, 64 concurrent streams with correct usage, and SIGTERM exiting 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server, stop_server


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0)


def test_models_and_health(server: Server) -> None:
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-k3"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_plain_and_streamed(server: Server) -> None:
    client = _client(server)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = client.chat.completions.create(model="tiny-k3", messages=msgs, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    stream = client.chat.completions.create(model="tiny-k3", messages=msgs, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    text = "".join((c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None)
                                                         or "") for c in chunks if c.choices)
    whole = (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
    assert text == whole  # streaming and non-streaming greedy agree


def test_completions_text_ids_echo_logprobs(server: Server) -> None:
    client = _client(server)
    out = client.completions.create(model="tiny-k3", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(v <= 0 for v in lp.token_logprobs) and len(lp.top_logprobs[0]) >= 2
    echo = client.completions.create(model="tiny-k3", prompt="def f(x):", max_tokens=3, temperature=0, echo=True,
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith("def f(x):")
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    many = client.completions.create(model="tiny-k3", prompt=["a", "b"], max_tokens=2, n=2, seed=3,
                                     temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3] and many.usage.completion_tokens == 8


def test_logit_bias_steers_greedy_tokens(server: Server) -> None:
    """OpenAI's logit_bias (string token-id keys): +100 on one token makes every greedy token that one (stream
    chunks carry their ids), in completions and chat; the reported logprobs stay the model's own (< 0)."""
    client = _client(server)
    stream = client.completions.create(model="tiny-k3", prompt=[5, 6, 7], max_tokens=4, temperature=0, stream=True,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
    ids = [t for c in stream for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    assert ids == [42] * 4
    out = client.completions.create(model="tiny-k3", prompt=[5, 6, 7], max_tokens=2, temperature=0, logprobs=0,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert all(v < 0 for v in out.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(model="tiny-k3", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={"42": 100},
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3


def test_tool_round_trip_is_rendered(server: Server) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    msgs = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21C"},
    ]
    out = _client(server).chat.completions.create(model="tiny-k3", messages=msgs, tools=tools, max_tokens=3,
                                                  temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}, headers=server.headers()).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=server.headers()).json()["prompt"]
    assert "sunny, 21C" in text and "get_weather" in text
    assert out.usage.prompt_tokens >= len(ids)  # the tools list is rendered too


def test_second_turn_reports_cached_tokens(server: Server) -> None:
    client = _client(server)
    turn1 = list(range(10, 60))
    out1 = client.completions.create(model="tiny-k3", prompt=turn1, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": out1.choices[0].text},
                        headers=server.headers()).json()["tokens"]
    turn2 = turn1 + tokens + [70, 71, 72]
    out2 = client.completions.create(model="tiny-k3", prompt=turn2, max_tokens=2, temperature=0)
    assert out2.usage.prompt_tokens_details.cached_tokens >= 48


def _error(server: Server, path: str, body: dict, key: str | None = "test-key") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "tiny-k3", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny-k3", "prompt": [5] * 2100}, 400, "maximum context length"),
    ({"model": "tiny-k3", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny-k3", "prompt": [10**7]}, 400, "range"),
    ({"model": "tiny-k3", "prompt": [3, 4, -2, 5]}, 400, "[-2]"),  # checked by the engine on its int64 array
    ({"model": "tiny-k3", "prompt": [3, 2**70]}, 400, "integers in the vocabulary"),  # not an int64
    ({"model": "tiny-k3"}, 400, "prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "nope"),
    ({"model": "tiny-k3", "prompt": "x", "logit_bias": {"abc": 5}}, 400, "logit_bias keys"),
    ({"model": "tiny-k3", "prompt": "x", "logit_bias": {"5": 101}}, 400, "[-100, 100]"),
    ({"model": "tiny-k3", "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "vocabulary"),
])
def test_error_cases(server: Server, body: dict, status: int, fragment: str) -> None:
    r = _error(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status and err["type"]


def test_auth_errors(server: Server) -> None:
    assert _error(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    assert _error(server, "/v1/completions", {"prompt": "x"}, key="wrong").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_disconnect_aborts_the_request(server: Server) -> None:
    done = httpx.post(f"{server.url}/v1/completions", headers=server.headers(),
                      json={"model": "tiny-k3", "prompt": [4, 5], "max_tokens": 3, "ignore_eos": True})
    assert done.status_code == 200  # a finished request, whatever ran before: the counters below are non-zero
    body = {"model": "tiny-k3", "prompt": [1, 2, 3], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers()) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _metric(server, "tokenspeed:num_requests_running") != 0:
        time.sleep(0.2)
    assert _metric(server, "tokenspeed:num_requests_running") == 0
    assert _metric(server, "tokenspeed:request_success_total") >= 1  # counters are exported
    assert _metric(server, "tokenspeed:request_queue_time_seconds_count") >= 1  # and the phase histograms
    assert _metric(server, "tokenspeed:request_decode_time_seconds_count") >= 1


def test_64_concurrent_streams(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await client.completions.create(model="tiny-k3", prompt=[3 + i, 4, 5], max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        pieces, usage = 0, None
        async for chunk in stream:
            pieces += bool(chunk.choices)
            usage = chunk.usage or usage
        return pieces, usage.completion_tokens

    async def main() -> list[tuple[int, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(tokens == 5 for _, tokens in results) and all(p >= 1 for p, _ in results)


def test_queue_cap_gives_503_and_sigterm_exits_zero() -> None:
    """Cap = max_num_seqs + max_waiting_requests = 1: of 4 simultaneous long requests, the late ones get 503."""
    srv = start_server("--max-num-seqs", "1", "--max-waiting-requests", "0")

    async def main() -> list[int]:
        body = {"model": "tiny-k3", "prompt": [1, 2], "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(f"{srv.url}/v1/completions", json=body) for _ in range(4)))
        for r in replies:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == 503 and "capacity" in r.json()["error"]["message"]
        return sorted(r.status_code for r in replies)

    try:
        codes = asyncio.run(main())
        assert codes[0] == 200 and codes[-1] == 503, codes
    finally:
        assert stop_server(srv) == 0


def test_stream_chunks_carry_token_ids_when_asked(server: Server) -> None:
    body = {"model": "tiny-k3", "prompt": [4, 5, 6], "max_tokens": 6, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers()) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 6
