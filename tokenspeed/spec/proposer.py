"""Draft proposers: given a request's tokens, propose the next k tokens for the target to verify.

`NgramProposer` (prompt lookup): find the most recent earlier occurrence of the last n tokens in the request's own
history and propose what followed it. Agentic traffic repeats itself a lot (file contents, tool outputs, code),
which is where this pays off; it needs no draft model. EAGLE3 plugs in behind the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids` (fewer, or none, when there is nothing to propose)."""


class NgramProposer:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, window: int = 4096) -> None:
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        tokens = list(token_ids[-self.window :])
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier match first
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []


class RepeatProposer:
    """Proposes the last token k times: a deterministic stand-in draft for forced-acceptance benchmarks."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [token_ids[-1]] * k if token_ids else []


def make_proposer(spec) -> Proposer | None:
    """The proposer of a SpecConfig (None without speculation)."""
    algorithm = (spec.speculative_algorithm or "").lower()
    if not algorithm or algorithm == "eagle3":  # EAGLE3 drafts in the runner (tokenspeed.spec.eagle3)
        return None
    if algorithm == "ngram":
        return NgramProposer()
    if algorithm == "repeat":
        return RepeatProposer()
    raise ValueError(f"unknown speculative algorithm {spec.speculative_algorithm!r}")
