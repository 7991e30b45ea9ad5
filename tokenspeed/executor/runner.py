"""The model runner: owns the device cache buffers, turns a ScheduledBatch into a ForwardBatch, runs the model,
samples, and performs the KDA state copies the cache manager asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tokenspeed.cache import CachePlan
from tokenspeed.executor.sampler import SamplerInput, make_generator, prompt_logprobs_chunk, sample
from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM
from tokenspeed.scheduler.batch import ZERO_SLOT, ScheduledBatch, ScheduledRequest


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # raw logprob of the token (when the request asked for logprobs)
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class StepOutput:
    """What one forward produced, keyed by request id."""

    sampled: dict[str, SampledToken]  # requests whose step reached their last token
    prompt_logprobs: dict[str, list[dict[int, float]]]  # per prompt position of this chunk: {token: logprob}
    num_tokens: int  # tokens in the forward


class ModelRunner:
    """Runs steps of one model over its cache buffers (allocated once from the cache plan)."""

    def __init__(self, model: KimiForCausalLM, plan: CachePlan, kv_cache_dtype: torch.dtype) -> None:
        self.model = model
        self.device = model.device
        self.buffers = CacheBuffers.allocate(
            model.config, plan.num_pages, plan.page_size, plan.num_slots, model.dtype, self.device,
            kv_cache_dtype=kv_cache_dtype, tp_size=model.parallel.tp_size,
        )
        self.generators: dict[str, torch.Generator | None] = {}

    def release(self, request_id: str) -> None:
        """Forget per-request state (its random stream) once the request has ended."""
        self.generators.pop(request_id, None)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Apply (src slot or ZERO_SLOT, dst slot) copies in order, over every KDA layer's conv and recurrent state."""
        for src, dst in copies:
            for conv, rec in zip(self.buffers.kda_conv, self.buffers.kda_recurrent):
                if src == ZERO_SLOT:
                    conv[dst].zero_()
                    rec[dst].zero_()
                else:
                    conv[dst].copy_(conv[src])
                    rec[dst].copy_(rec[src])

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.copy_states(batch.state_copies_before)
        reqs = batch.requests
        if not reqs:
            return StepOutput({}, {}, 0)
        forward = ForwardBatch.build(
            [r.new_token_ids for r in reqs], [r.num_computed_tokens for r in reqs], [r.page_table for r in reqs],
            [r.slot for r in reqs], self.buffers.page_size, self.device,
        )
        rows, row_of = self._logits_rows(reqs, forward.cu_seqlens_host)
        logits = self.model(forward, self.buffers, torch.tensor(rows, dtype=torch.long, device=self.device))
        self.copy_states(batch.state_copies_after)
        sampled = self._sample(reqs, logits, row_of)
        prompt_lp = self._prompt_logprobs(reqs, logits, row_of)
        return StepOutput(sampled, prompt_lp, forward.num_tokens)

    @staticmethod
    def _logits_rows(reqs: list[ScheduledRequest], cu: list[int]) -> tuple[list[int], dict[str, list[int]]]:
        """Token rows whose logits are needed: the last one of sampling requests, every one for prompt logprobs."""
        rows: list[int] = []
        row_of: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.request.params.prompt_logprobs is not None and r.num_computed_tokens < r.request.num_prompt_tokens:
                mine = list(range(cu[i], cu[i + 1]))
            elif r.sample:
                mine = [cu[i + 1] - 1]
            else:
                continue
            row_of[r.request.request_id] = list(range(len(rows), len(rows) + len(mine)))
            rows.extend(mine)
        return rows, row_of

    def _sample(self, reqs: list[ScheduledRequest], logits: Tensor, row_of: dict[str, list[int]]) -> dict:
        todo = [r for r in reqs if r.sample]
        if not todo:
            return {}
        inputs = []
        for r in todo:
            req = r.request
            if req.request_id not in self.generators:
                self.generators[req.request_id] = make_generator(req.params.seed)
            inputs.append(SamplerInput(req.params, req.prompt_token_ids, req.output_token_ids,
                                       self.generators[req.request_id], req.eos_token_ids))
        out = sample(logits[[row_of[r.request.request_id][-1] for r in todo]], inputs)
        result = {}
        for i, r in enumerate(todo):
            lp = out.logprobs[i] if out.logprobs is not None and r.request.params.logprobs is not None else None
            top = out.top_logprobs[i] if out.top_logprobs is not None and r.request.params.logprobs else None
            result[r.request.request_id] = SampledToken(out.token_ids[i], lp, top)
        return result

    @staticmethod
    def _prompt_logprobs(reqs: list[ScheduledRequest], logits: Tensor, row_of: dict[str, list[int]]) -> dict:
        """For chunks of prompts that asked: {actual next token: logprob, + top-n} per position (row t -> t+1)."""
        result = {}
        for r in reqs:
            req = r.request
            if req.params.prompt_logprobs is None or r.num_computed_tokens >= req.num_prompt_tokens:
                continue
            rows = logits[row_of[req.request_id]]
            result[req.request_id] = prompt_logprobs_chunk(
                rows, req.prompt_token_ids, r.num_computed_tokens, req.params.prompt_logprobs
            )
        return result
