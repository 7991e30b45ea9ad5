"""What the scheduler hands the executor for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.core.request import Request

ZERO_SLOT = -1  # as a copy source: zero the destination slot (a request starting from token 0)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request  # tokens and sampling parameters (read-only for the executor)
    num_computed_tokens: int  # positions already in the cache before this step
    num_new_tokens: int  # positions fed this step: request.all_token_ids[computed : computed + new]
    page_table: list[int]  # page ids covering computed + new positions: the cache manager's live list (a
    # `PageList`, not a copy; read-only here; it only grows, and stays valid for this step)
    slot: int  # the live KDA state slot
    sample: bool  # this step reaches the last known token: sample the next one
    num_draft_tokens: int = 0  # speculation: draft tokens to propose and verify after the new token

    @property
    def new_token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.all_token_ids[start : start + self.num_new_tokens]


@dataclass
class ScheduledBatch:
    requests: list[ScheduledRequest] = field(default_factory=list)
    state_copies_before: list[tuple[int, int]] = field(default_factory=list)  # (src or ZERO_SLOT, dst), in order
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)  # (live slot, checkpoint slot)
    preempted: list[str] = field(default_factory=list)  # request ids preempted while building this step

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.state_copies_before
