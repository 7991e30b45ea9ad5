"""Cache manager bookkeeping (no tensors): matching with checkpoint back-off, refcounts, LRU eviction, integrity.

Scenarios: a prompt matches the longest cached run backed off to a checkpoint and never its last token; shared
pages are refcounted; unreferenced cached pages are evicted LRU and take their checkpoints with them; rolling
checkpoints keep one per request; a pending (not yet written) checkpoint never matches; release frees everything.
"""

from __future__ import annotations

from tokenspeed.cache import CacheManager, CachePlan

P = 4


def _cm(pages: int = 16, slots: int = 4, state: bool = True) -> CacheManager:
    return CacheManager(CachePlan(num_pages=pages, page_size=P, num_slots=slots, needs_state=state))


def _run(cm: CacheManager, rid: str, tokens: list[int], checkpoint_at: int | None = None) -> int | None:
    """Admit, compute every token in one step (checkpoint at a boundary if asked), commit; returns the slot."""
    adm = cm.admit(rid, tokens)
    assert adm is not None and cm.grow(rid, len(tokens))
    ckpt = cm.plan_checkpoint(rid, tokens, checkpoint_at, rolling=False) if checkpoint_at else None
    cm.commit(rid, tokens, len(tokens))
    cm.check_integrity()
    return ckpt


def test_match_backs_off_to_checkpoint_and_keeps_one_token() -> None:
    cm = _cm()
    a = list(range(100, 114))  # 14 tokens: 3 full pages
    _run(cm, "a", a, checkpoint_at=8)
    cm.release("a")
    # all 3 pages cached, but the only checkpoint is at 8 tokens
    assert cm.match(a + [1, 2, 3])[0] == 2
    # without KDA state any cached boundary works, but never the whole prompt
    cm2 = _cm(state=False)
    _run(cm2, "a", a[:12])
    cm2.release("a")
    assert cm2.match(a[:12])[0] == 2 and cm2.match(a[:12] + [5])[0] == 3


def test_shared_pages_are_refcounted_and_released() -> None:
    cm = _cm()
    a = list(range(12))
    _run(cm, "a", a, checkpoint_at=12)
    adm = cm.admit("b", a + [50, 51])
    assert adm is not None and adm.num_cached_tokens == 12 and adm.restore_from is not None
    assert cm.page_table("b") == cm.page_table("a")[:3]
    assert all(cm.pages.refcount[p] == 2 for p in cm.page_table("b"))
    cm.check_integrity()
    cm.release("a")
    cm.release("b")
    cm.check_integrity()
    assert cm.pages.num_free_pages + len(cm.pages.evictable) == 16 and not cm.slots.live


def test_lru_eviction_drops_checkpoints_of_evicted_pages() -> None:
    cm = _cm(pages=6, slots=4)
    old, new = list(range(8)), list(range(50, 58))
    _run(cm, "old", old, checkpoint_at=8)
    cm.release("old")
    _run(cm, "new", new, checkpoint_at=8)
    cm.release("new")
    assert cm.slots.num_checkpoints == 2
    assert cm.admit("big", list(range(200, 220))) is not None and cm.grow("big", 20)  # needs 5 pages: evicts
    cm.check_integrity()
    assert cm.match(old + [1]) == (0, None)  # the least recently used prefix went first
    # then the deeper page of `new` (leaves before parents): its checkpoint at 8 went with it
    assert cm.match(new + [1]) == (0, None) and cm.slots.num_checkpoints == 0
    assert len(cm.pages.evictable) == 1  # new's first page is still cached


def test_grow_fails_cleanly_when_everything_is_referenced() -> None:
    cm = _cm(pages=3)
    assert cm.admit("a", list(range(8))) is not None and cm.grow("a", 8)
    assert cm.admit("b", list(range(9, 20))) is not None
    assert not cm.grow("b", 8)  # 1 page left, 2 needed: nothing changes
    assert cm.page_table("b") == [] and cm.pages.num_free_pages == 1
    cm.check_integrity()


def test_rolling_checkpoint_keeps_one_per_request() -> None:
    cm = _cm(slots=6)
    toks = list(range(20))
    assert cm.admit("a", toks[:5]) is not None
    for end in (8, 12, 16):
        assert cm.grow("a", end)
        assert cm.plan_checkpoint("a", toks, end, rolling=True) is not None
        cm.commit("a", toks, end)
    assert cm.slots.num_checkpoints == 1
    cm.release("a")
    assert cm.match(toks[:17])[0] == 4
    cm.check_integrity()


def test_pending_checkpoint_is_not_matched_until_commit() -> None:
    cm = _cm(slots=6)
    a = list(range(8))
    _run(cm, "a", a, checkpoint_at=8)  # publishes pages and a checkpoint at 8
    cm.admit("b", a + [9])
    cm.grow("b", 12)
    b = a + [9, 10, 11, 12]
    cm.plan_checkpoint("b", b, 12, rolling=False)
    assert cm.match(b + [13])[0] == 2  # page 3 not published, its checkpoint pending
    cm.commit("b", b, 12)
    assert cm.match(b + [13])[0] == 3
    cm.check_integrity()


def test_prefix_caching_disabled_matches_nothing() -> None:
    cm = CacheManager(CachePlan(num_pages=8, page_size=P, num_slots=2, enable_prefix_caching=False))
    _run(cm, "a", list(range(8)))
    cm.release("a")
    assert cm.match(list(range(9))) == (0, None)
    assert not cm.pages.index and cm.pages.num_free_pages == 8
