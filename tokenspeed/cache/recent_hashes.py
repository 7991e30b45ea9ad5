"""Page hashes of recently finished requests, reused by a new prompt that starts with the same tokens.

An agentic conversation sends its whole history again every turn: the new prompt is the previous request's
prompt and output plus a short tail. Hashing that history page by page (one blake2b call per page: about 15 ms
for 200K tokens in pages of 16, on the engine loop, while every decoding stream waits) would repeat work the
previous turn already did. `RecentHashes` keeps, for the last few finished requests, the tokens of their full
pages and those pages' chained hashes. A new prompt looks among the kept requests that start with its first page
(many conversations share a system prompt, so there may be several) for one whose last page, or whose prompt's
last full page, it repeats at the same place: the previous turn of its own conversation (otherwise the most recent
candidate). It takes that request's hashes of the pages they share, the shared run found by comparing the tokens
themselves (list comparisons in C), so a reused hash is exactly the hash of the prompt's own tokens; only the pages
after the run are hashed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenspeed.cache.hashing import ROOT_HASH, page_hash

RECENT_REQUESTS = 64  # finished requests whose page hashes are kept
# ... and at most this many of their tokens: an entry keeps its token ids alive (a Python list, about 36 bytes a
# token), so 4M tokens (20 histories of 200K) bound the memo at about 150 MB of host memory
RECENT_TOKENS = 4_000_000


@dataclass
class _Entry:
    tokens: list[int]  # the request's full pages' tokens
    hashes: list[int]  # their chained hashes
    prompt_pages: int  # full pages of its prompt (its next turn usually repeats the prompt, maybe not the output)


class RecentHashes:
    """Kept requests by their last page hash (LRU), bounded by a request count and a token count, indexed by their
    first page hash."""

    def __init__(self, page_size: int, capacity: int = RECENT_REQUESTS, max_tokens: int = RECENT_TOKENS) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.max_tokens = max_tokens
        self.num_tokens = 0  # tokens held by the entries
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._by_first: dict[int, list[int]] = {}  # first page hash -> keys of the entries that start with it

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, token_ids: Sequence[int], hashes: Sequence[int], num_prompt_tokens: int = 0) -> None:
        """Keep copies of a finished request's hashed pages: hashes[i] must be the chained hash of pages 0..i of
        token_ids (num_prompt_tokens of them its prompt). Drops the least recently used entries beyond the request
        or token bound (a request longer than the token bound is not kept)."""
        n = min(len(hashes), len(token_ids) // self.page_size)
        if n == 0 or self.capacity <= 0 or n * self.page_size > self.max_tokens:
            return
        key = hashes[n - 1]
        self._drop(key)
        self._entries[key] = _Entry(list(token_ids[: n * self.page_size]), list(hashes[:n]),
                                    min(num_prompt_tokens // self.page_size, n))
        self._by_first.setdefault(hashes[0], []).append(key)
        self.num_tokens += n * self.page_size
        while len(self._entries) > self.capacity or self.num_tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def prefix_hashes(self, token_ids: Sequence[int], max_pages: int) -> list[int]:
        """The chained hashes of the first pages of token_ids (at most max_pages) that a kept request shares with
        it, token for token; [] when none does (also without a full first page)."""
        p = self.page_size
        if max_pages <= 0 or len(token_ids) < p or not self._entries:
            return []
        keys = self._by_first.get(page_hash(ROOT_HASH, token_ids[:p]))
        if not keys:
            return []
        key = next((k for k in reversed(keys) if self._repeats(token_ids, self._entries[k])), keys[-1])
        entry = self._entries[key]
        self._entries.move_to_end(key)
        n = min(len(entry.hashes), max_pages, len(token_ids) // p)
        shared = n if token_ids[: n * p] == entry.tokens[: n * p] else _shared_pages(token_ids, entry.tokens, n, p)
        return entry.hashes[:shared]

    def _repeats(self, token_ids: Sequence[int], entry: _Entry) -> bool:
        """Whether token_ids holds the entry's last page, or its prompt's last full page, at the same place."""
        p = self.page_size
        for pages in (len(entry.hashes), entry.prompt_pages):
            if 0 < pages and pages * p <= len(token_ids):
                lo = (pages - 1) * p
                if token_ids[lo : lo + p] == entry.tokens[lo : lo + p]:
                    return True
        return False

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.num_tokens -= len(entry.tokens)
        same_first = self._by_first[entry.hashes[0]]
        same_first.remove(key)
        if not same_first:
            del self._by_first[entry.hashes[0]]


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
