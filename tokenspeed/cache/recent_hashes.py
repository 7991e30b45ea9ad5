"""Page hashes of recently finished requests, reused by a new prompt that starts with the same tokens.

An agentic conversation sends its whole history again every turn: the new prompt is the previous request's
prompt and output plus a short tail. Hashing that history page by page (one blake2b call per page: about 15 ms
for 200K tokens in pages of 16, on the engine loop, while every decoding stream waits) would repeat work the
previous turn already did. `RecentHashes` keeps, for the last few finished requests, the tokens of their full
pages and those pages' chained hashes; a new prompt whose first page hashes to a kept entry's first hash takes
the kept hashes of the pages it shares with that entry, the shared run found by comparing the tokens themselves
(list comparisons in C), so a reused hash is exactly the hash of the prompt's own tokens. Only the pages past
the shared run are hashed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenspeed.cache.hashing import ROOT_HASH, page_hash

RECENT_REQUESTS = 64  # finished requests whose page hashes are kept
# ... and at most this many of their tokens: an entry keeps its token ids alive (a Python list, about 36 bytes a
# token), so 4M tokens (20 histories of 200K) bound the memo at about 150 MB of host memory
RECENT_TOKENS = 4_000_000


class RecentHashes:
    """first page hash -> (tokens of the full pages, their chained hashes) of recently finished requests, LRU,
    bounded by a request count and a token count."""

    def __init__(self, page_size: int, capacity: int = RECENT_REQUESTS, max_tokens: int = RECENT_TOKENS) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.max_tokens = max_tokens
        self.num_tokens = 0  # tokens held by the entries
        self._entries: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, token_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Keep copies of a finished request's hashed pages: hashes[i] must be the chained hash of pages 0..i of
        token_ids. Replaces an entry with the same first page and drops the least recently used beyond the
        request or token bound (a request longer than the token bound is not kept)."""
        n = min(len(hashes), len(token_ids) // self.page_size)
        if n == 0 or self.capacity <= 0 or n * self.page_size > self.max_tokens:
            return
        old = self._entries.pop(hashes[0], None)
        if old is not None:
            self.num_tokens -= len(old[0])
        self._entries[hashes[0]] = (list(token_ids[: n * self.page_size]), list(hashes[:n]))
        self.num_tokens += n * self.page_size
        while len(self._entries) > self.capacity or self.num_tokens > self.max_tokens:
            self.num_tokens -= len(self._entries.popitem(last=False)[1][0])

    def prefix_hashes(self, token_ids: Sequence[int], max_pages: int) -> list[int]:
        """The chained hashes of the first pages of token_ids (at most max_pages) that a kept request shares with
        it, token for token; [] when none does (also without a full first page)."""
        p = self.page_size
        if max_pages <= 0 or len(token_ids) < p or not self._entries:
            return []
        entry = self._entries.get(page_hash(ROOT_HASH, token_ids[:p]))
        if entry is None:
            return []
        tokens, hashes = entry
        n = min(len(hashes), max_pages, len(token_ids) // p)
        shared = n if token_ids[: n * p] == tokens[: n * p] else _shared_pages(token_ids, tokens, n, p)
        self._entries.move_to_end(hashes[0])
        return hashes[:shared]


def _shared_pages(a: Sequence[int], b: Sequence[int], n: int, p: int) -> int:
    """The largest m <= n with a[:m * p] == b[:m * p] (prefix equality is monotone in m: a binary search)."""
    lo, hi = 0, n  # a[:lo * p] == b[:lo * p] holds; a[:(hi + 1) * p] differs or hi == n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[(lo * p) : mid * p] == b[(lo * p) : mid * p]:
            lo = mid
        else:
            hi = mid - 1
    return lo
