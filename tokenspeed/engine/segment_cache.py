"""Token ids of recently encoded chat segments, so a conversation's next turn tokenizes only its new messages.

A chat request carries the whole conversation every turn, and the server renders it into (text, is_control)
segments that are encoded one by one (`Tokenizer.encode_segments`: a segment's ids do not depend on its
neighbours). Encoding a 160K-token history takes ~120 ms with a HuggingFace fast tokenizer, on the server's event
loop, where every other stream waits. `SegmentCache` keeps the ids of long segments (an LRU bounded by the tokens
it holds) keyed by their exact text, so the next turn re-encodes only what is new. A hit returns exactly what the
encoder returned for the same text.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable

MIN_CHARS = 256  # shorter segments (template markers, short messages) are cheap to encode: not kept
MAX_TOKENS = 4_000_000  # ids held (8 bytes each, plus the texts themselves): about 50 MB


class SegmentCache:
    """(text, is_control) -> ids of the segments encoded most recently, LRU, at most max_tokens ids in all."""

    def __init__(self, max_tokens: int = MAX_TOKENS, min_chars: int = MIN_CHARS) -> None:
        self.max_tokens = max_tokens
        self.min_chars = min_chars
        self.num_tokens = 0
        self.hits = self.misses = 0
        self._ids: OrderedDict[tuple[str, bool], array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def encode(self, text: str, control: bool, encoder: Callable[[str], list[int]]) -> list[int] | array:
        """encoder(text), from the cache when this segment was encoded recently (the caller only reads it)."""
        if len(text) < self.min_chars:
            return encoder(text)
        key = (text, control)
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
            self.hits += 1
            return ids
        self.misses += 1
        fresh = encoder(text)
        if len(fresh) <= self.max_tokens:
            self._ids[key] = array("q", fresh)
            self.num_tokens += len(fresh)
            while self.num_tokens > self.max_tokens:
                self.num_tokens -= len(self._ids.popitem(last=False)[1])
        return fresh
