"""The scheduler: no prefill/decode phases, only a token budget per step.

NOTE (design): every running request has `num_computed_tokens` chasing `num_tokens` (prompt + output). A step
gives each running request, in order, min(uncomputed, chunk limit, remaining budget) tokens, then admits
waiting requests FCFS while the budget, `max_num_seqs` and the cache allow. The chunk limit is
chunked_prefill_size, or prefill_chunk_beside_decodes when a running request is decoding (a shorter step bounds
the decoders' inter-token latency). A chunk is shortened to end exactly
at the last page boundary of the known tokens, where a KDA checkpoint is taken, so a later turn (or a resume
after preemption) can start there. When pages run out, the most recently admitted running request is preempted
(its pages released, its tokens kept) and goes back to the front of the queue; no admission happens in a step
that preempted. The scheduler sees token counts and opaque page/slot ids only.
"""

from __future__ import annotations

import time
from collections import deque

from tokenspeed.cache import CacheManager
from tokenspeed.config import SchedulerConfig
from tokenspeed.core.request import Request, RequestState
from tokenspeed.scheduler.batch import ZERO_SLOT, ScheduledBatch, ScheduledRequest


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        checkpoint_chunk_ends: bool = False,
        num_spec_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config
        self._chunk_limit = config.chunked_prefill_size  # this step's (`schedule`)
        self.num_spec_tokens = num_spec_tokens  # draft tokens per decode step (0: no speculation)
        self.max_model_len = max_model_len
        self.cache = cache
        self.page_size = cache.page_size
        self.checkpoint_chunk_ends = checkpoint_chunk_ends
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Asynchronous scheduling: request id -> a page boundary its last step ended on while the tokens it fed
        # included a placeholder (no hash yet). Planned at the request's next step, before that step's forward.
        self.deferred_checkpoints: dict[str, int] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def forget(self, request_id: str) -> None:
        """Drop per-request scheduling state of a request that has ended (finished or aborted)."""
        self.deferred_checkpoints.pop(request_id, None)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; releases its cache. Returns it, or None if unknown / done."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    if req.state is RequestState.RUNNING:
                        self.cache.release(request_id)
                    req.transition(RequestState.ABORTED)
                    req.finish_reason = "abort"
                    self.forget(request_id)
                    return req
        return None

    # ----- building a step -----
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self._chunk_limit = self.config.chunked_prefill_size
        beside = self.config.prefill_chunk_beside_decodes
        if beside is not None and any(_decoding(r) for r in self.running):
            self._chunk_limit = min(beside, self._chunk_limit)
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to feed `req` this step (at most this step's chunk limit), ending at the last page boundary of its
        known tokens if it passes it."""
        start = req.num_computed_tokens
        n = min(req.num_uncomputed_tokens, self._chunk_limit, budget)
        boundary = req.num_tokens // self.page_size * self.page_size
        if start < boundary < start + n:
            n = boundary - start
        return n

    def _checkpoint(self, batch: ScheduledBatch, req: Request, slot: int, end: int, before: bool = False) -> None:
        """Ask the cache for a checkpoint when the step ends on a page boundary worth resuming from (`before`: a
        deferred one, copied before this step's forward, when the live state is still the state at `end`)."""
        if end % self.page_size:
            return
        prompt_boundary = req.num_prompt_tokens // self.page_size * self.page_size
        last_boundary = req.num_tokens // self.page_size * self.page_size
        if end == prompt_boundary or (self.checkpoint_chunk_ends and end < prompt_boundary):
            ckpt = self.cache.plan_checkpoint(req.request_id, req.all_token_ids, end, rolling=False)
        elif end == last_boundary and end > prompt_boundary:
            ckpt = self.cache.plan_checkpoint(req.request_id, req.all_token_ids, end, rolling=True)
        else:
            return
        if ckpt is not None:
            (batch.state_copies_before if before else batch.state_copies_after).append((slot, ckpt))

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens for a decode step (one new token): the full window, bounded by the context and the budget
        only. Near max_tokens the window is not shortened: tokens accepted past it are dropped when the request
        finishes, and a uniform window keeps the batch on its verify CUDA graph (a shorter one runs eagerly)."""
        if not self.num_spec_tokens or n != 1 or req.num_uncomputed_tokens != 1:
            return 0
        room = self.num_spec_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - req.num_tokens - 1)
        return max(0, min(room, budget - 1))

    def _add(self, batch: ScheduledBatch, req: Request, n: int, drafts: int = 0) -> None:
        rid, start = req.request_id, req.num_computed_tokens
        slot = self.cache.slot(rid)
        end = start + n
        batch.requests.append(ScheduledRequest(  # the page table is the cache's live list: no copy per step
            request=req, num_computed_tokens=start, num_new_tokens=n, page_table=self.cache.page_table(rid),
            slot=slot, sample=end == len(req.all_token_ids), num_draft_tokens=drafts,
        ))
        deferred = self.deferred_checkpoints.pop(rid, None)
        if deferred == start and start <= req.num_tokens - req.num_placeholders:
            self._checkpoint(batch, req, slot, start, before=True)
        if not drafts and not end % self.page_size:  # a verify step's end is known only after acceptance
            if end > req.num_tokens - req.num_placeholders:  # it feeds a token still on the device: no hash yet
                self.deferred_checkpoints[rid] = end
            else:
                self._checkpoint(batch, req, slot, end)
        if req.stats.first_scheduled_time is None:
            req.stats.first_scheduled_time = time.monotonic()

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if _decoding(req):  # one new token (no chunk cut)
                n = 1
            else:
                n = self._chunk(req, budget)
                if n <= 0:
                    i += 1
                    continue
            drafts = self._num_drafts(req, n, budget) if self.num_spec_tokens else 0
            while not self.cache.grow(req.request_id, req.num_computed_tokens + n + drafts):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    return budget
            self._add(batch, req, n, drafts)
            budget -= n + drafts
            i += 1
        return budget

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.forget(req.request_id)
        # its hashed pages hold known tokens only (a placeholder's page has no hash yet): kept for its resumption
        self.cache.release(req.request_id, req.all_token_ids, req.num_prompt_tokens)
        req.transition(RequestState.PREEMPTED)
        req.num_computed_tokens = 0
        req.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req.request_id)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            use_prefix = req.params.prompt_logprobs is None  # prompt logprobs need every position computed
            admission = self.cache.admit(req.request_id, req.all_token_ids if use_prefix else req.all_token_ids[:1])
            if admission is None:
                return
            req.num_computed_tokens = admission.num_cached_tokens
            n = self._chunk(req, budget)
            if not self.cache.grow(req.request_id, req.num_computed_tokens + n):
                self.cache.release(req.request_id)
                req.num_computed_tokens = 0
                return
            if req.state is RequestState.WAITING:
                req.num_cached_tokens = admission.num_cached_tokens
            src = admission.restore_from if admission.restore_from is not None else ZERO_SLOT
            batch.state_copies_before.append((src, admission.slot))
            self.waiting.popleft()
            req.transition(RequestState.RUNNING)
            self.running.append(req)
            self._add(batch, req, n)
            budget -= n


def _decoding(req: Request) -> bool:
    """Whether `req` takes one new token this step (it has sampled every token it knows but the last)."""
    return len(req.all_token_ids) - req.num_computed_tokens == 1
