"""A request's life: its tokens, progress, and an explicit state machine.

    WAITING -> RUNNING -> FINISHED
       ^         |  \\
       |         v   -> ABORTED (from any live state)
       +---- PREEMPTED

`num_computed_tokens` chases `num_tokens` (prompt + output so far); a step feeds the request some of the tokens
in between. When a step reaches `num_tokens`, the model's last logits give the next output token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenspeed.core.sampling_params import SamplingParams


PLACEHOLDER = -1  # an output token still on the device (asynchronous scheduling: sampled, not yet read back)


class RequestState(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    ABORTED = 4

    @property
    def is_done(self) -> bool:
        return self >= RequestState.FINISHED


class InvalidTransition(RuntimeError):
    """A state change the lifecycle does not allow (an engine bug, never a user error)."""


_ALLOWED = {
    RequestState.WAITING: {RequestState.RUNNING, RequestState.ABORTED},
    RequestState.RUNNING: {RequestState.FINISHED, RequestState.PREEMPTED, RequestState.ABORTED},
    RequestState.PREEMPTED: {RequestState.RUNNING, RequestState.ABORTED},
    RequestState.FINISHED: set(),
    RequestState.ABORTED: set(),
}


@dataclass
class RequestStats:
    """Timestamps (time.monotonic) and counters recorded for metrics."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculation: draft tokens verified
    num_accepted_tokens: int = 0  # speculation: draft tokens accepted
    num_spec_steps: int = 0  # speculation: verify steps


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    state: RequestState = RequestState.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    stats: RequestStats = field(default_factory=RequestStats)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_placeholders: int = 0  # trailing output tokens that are PLACEHOLDER (sampled on the device, not read yet)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids  # prompt + output

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_placeholder(self) -> None:
        """Append an output token that a launched step samples on the device (asynchronous scheduling): the
        scheduler can feed it to the next step before its value is known on the host."""
        self.append_output(PLACEHOLDER)
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """Give the oldest placeholder its sampled value."""
        assert self.num_placeholders > 0, f"request {self.request_id}: no placeholder to resolve"
        i = len(self.output_token_ids) - self.num_placeholders
        self.output_token_ids[i] = token_id
        self.all_token_ids[self.num_prompt_tokens + i] = token_id
        self.num_placeholders -= 1

    def drop_placeholders(self) -> None:
        """Forget the unresolved placeholders (the request finished before their steps were read back)."""
        if self.num_placeholders:
            del self.output_token_ids[-self.num_placeholders:]
            del self.all_token_ids[-self.num_placeholders:]
            self.num_placeholders = 0

    @property
    def num_known_output_tokens(self) -> int:
        """Output tokens whose values the host knows (placeholders excluded)."""
        return len(self.output_token_ids) - self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def transition(self, new: RequestState) -> None:
        """Move to `new`; raises InvalidTransition if the lifecycle forbids it."""
        if new not in _ALLOWED[self.state]:
            raise InvalidTransition(f"request {self.request_id}: {self.state.name} -> {new.name} is not allowed")
        self.state = new
