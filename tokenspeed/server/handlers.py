"""Request preparation (templates, tokenization, validation) and response building (JSON and SSE streams)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenspeed.config import ServerConfig
from tokenspeed.core.sampling_params import RequestError, SamplingParams
from tokenspeed.engine.outputs import RequestOutput
from tokenspeed.server.chat.output import ChatOutputParser, detect_syntax
from tokenspeed.server.chat.template import render_chat_segments
from tokenspeed.server.engine_client import EngineClient, EngineDead, StepFailed
from tokenspeed.server.metrics import Metrics
from tokenspeed.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, error_json


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    kind: str  # "chat" | "completion"
    prompts: list[tuple[list[int], str | None]]  # (token ids, text) per prompt
    params: SamplingParams  # n = choices per prompt
    include_usage: bool = False
    echo: bool = False
    return_token_ids: bool = False  # completions: each stream chunk also carries its token ids
    tools_enabled: bool = False
    rendered: str = ""  # chat: the rendered prompt (decides whether the output starts in thinking)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Choice:
    index: int
    prompt_index: int
    parser: ChatOutputParser | None
    started: bool = False
    last_token_time: float | None = None
    final: RequestOutput | None = None


class ServerState:
    def __init__(self, client: EngineClient, config: ServerConfig, model_name: str, metrics: Metrics) -> None:
        self.client, self.config, self.model_name, self.metrics = client, config, model_name, metrics
        self.tokenizer = client.processor.tokenizer
        self.syntax = detect_syntax(self.tokenizer.chat_template)
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len if self.client.info else 0

    def admit_or_503(self, count: int) -> None:
        from tokenspeed.server.app import HTTPError

        cap = self.client.config.scheduler.max_num_seqs + self.config.max_waiting_requests
        if self.client.num_unfinished + count > cap:
            raise HTTPError(503, f"the server is at capacity ({cap} requests in flight); retry later")

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                               f"{len(ids)} tokens")
        params.validate(self.client.info.vocab_size if self.client.info else None)

    def render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any]) -> tuple[str, list[int]]:
        """(prompt text, token ids): template markers may be special tokens, message content never becomes one."""
        segments = render_chat_segments(messages, tools, self.tokenizer.chat_template, **kwargs)
        return "".join(text for text, _ in segments), self.tokenizer.encode_segments(segments)

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        tools_enabled = bool(body.tools) and body.tool_choice != "none"
        kwargs = dict(body.chat_template_kwargs or {})
        extra = body.model_extra or {}
        for key, value in (("tool_choice", body.tool_choice), ("reasoning_effort", extra.get("reasoning_effort")),
                           ("response_format", extra.get("response_format"))):
            if value is not None:
                kwargs.setdefault(key, value)
        text, ids = self.render(body.messages, body.tools, kwargs)  # tools stay declared with tool_choice none
        params = body.sampling_params().clone(skip_special_tokens=False)  # the parsers need the markers
        self._check_prompt(ids, params)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared("chat", [(ids, text)], params, usage, tools_enabled=tools_enabled, rendered=text)

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        raw = body.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [raw]
        else:
            items = list(raw)
        params = body.sampling_params()
        prompts = []
        for item in items:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            self._check_prompt(ids, params)
            prompts.append((ids, item if isinstance(item, str) else self.tokenizer.decode(ids)))
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared("completion", prompts, params, usage, echo=body.echo,
                        return_token_ids=bool((body.model_extra or {}).get("return_token_ids")))

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            return self.render(body.messages, None, {})[1]
        if body.prompt is None:
            raise RequestError("give `prompt` or `messages`")
        return self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)


async def _start(state: ServerState, prep: Prepared) -> tuple[dict[str, _Choice], asyncio.Queue]:
    """Send every choice to the engine; returns the choices by request id and a fan-in queue of outputs."""
    choices: dict[str, _Choice] = {}
    merged: asyncio.Queue = asyncio.Queue()
    n = prep.params.n
    for p_index, (ids, text) in enumerate(prep.prompts):
        for i in range(n):
            params = prep.params.clone(n=1) if prep.params.seed is None else prep.params.clone(
                n=1, seed=prep.params.seed + i)
            rid = await state.client.add(ids, params, text, index=p_index * n + i)
            parser = ChatOutputParser.for_prompt(prep.rendered, syntax=state.syntax,
                                                 tools_enabled=prep.tools_enabled) if prep.kind == "chat" else None
            choices[rid] = _Choice(p_index * n + i, p_index, parser)
            asyncio.create_task(_pump(state.client, rid, merged))
    return choices, merged


async def _pump(client: EngineClient, rid: str, merged: asyncio.Queue) -> None:
    try:
        async for out in client.outputs(rid):
            merged.put_nowait(out)
    except Exception as e:  # noqa: BLE001 - delivered to the response, which turns it into an error
        merged.put_nowait(e)


async def _events(state: ServerState, prep: Prepared) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
    """(choice, output) pairs until every choice finished; aborts unfinished choices if the consumer stops."""
    choices, merged = await _start(state, prep)
    remaining = set(choices)
    try:
        while remaining:
            item = await merged.get()
            if isinstance(item, ValueError):
                raise RequestError(str(item))
            if isinstance(item, StepFailed):
                state.metrics.failed()
            if isinstance(item, Exception):
                raise item
            choice = choices[item.request_id]
            _observe(state, prep, choice, item)
            if item.finished:
                remaining.discard(item.request_id)
                choice.final = item
            yield choice, item
    finally:
        for rid in remaining:  # client went away (or an error): free the engine side
            await state.client.abort(rid)


def _observe(state: ServerState, prep: Prepared, choice: _Choice, out: RequestOutput) -> None:
    now = time.monotonic()
    for _ in out.outputs[0].delta_token_ids:
        first = now - prep.arrival if choice.last_token_time is None else None
        itl = None if choice.last_token_time is None else now - choice.last_token_time
        state.metrics.token(itl, first)
        choice.last_token_time = now
        if first is not None:
            choice.started_ttft = first  # type: ignore[attr-defined]
    if out.finished:
        c = out.outputs[0]
        state.metrics.finished(c.finish_reason or "abort", out.usage.prompt_tokens, out.usage.completion_tokens,
                               getattr(choice, "started_ttft", None), now - prep.arrival)
        m = out.metrics
        state.metrics.speculation(m.num_draft_tokens, m.num_accepted_tokens, m.num_spec_steps)
        state.metrics.phases(m)


def usage_json(prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    per_prompt: dict[int, RequestOutput] = {}
    completion = 0
    for i, out in enumerate(finals):
        per_prompt.setdefault(i // prep.params.n, out)
        completion += out.usage.completion_tokens
    prompt = sum(o.usage.prompt_tokens for o in per_prompt.values())
    cached = sum(o.usage.cached_tokens for o in per_prompt.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def collect(state: ServerState, request: Request, prep: Prepared) -> dict[str, Any]:
    from tokenspeed.server import render

    finals: dict[int, tuple[_Choice, RequestOutput]] = {}
    async for choice, out in _events(state, prep):
        if out.finished:
            finals[choice.index] = (choice, out)
    ordered = [finals[i] for i in sorted(finals)]
    usage = usage_json(prep, [o for _, o in ordered])
    if prep.kind == "chat":
        return render.chat_response(state, prep, ordered, usage)
    return render.completion_response(state, prep, ordered, usage)


async def stream(state: ServerState, request: Request, prep: Prepared) -> AsyncIterator[str]:
    from tokenspeed.server import render

    finals: list[RequestOutput] = []
    try:
        async for choice, out in _events(state, prep):
            chunks = render.chat_chunks(state, prep, choice, out) if prep.kind == "chat" else (
                render.completion_chunks(state, prep, choice, out))
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            if out.finished:
                finals.append(out)
    except RequestError as e:
        yield f"data: {json.dumps(error_json(400, str(e)))}\n\n"
        return
    except (StepFailed, EngineDead) as e:  # mid-stream: the status line is sent, so the error is an event
        message = str(e) if isinstance(e, StepFailed) else f"the engine is not running: {e}"
        yield f"data: {json.dumps(error_json(503, message))}\n\n"
        return
    if prep.include_usage:
        finals.sort(key=lambda o: o.outputs[0].index)
        chunk = render.base_chunk(state, prep)
        chunk["choices"] = []
        chunk["usage"] = usage_json(prep, finals)
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
