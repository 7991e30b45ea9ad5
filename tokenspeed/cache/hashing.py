"""Chained page hashes: a page's hash names the whole prefix that ends with it."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """Stable 64-bit hash of (parent hash, the page's token ids); the same in every process."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def extend_hashes(hashes: list[int], token_ids: Sequence[int], page_size: int, num_full_pages: int) -> list[int]:
    """Append the hashes of full pages len(hashes)..num_full_pages-1 to `hashes` (mutated) and return it."""
    for i in range(len(hashes), num_full_pages):
        parent = hashes[i - 1] if i else ROOT_HASH
        hashes.append(page_hash(parent, token_ids[i * page_size : (i + 1) * page_size]))
    return hashes
