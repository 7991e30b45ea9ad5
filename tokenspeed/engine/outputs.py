"""What the engine returns per request (cumulative, with the latest delta for streaming)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int  # tokens of the prompt
    completion_tokens: int  # tokens generated so far
    cached_tokens: int  # prompt tokens served from the prefix cache (page-aligned)


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # full output text so far (stop string removed unless asked to include it)
    token_ids: list[int]  # full output token ids so far
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it
    logprobs: list[float] | None = None  # raw logprob of each output token (when asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # top-n (token, logprob) per output token
    delta_text: str = ""  # text added by the latest step (streaming)
    delta_token_ids: list[int] = field(default_factory=list)  # tokens added by the latest step


@dataclass
class RequestMetrics:
    """Seconds, measured with time.monotonic on the engine side."""

    queue_time: float | None = None  # arrival -> first scheduled
    ttft: float | None = None  # arrival -> first output token
    e2e: float | None = None  # arrival -> finished
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    metrics: RequestMetrics
    prompt: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt position (position 0: None)
