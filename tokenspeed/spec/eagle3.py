"""EAGLE3 drafting inside the model runner: the draft's cache, the target features it waits for, and the chain.

Draft position p holds (token p + 1, target feature of position p). For each speculating request, a step runs:
1. catch-up: one draft forward over the positions whose target features arrived since the last step (the prompt
   after prefill, or the accepted positions after a verify), whose last row proposes d1;
2. k - 1 single-token forwards, each fed the previous proposal and the draft's own previous hidden.
The draft cache uses the target's page ids (same positions), so it needs no allocator of its own. Rows written
for rejected drafts are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tokenspeed.models import ForwardBatch
from tokenspeed.models.eagle3 import Eagle3Draft
from tokenspeed.scheduler.batch import ScheduledRequest


@dataclass
class _Pending:
    start: int  # first position whose feature is not yet in the draft cache
    features: Tensor  # [m, num_aux * target_hidden] features of positions start .. start + m - 1


class Eagle3Drafter:
    def __init__(self, draft: Eagle3Draft, capture_layers: tuple[int, ...], num_pages: int, page_size: int) -> None:
        self.draft = draft
        self.capture_layers = capture_layers  # 1-based target layers to capture
        self.page_size = page_size
        self.cache = draft.allocate_cache(num_pages, page_size)
        self.pending: dict[str, _Pending] = {}

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def record(self, request_id: str, start: int, features: Tensor) -> None:
        """Target features of positions start .. start + len - 1 (accepted positions only)."""
        if not features.shape[0]:
            return
        old = self.pending.get(request_id)
        if old is not None and old.start + old.features.shape[0] == start:
            self.pending[request_id] = _Pending(old.start, torch.cat([old.features, features]))
        else:
            self.pending[request_id] = _Pending(start, features)

    @torch.no_grad()
    def propose(self, reqs: list[ScheduledRequest]) -> dict[str, list[int]]:
        """Drafts (target token ids) for every request with num_draft_tokens > 0 and pending features."""
        todo = [r for r in reqs if r.num_draft_tokens and r.request.request_id in self.pending]
        drafts: dict[str, list[int]] = {r.request.request_id: [] for r in reqs if r.num_draft_tokens}
        if not todo:
            return drafts
        pend = [self.pending.pop(r.request.request_id) for r in todo]
        tokens = [r.request.all_token_ids[p.start + 1 : r.num_computed_tokens + 1] for r, p in zip(todo, pend)]
        batch = ForwardBatch.build(tokens, [p.start for p in pend], [r.page_table for r in todo],
                                   [0] * len(todo), self.page_size, self.draft.device)
        last = torch.tensor(batch.cu_seqlens_host[1:], device=self.draft.device) - 1
        hidden_in = self.draft.fuse(torch.cat([p.features for p in pend]))
        logits, hidden = self.draft(batch, self.cache, None, hidden_in, last)
        proposal, hidden = self.draft.propose(logits), hidden[last]
        for i, r in enumerate(todo):
            drafts[r.request.request_id].append(int(proposal[i]))
        for step in range(1, max(r.num_draft_tokens for r in todo)):
            active = [i for i, r in enumerate(todo) if r.num_draft_tokens > step]
            batch = ForwardBatch.build(
                [[int(proposal[i])] for i in active], [todo[i].num_computed_tokens + step - 1 for i in active],
                [todo[i].page_table for i in active], [0] * len(active), self.page_size, self.draft.device,
            )
            logits, h = self.draft(batch, self.cache, None, hidden[active])
            proposal_step = self.draft.propose(logits)
            for row, i in enumerate(active):
                drafts[todo[i].request.request_id].append(int(proposal_step[row]))
            proposal, hidden = proposal.clone(), hidden.clone()
            proposal[active], hidden[active] = proposal_step, h
        return drafts
