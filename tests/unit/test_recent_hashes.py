"""Page hashes reused across turns (`tokenspeed.cache.recent_hashes.RecentHashes`, through `CacheManager`).

Scenarios: a prompt that extends a remembered request gets that request's hashes for the shared pages, and they
equal hashing the prompt itself; a prompt that diverges at page k gets exactly k (found by token comparison, at
every divergence point); a different first page, a short prompt or max_pages bound the result; the oldest entries
go beyond capacity; in the cache manager a finished request's next turn hashes only its new pages and matches the
same pages as without the memo.
"""

from __future__ import annotations

import random

import pytest

from tokenspeed.cache import CacheManager, CachePlan, hashing, recent_hashes
from tokenspeed.cache.hashing import extend_hashes
from tokenspeed.cache.recent_hashes import RecentHashes

P = 4


def _hashes(tokens: list[int]) -> list[int]:
    return extend_hashes([], tokens, P, len(tokens) // P)


def test_an_extending_prompt_reuses_the_shared_pages() -> None:
    rng = random.Random(0)
    old = [rng.randrange(1000) for _ in range(10 * P + 2)]  # 10 full pages and 2 tokens
    memo = RecentHashes(P)
    memo.remember(old, _hashes(old))
    new = old + [rng.randrange(1000) for _ in range(9)]
    got = memo.prefix_hashes(new, max_pages=100)
    assert len(got) == 10 and got == _hashes(new)[:10]
    assert memo.prefix_hashes(new, max_pages=3) == got[:3]


@pytest.mark.parametrize("diverge", [P, P + 1, 3 * P + 2, 7 * P, 10 * P - 1])
def test_a_diverging_prompt_shares_exactly_the_equal_pages(diverge: int) -> None:
    rng = random.Random(diverge)
    old = [rng.randrange(1000) for _ in range(10 * P)]
    memo = RecentHashes(P)
    memo.remember(old, _hashes(old))
    new = list(old)
    new[diverge] += 1
    got = memo.prefix_hashes(new, max_pages=100)
    assert len(got) == diverge // P and got == _hashes(new)[: diverge // P]


def test_nothing_shared() -> None:
    memo = RecentHashes(P)
    assert memo.prefix_hashes(list(range(20)), 5) == []  # empty memo
    old = list(range(20))
    memo.remember(old, _hashes(old))
    assert memo.prefix_hashes([99] + old[1:], 5) == []  # another first page
    assert memo.prefix_hashes(old[:3], 5) == []  # no full page
    assert memo.prefix_hashes(old, 0) == []


def test_capacity_drops_the_least_recently_used() -> None:
    memo = RecentHashes(P, capacity=2)
    prompts = [[k] * 8 for k in range(3)]
    for t in prompts[:2]:
        memo.remember(t, _hashes(t))
    assert memo.prefix_hashes(prompts[0] + [5], 5)  # uses entry 0: entry 1 is now the oldest
    memo.remember(prompts[2], _hashes(prompts[2]))
    assert len(memo) == 2
    assert memo.prefix_hashes(prompts[1] + [5], 5) == [] and memo.prefix_hashes(prompts[0] + [5], 5)


def test_the_token_bound_drops_the_least_recently_used() -> None:
    memo = RecentHashes(P, capacity=10, max_tokens=5 * P)
    a, b, c = [1] * 3 * P, [2] * 2 * P, [3] * 2 * P
    for t in (a, b):
        memo.remember(t, _hashes(t))
    assert memo.num_tokens == 5 * P
    memo.remember(c, _hashes(c))  # 7 pages > 5: the oldest (a) goes
    assert memo.num_tokens == 4 * P and memo.prefix_hashes(a + [0], 9) == [] and memo.prefix_hashes(b + [0], 9)
    memo.remember(b, _hashes(b))  # the same request again: replaced, not doubled
    assert len(memo) == 2 and memo.num_tokens == 4 * P
    memo.remember([5] * 6 * P, _hashes([5] * 6 * P))  # longer than the bound: not kept
    assert len(memo) == 2


def test_conversations_sharing_a_system_prompt_find_their_own_previous_turn() -> None:
    """Two conversations start with the same pages (a system prompt); each next turn gets its own previous
    request's hashes, whichever finished last, also when that turn repeats only the previous prompt (its output
    re-rendered differently), and a third conversation gets the shared system prompt's."""
    rng = random.Random(5)
    system = [rng.randrange(1000) for _ in range(3 * P)]
    a_prompt = system + [rng.randrange(1000) for _ in range(5 * P + 1)]
    a_done = a_prompt + [rng.randrange(1000) for _ in range(2 * P)]
    b_done = system + [rng.randrange(1000) for _ in range(6 * P)]
    memo = RecentHashes(P)
    memo.remember(a_done, _hashes(a_done), num_prompt_tokens=len(a_prompt))
    memo.remember(b_done, _hashes(b_done), num_prompt_tokens=len(b_done) - P)  # B finished last
    a_next = a_done + [7] * 5
    assert memo.prefix_hashes(a_next, 100) == _hashes(a_next)[: len(a_done) // P]
    a_rerendered = a_prompt + [9] * (4 * P)  # the previous prompt, then other tokens than the output
    assert memo.prefix_hashes(a_rerendered, 100) == _hashes(a_rerendered)[: len(a_prompt) // P]
    c = system + [rng.randrange(1000) for _ in range(4 * P)]
    assert memo.prefix_hashes(c, 100) == _hashes(c)[:3]


def test_the_next_turn_hashes_only_its_new_pages(monkeypatch) -> None:
    plan = CachePlan(num_pages=64, page_size=P, num_slots=4, needs_state=False)
    cms = CacheManager(plan), CacheManager(plan)
    turn1 = list(range(100, 100 + 10 * P))
    turn2 = turn1 + list(range(7, 7 + 3 * P + 1))
    for cm in cms:
        assert cm.admit("a", turn1) is not None and cm.grow("a", len(turn1))
        cm.commit("a", turn1, len(turn1))
    cms[0].release("a", turn1)  # finished: its hashes are kept
    cms[1].release("a")  # preempted or aborted: nothing kept
    calls = []
    real = hashing.page_hash
    for module in (hashing, recent_hashes):
        monkeypatch.setattr(module, "page_hash", lambda *a: calls.append(1) or real(*a))
    with_memo = cms[0].admit("b", turn2)
    hashed_with_memo = len(calls)
    calls.clear()
    without = cms[1].admit("b", turn2)
    assert with_memo == without and with_memo.num_cached_tokens == 10 * P
    assert cms[0].page_table("b") == cms[1].page_table("b")
    assert cms[0].requests["b"].hashes == cms[1].requests["b"].hashes
    assert hashed_with_memo == 3 + 1 and len(calls) == 13  # 3 new full pages (+ the first page's lookup) vs all
    for cm in cms:
        cm.check_integrity()
