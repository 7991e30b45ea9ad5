"""One streaming request to an OpenAI-compatible server, timed token by token.

Prompts are token ids sent to `POST /v1/completions` (`prompt: [ids]`, `stream: true`,
`stream_options.include_usage`, `ignore_eos`, `max_tokens`): no chat template or tokenizer sits between the trace and
the server, so prompt lengths and block boundaries are exact. Token counts come from the server's final `usage`
(prompt, completion, `prompt_tokens_details.cached_tokens`). A chunk's token count is the length of its `token_ids`
when the server returns them (asked with `return_token_ids`; needed for live history), else 1 per chunk that carries
text or a finish reason (servers drop chunks whose token decodes to no text yet, so ITL then measures chunk gaps).
All times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

try:
    import httpx
except ImportError:  # pragma: no cover - the successor package exposes the same API
    import httpx2 as httpx  # type: ignore[no-redef]

_OVERFLOW = re.compile(r"context length|context window|maximum context|max_model_len|too long|exceeds the max",
                       re.IGNORECASE)


@dataclass(frozen=True)
class Outcome:
    """What came back for one request (times in perf_counter seconds, counts in tokens)."""

    sent: float
    ok: bool = False
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None
    overflow: bool = False  # rejected because prompt + max_tokens exceeds the server's context
    chunk_times: tuple[float, ...] = ()  # arrival of each chunk that carried tokens
    chunk_tokens: tuple[int, ...] = ()  # tokens in each of those chunks
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage (else the streamed count)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
    output_ids: tuple[int, ...] | None = None  # streamed token ids, when the server returned them
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.chunk_times[-1] - self.sent if self.chunk_times else None


def completion_payload(model: str, prompt: list[int] | None, max_tokens: int, *, temperature: float = 0.0,
                       ignore_eos: bool = True, token_ids: bool = False, extra: dict | None = None) -> dict:
    """The /v1/completions body: exact output length (ignore_eos + max_tokens), usage in the last chunk.

    `prompt` None leaves it out (the caller appends its pre-encoded prompt)."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if prompt is not None:
        body["prompt"] = prompt
    if token_ids:
        body["return_token_ids"] = True
    if extra:
        body.update(extra)
    return body


def _error_text(body: str) -> str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:500]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:500]
    return str(err)[:500]


def _usage(obj: dict, acc: dict) -> None:
    usage = obj.get("usage")
    if not usage:
        return
    acc["prompt"] = usage.get("prompt_tokens", acc.get("prompt"))
    acc["output"] = usage.get("completion_tokens", acc.get("output"))
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        acc["cached"] = details["cached_tokens"]


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict | bytes, timeout_s: float) -> Outcome:
    """Send one streaming request (a dict, or a JSON body already encoded); never raises for server or network
    errors (they become `Outcome.error`)."""
    if isinstance(payload, dict):
        kw: dict = {"json": payload}
    else:
        kw = {"content": payload, "headers": {"Content-Type": "application/json"}}
    sent = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    ids: list[int] = []
    saw_ids = False
    usage: dict = {}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, **kw) as resp:
                if resp.status_code != 200:
                    msg = _error_text((await resp.aread()).decode(errors="replace"))
                    return Outcome(sent, status=resp.status_code, error=f"HTTP {resp.status_code}: {msg}",
                                   overflow=resp.status_code in (400, 413, 422) and bool(_OVERFLOW.search(msg)))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        msg = _error_text(data)
                        return Outcome(sent, status=200, error=f"stream error: {msg}",
                                       overflow=bool(_OVERFLOW.search(msg)), chunk_times=tuple(times),
                                       chunk_tokens=tuple(counts))
                    _usage(obj, usage)
                    n = 0
                    for ch in obj.get("choices") or ():
                        tok = ch.get("token_ids")
                        if tok is not None:
                            saw_ids = True
                            ids.extend(tok)
                            n += len(tok)
                        elif ch.get("text") or (ch.get("delta") or {}).get("content") or ch.get("finish_reason"):
                            n += 1  # without ids: one token per chunk (a token may decode to no text yet)
                    if n:
                        times.append(now)
                        counts.append(n)
    except TimeoutError:
        return Outcome(sent, error=f"timeout after {timeout_s:g} s", chunk_times=tuple(times),
                       chunk_tokens=tuple(counts))
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        return Outcome(sent, error=f"{type(e).__name__}: {e}", chunk_times=tuple(times), chunk_tokens=tuple(counts))
    if not times:
        return Outcome(sent, status=200, error="no tokens streamed")
    out = usage.get("output")
    return Outcome(sent, ok=True, status=200, chunk_times=tuple(times), chunk_tokens=tuple(counts),
                   prompt_tokens=usage.get("prompt"), output_tokens=out if out is not None else sum(counts),
                   cached_tokens=usage.get("cached"), output_ids=tuple(ids) if saw_ids else None,
                   extra={"usage_reported": bool(usage)})


def make_client(max_connections: int | None = None, timeout_s: float = 600.0,
                api_key: str | None = None) -> httpx.AsyncClient:
    """One connection pool for all streams (HTTP/1.1 keep-alive; one connection per in-flight stream)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0), headers=headers)


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id that GET /v1/models lists."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]
