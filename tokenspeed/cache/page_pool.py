"""Physical pages: a free list, reference counts, the prefix index and the LRU of evictable cached pages."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class PagePool:
    """Owns page ids 0..num_pages-1. Each page is exactly one of: free, referenced, evictable (cached, refcount 0).

    on_evict(hash) is called when a cached page is reclaimed, so dependants (checkpoints) can be dropped.
    """

    def __init__(self, num_pages: int, on_evict: Callable[[int], None] | None = None) -> None:
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_pages
        self.page_to_hash: dict[int, int] = {}
        self.index: dict[int, int] = {}  # page hash -> page id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.on_evict = on_evict

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can get: free plus evictable."""
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with refcount 1, evicting LRU cached pages if needed; None (and no change) if impossible."""
        if n > self.num_available_pages:
            return None
        pages = []
        for _ in range(n):
            page = self.free.pop() if self.free else self._evict_one()
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def _evict_one(self) -> int:
        page, _ = self.evictable.popitem(last=False)
        h = self.page_to_hash.pop(page)
        del self.index[h]
        if self.on_evict is not None:
            self.on_evict(h)
        return page

    def ref(self, page: int) -> None:
        """Take a reference on a referenced or cached page (a prefix hit)."""
        self.ref_all((page,))

    def ref_all(self, pages: Sequence[int]) -> None:
        """Take a reference on each page in order (a prefix hit of many pages): each must be referenced or cached;
        a cached page stops being evictable."""
        refcount, evictable = self.refcount, self.evictable
        for page in pages:
            if refcount[page] == 0:
                if page not in evictable:
                    raise AssertionError(f"page {page} is free; only cached pages can be shared")
                del evictable[page]
            refcount[page] += 1

    def unref(self, page: int) -> None:
        """Drop a reference; an unreferenced page becomes evictable if cached, else free."""
        if self.refcount[page] <= 0:
            raise AssertionError(f"page {page} released more often than referenced")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.page_to_hash:
                self.evictable[page] = None
            else:
                self.free.append(page)

    def lookup(self, h: int) -> int | None:
        return self.index.get(h)

    def insert(self, page: int, h: int) -> bool:
        """Publish a full, referenced page under hash h. False if h is already cached (page stays private)."""
        if h in self.index or page in self.page_to_hash:
            return False
        self.index[h] = page
        self.page_to_hash[page] = h
        return True

    def touch(self, pages: list[int]) -> None:
        """Mark pages as recently used (only matters for evictable ones)."""
        for p in pages:
            if p in self.evictable:
                self.evictable.move_to_end(p)

    def check(self) -> None:
        """Raise AssertionError if the pool's invariants do not hold."""
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free), "duplicate page in the free list"
        for p in range(self.num_pages):
            states = (p in free) + (p in evictable) + (self.refcount[p] > 0)
            assert states == 1, f"page {p}: free={p in free} evictable={p in evictable} ref={self.refcount[p]}"
        assert all(p in self.page_to_hash for p in evictable), "an evictable page is not cached"
        assert not (free & set(self.page_to_hash)), "a free page is still in the prefix index"
        assert {self.index[h] for h in self.index} == set(self.page_to_hash), "index and page hashes disagree"
        assert all(self.index[h] == p for p, h in self.page_to_hash.items()), "index and page hashes disagree"
