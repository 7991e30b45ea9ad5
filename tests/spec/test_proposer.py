"""The n-gram (prompt lookup) proposer: the per-request index gives the window scan's drafts at every step of a
growing token list, across window edges, for lists that change other than by appends, and after release."""

from __future__ import annotations

import random

import pytest

from tokenspeed.spec.proposer import NgramProposer, RepeatProposer


def _grow(rng: random.Random, tokens: list[int], vocab: int) -> None:
    """Append 1-4 tokens: often a copy of an earlier stretch (so matches exist), else fresh ones."""
    n = rng.randint(1, 4)
    if tokens and rng.random() < 0.6:
        s = rng.randrange(len(tokens))
        tokens.extend(tokens[s:s + n] or [rng.randrange(vocab)])
    else:
        tokens.extend(rng.randrange(vocab) for _ in range(n))


@pytest.mark.parametrize("window,vocab", [(4096, 50), (300, 40), (16, 6), (7, 3), (2, 2)])
@pytest.mark.parametrize("start", [0, 23, 700])  # tokens before the first call: 700 builds the index in one pass
@pytest.mark.parametrize("seed", [0, 1])
def test_index_equals_scan_as_tokens_grow(window, vocab, start, seed):
    rng = random.Random(seed)
    scan, indexed = NgramProposer(window=window), NgramProposer(window=window)
    tokens = [rng.randrange(vocab) for _ in range(start)]
    for _ in range(150):
        k = rng.randint(1, 5)
        assert indexed.propose(tokens, k, key="r") == scan.propose(tokens, k), (len(tokens), k)
        _grow(rng, tokens, vocab)


def test_index_rebuilds_when_the_list_changes_and_forgets_on_release():
    p, scan = NgramProposer(window=64), NgramProposer(window=64)
    a = [1, 2, 3, 1, 2, 3, 1, 2]
    assert p.propose(a, 3, key="r") == scan.propose(a, 3) == [3, 1, 2]
    b = [5, 6, 7, 5, 6]  # another list under the same key: not an append of a
    assert p.propose(b, 2, key="r") == scan.propose(b, 2) == [7, 5]
    c = b[:-1]  # shortened (placeholders dropped)
    assert p.propose(c, 2, key="r") == scan.propose(c, 2)
    p.release("r")
    assert "r" not in p._indexes
    assert p.propose([9, 9, 9], 2, key="s") == [9] and p.propose([], 2, key="t") == []
    assert RepeatProposer().propose([4, 8], 3, key="r") == [8, 8, 8]
