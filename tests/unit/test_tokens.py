"""`core.tokens.ExtendedTokens`, the no-copy view of a token list plus a few tokens after it."""

from __future__ import annotations

import random

import pytest

from tokenspeed.cache.hashing import extend_hashes
from tokenspeed.core.tokens import ExtendedTokens


def test_extended_token_view_equals_the_concatenation() -> None:
    """The view of a request's tokens plus its accepted drafts (`core.tokens.ExtendedTokens`, what the cache commit
    and a sampled window position read) reads as `base + tail` for every index, slice and iteration, and hashes
    the same pages, without copying base."""

    rng = random.Random(5)
    for n_base, n_tail in [(0, 3), (7, 0), (13, 4), (32, 3), (1, 1)]:
        base, tail = [rng.randrange(100) for _ in range(n_base)], [rng.randrange(100) for _ in range(n_tail)]
        view, want = ExtendedTokens(base, tail), base + tail
        assert len(view) == len(want) and list(view) == want
        assert [view[i] for i in range(-len(want), len(want))] == [want[i] for i in range(-len(want), len(want))]
        for start in range(-2, len(want) + 2):
            for stop in range(-2, len(want) + 3):
                assert view[start:stop] == want[start:stop]
        assert view[::2] == want[::2]
        with pytest.raises(IndexError):
            view[len(want)]
        for page in (1, 4, 8):
            assert extend_hashes([], view, page, len(want) // page) == extend_hashes([], want, page, len(want) // page)
