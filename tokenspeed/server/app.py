"""The FastAPI application: OpenAI-compatible endpoints over an `EngineClient`.

Errors use the OpenAI format: 400 bad parameters or a prompt over max_model_len, 401 missing/wrong API key,
404 unknown model, 503 when the engine's waiting queue is over its cap (or the engine died). A client that
disconnects mid-stream has its request aborted (its cache is released by the engine).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenspeed.config import ServerConfig
from tokenspeed.core.sampling_params import RequestError
from tokenspeed.server import handlers
from tokenspeed.server.engine_client import EngineClient, EngineDead, StepFailed
from tokenspeed.server.metrics import Metrics
from tokenspeed.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_json,
)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def build_app(client: EngineClient, config: ServerConfig, model_name: str, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="TokenSpeed", lifespan=lifespan)
    metrics = Metrics(model_name)
    state = handlers.ServerState(client, config, model_name, metrics)
    app.state.server = state

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError) -> JSONResponse:
        return JSONResponse(error_json(e.status, e.message, e.param), status_code=e.status)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(error_json(400, str(e)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return JSONResponse(error_json(400, f"{where}: {first.get('msg', 'invalid request')}", where or None),
                            status_code=400)

    @app.exception_handler(EngineDead)
    async def _engine_dead(_: Request, e: EngineDead) -> JSONResponse:
        return JSONResponse(error_json(503, f"the engine is not running: {e}"), status_code=503)

    @app.exception_handler(StepFailed)
    async def _step_failed(_: Request, e: StepFailed) -> JSONResponse:
        return JSONResponse(error_json(503, str(e)), status_code=503)

    def guard(request: Request, model: str | None = None) -> None:
        if config.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {config.api_key}":
                raise HTTPError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)")
        if model is not None and model != model_name:
            raise HTTPError(404, f"the model `{model}` does not exist; this server serves `{model_name}`", "model")
        if client.dead:
            raise EngineDead(client.dead)

    @app.get("/health")
    async def health() -> Response:
        if client.dead:
            return JSONResponse(error_json(503, client.dead), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        guard(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state.created,
                                            "owned_by": "tokenspeed", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if not config.enable_metrics:
            raise HTTPError(404, "metrics are disabled (--enable-metrics)")
        metrics.engine(client.stats, client.num_unfinished)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        guard(request, body.model)
        ids = state.tokenize(body)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        guard(request, body.model)
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        guard(request, body.model)
        prepared = state.prepare_chat(body)
        return await _respond(state, request, prepared, body.stream)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        guard(request, body.model)
        prepared = state.prepare_completion(body)
        return await _respond(state, request, prepared, body.stream)

    return app


async def _respond(state: handlers.ServerState, request: Request, prepared: handlers.Prepared, stream: bool) -> Any:
    state.admit_or_503(len(prepared.prompts) * prepared.params.n)
    if stream:
        return StreamingResponse(handlers.stream(state, request, prepared), media_type="text/event-stream")
    return JSONResponse(await handlers.collect(state, request, prepared))


def now() -> int:
    return int(time.time())
