"""The per-request record: what was sent, what came back, and when (one line of the per-request JSONL)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RequestRecord:
    """One request. Times: `start_s` in seconds from the run's start, latencies in ms; counts in tokens."""

    phase: str  # warmup | scored
    lane: int
    session: int
    epoch: int  # how many times the session was restarted before (a fresh salt each time); -1: warmup copy
    conv: int  # 0: root conversation
    turn: int
    kind: str  # root | subagent | sidecar | compaction | warmup
    prompt_len: int  # tokens sent
    max_tokens: int
    ideal_cached: int  # tokens an infinite block-level cache would have served
    start_s: float
    ok: bool
    status: int = 0
    error: str | None = None
    overflow: bool = False
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    chunk_ms: tuple[float, ...] = ()  # arrival of each token-carrying chunk, ms after the request was sent
    chunk_tokens: tuple[int, ...] = ()
    prompt_tokens: int | None = None  # usage
    output_tokens: int | None = None  # usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens

    @property
    def first_turn(self) -> bool:
        """The first request of a conversation (a fresh context)."""
        return self.turn == 0

    @property
    def end_s(self) -> float:
        """Last token received (s from the run's start); the send time when nothing arrived."""
        return self.start_s + (self.e2el_ms or 0.0) / 1000.0

    @property
    def tpot_ms(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1): mean time per output token after the first (ms)."""
        n = self.output_tokens
        if not self.ok or n is None or n < 2 or self.ttft_ms is None or self.e2el_ms is None:
            return None
        return (self.e2el_ms - self.ttft_ms) / (n - 1)

    def itl_ms(self) -> list[float]:
        """Gaps between successive streamed tokens (ms); a chunk of k tokens contributes k gaps of gap / k."""
        out: list[float] = []
        for i in range(1, len(self.chunk_ms)):
            k = self.chunk_tokens[i]
            out.extend([(self.chunk_ms[i] - self.chunk_ms[i - 1]) / k] * k)
        return out

    def to_json(self) -> str:
        d = asdict(self)
        d["tpot_ms"] = self.tpot_ms
        d["chunk_ms"] = [round(x, 3) for x in self.chunk_ms]
        return json.dumps(d)

    @classmethod
    def from_json(cls, line: str) -> RequestRecord:
        d = json.loads(line)
        d.pop("tpot_ms", None)
        d["chunk_ms"] = tuple(d.get("chunk_ms", ()))
        d["chunk_tokens"] = tuple(d.get("chunk_tokens", ()))
        return cls(**d)
