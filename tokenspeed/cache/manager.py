"""The cache manager: the one facade the scheduler calls (admit, grow, plan_checkpoint, commit, release).

Vocabulary and rules: docs/cache.md. The manager decides page and slot ids; the executor performs the state
copies it asks for (restore before a forward, checkpoint after it) on the device buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenspeed.cache.hashing import extend_hashes
from tokenspeed.cache.page_list import PageList
from tokenspeed.cache.page_pool import PagePool
from tokenspeed.cache.recent_hashes import RecentHashes
from tokenspeed.cache.slot_pool import SlotPool


@dataclass(frozen=True)
class CachePlan:
    """Pool sizes (decided by the planner from a byte budget)."""

    num_pages: int  # MLA pages
    page_size: int  # tokens per page
    num_slots: int  # KDA state slots: live (max_num_seqs) + checkpoints
    enable_prefix_caching: bool = True
    needs_state: bool = True  # the model has KDA layers (resuming needs a checkpoint)


@dataclass(frozen=True)
class Admission:
    """Result of admitting a request: where it resumes."""

    num_cached_tokens: int  # positions already in the cache (a multiple of page_size)
    slot: int  # the live state slot
    restore_from: int | None  # checkpoint slot to copy into `slot`; None: zero the slot


@dataclass
class _RequestCache:
    pages: PageList = field(default_factory=PageList)  # a list[int] that keeps an int32 copy for ForwardBatch
    hashes: list[int] = field(default_factory=list)  # chained hashes of full pages (may run ahead of compute)
    num_published: int = 0  # pages inserted (or found duplicate) in the prefix index
    slot: int | None = None
    rolling: int | None = None  # key of this request's rolling decode checkpoint
    pending: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint key, boundary) planned, uncommitted


class CacheManager:
    def __init__(self, plan: CachePlan) -> None:
        self.plan = plan
        self.page_size = plan.page_size
        self.slots = SlotPool(plan.num_slots)
        self.pages = PagePool(plan.num_pages, on_evict=self._on_page_evicted)
        self.recent = RecentHashes(plan.page_size)  # finished requests' page hashes, for the next turn's prompt
        self.requests: dict[str, _RequestCache] = {}
        self.pending: set[int] = set()
        self.num_hit_tokens = 0  # prefix-cache statistics: tokens served from the cache / tokens asked
        self.num_query_tokens = 0

    def _on_page_evicted(self, key: int) -> None:
        """A cached page was reclaimed: its checkpoint can never match again (unless a step is still saving it)."""
        if key not in self.pending:
            self.slots.drop_checkpoint(key)

    # ----- admission -----
    def match(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> tuple[int, int | None]:
        """(cached pages, checkpoint slot) for a prompt: the longest cached run, backed off to a checkpoint.

        At most len(token_ids) - 1 tokens are matched. Does not modify anything but LRU order.
        """
        pages, slot = self._matched_pages(token_ids, [] if hashes is None else hashes)
        return len(pages), slot

    def _matched_pages(self, token_ids: Sequence[int], hashes: list[int]) -> tuple[list[int], int | None]:
        """`match` with the matched page ids themselves; `hashes` (mutated) is extended to the prompt's full pages
        (seeded from `recent` when empty)."""
        if not self.plan.enable_prefix_caching or len(token_ids) <= 1:
            return [], None
        p = self.page_size
        limit = (len(token_ids) - 1) // p
        if not hashes:  # a new turn of a conversation: the shared history's hashes from its previous request
            hashes.extend(self.recent.prefix_hashes(token_ids, limit))
        extend_hashes(hashes, token_ids, p, limit)
        index, pages = self.pages.index, []
        for h in hashes:
            page = index.get(h)
            if page is None:
                break
            pages.append(page)
        if not self.plan.needs_state:
            return pages, None
        for b in range(len(pages), 0, -1):
            if hashes[b - 1] not in self.pending:
                slot = self.slots.lookup(hashes[b - 1])
                if slot is not None:
                    return pages[:b], slot
        return [], None

    def admit(self, request_id: str, token_ids: Sequence[int]) -> Admission | None:
        """Give a waiting request a live slot and its matched pages. None (nothing changed) if no slot is free."""
        rc = _RequestCache()
        pages, ckpt = self._matched_pages(token_ids, rc.hashes)
        slot = self.slots.acquire_live()
        if slot is None:
            return None
        rc.slot = slot
        rc.pages = PageList(pages)
        self.pages.ref_all(pages)
        num_pages = rc.num_published = len(pages)
        self.requests[request_id] = rc
        self.num_hit_tokens += num_pages * self.page_size
        self.num_query_tokens += len(token_ids)
        return Admission(num_pages * self.page_size, slot, ckpt)

    # ----- growth and checkpoints -----
    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Hold pages for positions [0, num_tokens). False (nothing changed) if the pool cannot supply them."""
        rc = self.requests[request_id]
        need = -(-num_tokens // self.page_size) - len(rc.pages)
        if need <= 0:
            return True
        new = self.pages.allocate(need)
        if new is None:
            return False
        rc.pages.extend(new)
        return True

    def plan_checkpoint(self, request_id: str, token_ids: Sequence[int], boundary: int, rolling: bool) -> int | None:
        """Reserve a checkpoint of the state at `boundary` tokens (a page boundary the step ends on).

        Returns the checkpoint slot to copy the live slot into after the forward, or None (already saved, no slot,
        or caching disabled). rolling: a decode-time checkpoint; the request's previous rolling one is dropped.
        """
        if not (self.plan.enable_prefix_caching and self.plan.needs_state) or boundary % self.page_size:
            return None
        rc = self.requests[request_id]
        extend_hashes(rc.hashes, token_ids, self.page_size, boundary // self.page_size)
        key = rc.hashes[boundary // self.page_size - 1]
        protect = self.pending | ({rc.rolling} if rc.rolling is not None else set())
        slot = self.slots.new_checkpoint(key, protect)
        if slot is None:
            return None
        self.pending.add(key)
        rc.pending.append((key, boundary))
        if rolling:
            if rc.rolling is not None:
                self.slots.drop_checkpoint(rc.rolling)
            rc.rolling = key
        return slot

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """After a step: publish the request's pages that became full; its pending checkpoints up to
        num_computed_tokens become matchable (with asynchronous scheduling a later step, already planned, may hold
        checkpoints past it: they stay pending until that step's commit)."""
        rc = self.requests[request_id]
        full = num_computed_tokens // self.page_size
        if full > rc.num_published:  # else nothing new to hash or publish (hashes cover the published pages)
            if self.plan.enable_prefix_caching:
                extend_hashes(rc.hashes, token_ids, self.page_size, full)
                for i in range(rc.num_published, full):
                    self.pages.insert(rc.pages[i], rc.hashes[i])
            rc.num_published = full
        # No LRU touch of rc.pages here: a request's own pages are referenced, hence never evictable (an O(pages)
        # no-op per request per step). Their LRU position is set when release() makes them evictable.
        if rc.pending:
            for key, boundary in rc.pending:
                if boundary <= num_computed_tokens:
                    self.pending.discard(key)
            rc.pending = [(key, b) for key, b in rc.pending if b > num_computed_tokens]

    def release(self, request_id: str, token_ids: Sequence[int] | None = None, num_prompt_tokens: int = 0) -> None:
        """Drop a finished, aborted or preempted request's pages and live slot (cached pages stay evictable).
        With `token_ids` (a finished request's tokens, the first num_prompt_tokens its prompt), the hashes of its
        published pages are kept for the next prompt that starts with them (`RecentHashes`)."""
        rc = self.requests.pop(request_id)
        if token_ids is not None and self.plan.enable_prefix_caching and rc.num_published:
            self.recent.remember(token_ids, rc.hashes[: rc.num_published], num_prompt_tokens)
        for key, _ in rc.pending:  # a step that never ran: its checkpoints hold no valid state
            self.pending.discard(key)
            self.slots.drop_checkpoint(key)
        for page in reversed(rc.pages):  # deeper pages become LRU-older than their parents
            self.pages.unref(page)
        if rc.slot is not None:
            self.slots.release_live(rc.slot)

    # ----- views -----
    def page_table(self, request_id: str) -> list[int]:
        """The request's page ids: the live list (a `PageList`), which only grows until the request is released."""
        return self.requests[request_id].pages

    def slot(self, request_id: str) -> int:
        slot = self.requests[request_id].slot
        assert slot is not None
        return slot

    def can_admit(self) -> bool:
        return bool(self.slots.free) or self.slots.num_checkpoints > len(self.pending)

    @property
    def usage(self) -> float:
        """Fraction of pages referenced by running requests."""
        return 1.0 - self.pages.num_available_pages / max(self.plan.num_pages, 1)

    def check_integrity(self) -> None:
        """Raise AssertionError if any rule of docs/cache.md is broken."""
        self.pages.check()
        self.slots.check()
        counts = [0] * self.plan.num_pages
        for rid, rc in self.requests.items():
            for page in rc.pages:
                counts[page] += 1
            assert rc.slot in self.slots.live, f"request {rid} has no live slot"
        assert counts == self.pages.refcount, "refcounts differ from the page tables"
        assert len(self.slots.live) == len(self.requests), "a live slot without a request"
        for key in self.slots.checkpoints:
            assert key in self.pages.index or key in self.pending, "checkpoint of an uncached prefix"
