"""A deterministic OpenAI-compatible streaming server for testing the bench client (no model, no dependencies).

`POST /v1/completions` (token-id or text prompts, stream or not, `stream_options.include_usage`, `return_token_ids`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus prefix-cache counters). It keeps a block-level prefix cache
(pages of `page_size` tokens, chained hashes, infinite or LRU) and reports `usage.prompt_tokens_details.cached_tokens`.
Timing model: prefill sleeps `prefill_s_per_token` per uncached prompt token; decode emits `tokens_per_step` tokens
per step of `step_s x (1 + batch_slowdown x (running - 1))` seconds. Output token i of a prompt is a fixed function of
(prompt length, last prompt token, i). Prompt + max_tokens over `max_model_len` is a 400 "maximum context length".

    python -m tokenspeed.bench.mock_server --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class MockConfig:
    """Server behaviour; times in seconds, sizes in tokens."""

    model: str = "mock"
    page_size: int = 64
    cache_pages: int | None = None  # None: infinite
    max_model_len: int = 1 << 20
    prefill_s_per_token: float = 0.0
    step_s: float = 0.002
    batch_slowdown: float = 0.0  # step time grows by this fraction per extra running request
    tokens_per_step: int = 1
    vocab_low: int = 16
    vocab_high: int = 512
    fail_every: int = 0  # every n-th completion request fails with HTTP 500 (0: never)
    token_ids: bool = True  # honour `return_token_ids` (False: behave like a server that ignores it)
    text_chunks: bool = True  # False: tokens decode to no text and only the final chunk is sent (unless ids asked)


class _Cache:
    """Chained page hashes; LRU when bounded."""

    def __init__(self, page: int, capacity: int | None) -> None:
        self.page, self.capacity = page, capacity
        self.pages: OrderedDict[int, None] = OrderedDict()
        self.hits = self.queries = 0

    def _hashes(self, tokens: list[int]) -> list[int]:
        out, h = [], 0
        for i in range(0, len(tokens) - self.page + 1, self.page):
            h = hash((h, tuple(tokens[i:i + self.page])))
            out.append(h)
        return out

    def lookup(self, tokens: list[int]) -> int:
        """Cached tokens for a prompt (whole pages; at least one token is always computed)."""
        n = 0
        for h in self._hashes(tokens):
            if h not in self.pages:
                break
            self.pages.move_to_end(h)
            n += 1
        cached = min(n * self.page, (len(tokens) - 1) // self.page * self.page)
        self.hits += cached
        self.queries += len(tokens)
        return cached

    def insert(self, tokens: list[int]) -> None:
        for h in self._hashes(tokens):
            self.pages[h] = None
            self.pages.move_to_end(h)
        while self.capacity is not None and len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


class MockServer:
    """Runs in a background thread: `with MockServer(cfg) as url: ...` (url = http://127.0.0.1:PORT)."""

    def __init__(self, cfg: MockConfig = MockConfig(), host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg, self.host, self.port = cfg, host, port
        self.cache = _Cache(cfg.page_size, cfg.cache_pages)
        self.running = self.requests = self.finished = 0
        self.max_running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- HTTP plumbing -------------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self._route(method, path.split("?")[0], body, writer)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json") -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}.get(status, "Error")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: keep-alive\r\n\r\n".encode() + body)
        await writer.drain()

    async def _error(self, writer, status: int, message: str) -> None:
        err = {"error": {"message": message, "type": "BadRequestError" if status == 400 else "Error", "code": status}}
        await self._send(writer, status, json.dumps(err).encode())

    async def _route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            await self._send(writer, 200, json.dumps({"object": "list", "data": [
                {"id": self.cfg.model, "object": "model", "max_model_len": self.cfg.max_model_len}]}).encode())
        elif method == "GET" and path == "/health":
            await self._send(writer, 200, b"{}")
        elif method == "GET" and path == "/metrics":
            await self._send(writer, 200, self.metrics().encode(), "text/plain; version=0.0.4")
        elif method == "POST" and path == "/v1/completions":
            try:
                req = json.loads(body)
            except json.JSONDecodeError:
                return await self._error(writer, 400, "invalid JSON body")
            await self._completion(req, writer)
        else:
            await self._error(writer, 404, f"no route {method} {path}")

    def metrics(self) -> str:
        c = self.cache
        return (f"# TYPE tokenspeed:prefix_cache_queries_total counter\n"
                f"tokenspeed:prefix_cache_queries_total{{model_name=\"{self.cfg.model}\"}} {c.queries}\n"
                f"# TYPE tokenspeed:prefix_cache_hits_total counter\n"
                f"tokenspeed:prefix_cache_hits_total{{model_name=\"{self.cfg.model}\"}} {c.hits}\n"
                f"tokenspeed:num_requests_running {self.running}\n"
                f"tokenspeed:request_success_total {self.finished}\n")

    # --- completions -----------------------------------------------------------------------------------------------
    def _token(self, prompt: list[int], i: int) -> int:
        c = self.cfg
        return c.vocab_low + (len(prompt) * 1_000_003 + prompt[-1] * 7_919 + i * 104_729) % (c.vocab_high - c.vocab_low)

    async def _completion(self, req: dict, writer: asyncio.StreamWriter) -> None:
        c = self.cfg
        prompt = req.get("prompt")
        if isinstance(prompt, str):
            prompt = list(prompt.encode())
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return await self._error(writer, 400, "prompt must be a non-empty string or list of token ids")
        if req.get("model") not in (None, c.model):
            return await self._error(writer, 404, f"The model `{req.get('model')}` does not exist.")
        n_out = int(req.get("max_tokens") or 16)
        if len(prompt) + n_out > c.max_model_len:
            return await self._error(writer, 400, f"This model's maximum context length is {c.max_model_len} tokens. "
                                                  f"However, you requested {len(prompt) + n_out} tokens.")
        self.requests += 1
        if c.fail_every and self.requests % c.fail_every == 0:
            return await self._error(writer, 500, "injected failure")
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self._generate(req, prompt, n_out, writer)
        finally:
            self.running -= 1

    async def _generate(self, req: dict, prompt: list[int], n_out: int, writer: asyncio.StreamWriter) -> None:
        c, stream = self.cfg, bool(req.get("stream"))
        cached = self.cache.lookup(prompt)
        if c.prefill_s_per_token:
            await asyncio.sleep((len(prompt) - cached) * c.prefill_s_per_token)
        self.cache.insert(prompt)
        ids_wanted = c.token_ids and bool(req.get("return_token_ids"))
        rid, created, out = f"cmpl-{self.requests}", int(time.time()), []
        base = {"id": rid, "object": "text_completion", "created": created, "model": c.model}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if stream:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: keep-alive\r\n\r\n")
        while len(out) < n_out:
            await asyncio.sleep(c.step_s * (1.0 + c.batch_slowdown * (self.running - 1)))
            new = [self._token(prompt, len(out) + k) for k in range(min(c.tokens_per_step, n_out - len(out)))]
            out += new
            if stream and (c.text_chunks or ids_wanted or len(out) == n_out):
                choice = {"index": 0, "text": "".join(f" t{t}" for t in new) if c.text_chunks else "",
                          "finish_reason": "length" if len(out) == n_out else None}
                if ids_wanted:
                    choice["token_ids"] = new
                await self._chunk(writer, {**base, "choices": [choice]})
        self.cache.insert(prompt + out)
        self.finished += 1
        if not stream:
            choice = {"index": 0, "text": "".join(f" t{t}" for t in out), "finish_reason": "length"}
            if ids_wanted:
                choice["token_ids"] = out
            return await self._send(writer, 200, json.dumps({**base, "choices": [choice], "usage": usage}).encode())
        if (req.get("stream_options") or {}).get("include_usage"):
            await self._chunk(writer, {**base, "choices": [], "usage": usage})
        await self._chunk(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    async def _chunk(writer: asyncio.StreamWriter, obj) -> None:
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    # --- lifecycle -------------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        server = await asyncio.start_server(self._handle, self.host, self.port, limit=1 << 26, backlog=4096)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await server.serve_forever()

    def start(self) -> str:
        def main() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.serve())
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=main, name="mock-openai-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("mock server did not start")
        return self.url

    def stop(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--batch-slowdown", type=float, default=0.05)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    a = p.parse_args()
    cfg = MockConfig(step_s=a.step_ms / 1000, batch_slowdown=a.batch_slowdown,
                     prefill_s_per_token=a.prefill_us_per_token / 1e6)
    server = MockServer(cfg, a.host, a.port)
    print(f"mock OpenAI server on http://{a.host}:{a.port}", flush=True)
    asyncio.run(server.serve())


if __name__ == "__main__":
    main()
