"""What the engine produces: token-level `EngineOutput`s (crossing the process boundary as plain dicts), and the
user-facing `RequestOutput` that the `OutputProcessor` builds from them (text, usage, metrics).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenspeed.core.request import Request


@dataclass(slots=True)
class EngineOutput:
    """One request's progress in one step (token ids only)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (its step failed: `error` says why) once finished
    stop_reason: int | str | None  # the stop token id that ended it, if any
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # output tokens so far
    logprobs: list[float] | None = None  # raw logprob of each new token (when asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # top-n per new token (when asked)
    prompt_logprobs: list[dict[int, float]] | None = None  # entries for prompt positions computed this step
    queue_time: float | None = None  # seconds from arrival to first scheduled
    ttft: float | None = None  # seconds from arrival to the first output token
    e2e: float | None = None  # seconds from arrival to finish
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculation: draft tokens verified so far
    num_accepted_tokens: int = 0  # speculation: draft tokens accepted so far
    num_spec_steps: int = 0  # speculation: verify steps so far
    error: str | None = None  # with finish_reason "error": what failed (for the client's error message)

    @classmethod
    def of(cls, req: Request, new_ids: list[int], logprobs=None, top_logprobs=None, prompt_logprobs=None,
           error: str | None = None) -> "EngineOutput":
        s = req.stats
        return cls(
            request_id=req.request_id, new_token_ids=new_ids, finished=req.state.is_done,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, num_output_tokens=req.num_known_output_tokens,
            logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
            queue_time=None if s.first_scheduled_time is None else s.first_scheduled_time - s.arrival_time,
            ttft=None if s.first_token_time is None else s.first_token_time - s.arrival_time,
            e2e=None if s.finished_time is None else s.finished_time - s.arrival_time,
            num_preemptions=s.num_preemptions, num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens, num_spec_steps=s.num_spec_steps, error=error,
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.prompt_logprobs is not None:  # msgpack maps need str keys for portability
            d["prompt_logprobs"] = [[[k, v] for k, v in e.items()] for e in self.prompt_logprobs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineOutput":
        d = dict(d)
        if d.get("prompt_logprobs") is not None:
            d["prompt_logprobs"] = [{int(k): v for k, v in e} for e in d["prompt_logprobs"]]
        if d.get("top_logprobs") is not None:
            d["top_logprobs"] = [[(int(t), lp) for t, lp in row] for row in d["top_logprobs"]]
        return cls(**d)


@dataclass(slots=True)
class StepStats:
    """One engine step, for metrics."""

    num_tokens: int  # tokens in the forward
    num_seqs: int  # requests in the forward
    num_running: int  # running after the step
    num_waiting: int  # waiting after the step
    cache_usage: float  # fraction of pages referenced
    duration: float  # seconds
    num_preempted: int = 0
    num_cache_hit_tokens: int = 0  # cumulative prompt tokens served from the prefix cache
    num_cache_query_tokens: int = 0  # cumulative prompt tokens looked up


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
    num_draft_tokens: int = 0  # speculation: draft tokens verified
    num_accepted_tokens: int = 0  # speculation: draft tokens accepted
    num_spec_steps: int = 0  # speculation: verify steps

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + the bonus token); None without speculation."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None


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
