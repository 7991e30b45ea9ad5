"""OpenAI-compatible request bodies (pydantic) and the mapping to SamplingParams; the OpenAI error format."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tokenspeed.core.sampling_params import RequestError, SamplingParams


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI-compatible servers do


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI's form: token ids as JSON object keys
    stream: bool = False
    stream_options: StreamOptions | None = None

    def _common(self) -> dict[str, Any]:
        values = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output, "logit_bias": _token_keys(self.logit_bias),
        }
        return {k: v for k, v in values.items() if v is not None}


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return _params(self._common(), max_tokens=max_tokens, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        extra = {"prompt_logprobs": self.logprobs} if self.echo and self.logprobs is not None else {}
        return _params(self._common(), max_tokens=self.max_tokens, logprobs=self.logprobs, **extra)


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias with its JSON keys ("50256") as token ids; RequestError for a key that is not an integer."""
    if bias is None:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError as e:
        raise RequestError(f"logit_bias keys must be token ids (integers), got {list(bias)[:5]}") from e


def _params(common: dict[str, Any], **more: Any) -> SamplingParams:
    try:
        return SamplingParams(**common, **{k: v for k, v in more.items() if v is not None or k == "max_tokens"})
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from e


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


def error_json(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body {"error": {...}} for an HTTP status."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            503: "service_unavailable", 500: "internal_server_error"}.get(status, "invalid_request_error")
    return {"error": ErrorBody(message=message, type=kind, param=param, code=status).model_dump()}


FinishReason = Literal["stop", "length", "abort", "tool_calls"]
