"""The engine core: one loop of schedule -> execute -> update, plus request intake and abort.

Owns the model runner, the scheduler and the cache manager. Single-threaded: callers (the offline `LLM`, later
the server process) call `add_request`, `abort` and `step`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from tokenspeed.cache import CacheManager
from tokenspeed.config import EngineConfig
from tokenspeed.core.request import Request, RequestState
from tokenspeed.core.sampling_params import RequestError, SamplingParams
from tokenspeed.engine.detokenizer import IncrementalDetokenizer
from tokenspeed.engine.memory import kv_cache_torch_dtype, plan_cache, resolve_dtype
from tokenspeed.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from tokenspeed.engine.tokenizer import Tokenizer, load_tokenizer
from tokenspeed.executor.runner import ModelRunner, StepOutput
from tokenspeed.models import load_model, resolve_config
from tokenspeed.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One step, for metrics."""

    num_tokens: int  # tokens in the forward
    num_seqs: int  # requests in the forward
    num_running: int  # running after the step
    num_waiting: int  # waiting after the step
    cache_usage: float  # fraction of pages referenced
    duration: float  # seconds
    num_preempted: int = 0


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    prompt: str | None
    index: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        model_config, model_dir = resolve_config(mc.model)
        dtype = resolve_dtype(mc.dtype, mc.device)
        self.model = load_model(mc.model, dtype, mc.device, load_format=mc.load_format, seed=mc.seed)
        self.tokenizer: Tokenizer = load_tokenizer(model_dir, model_config.vocab_size, model_config.eos_token_ids)
        self.max_model_len = mc.max_model_len or model_config.max_position_embeddings
        kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        plan = plan_cache(model_config, config.cache, config.scheduler, dtype, kv_dtype, mc.device)
        self.cache = CacheManager(plan)
        self.scheduler = Scheduler(config.scheduler, self.cache, config.cache.checkpoint_chunk_ends)
        self.runner = ModelRunner(self.model, plan, kv_dtype)
        self.tracked: dict[str, _Tracked] = {}
        self.step_stats: list[StepStats] = []
        self._ids = itertools.count()
        torch.manual_seed(mc.seed)

    # ----- intake -----
    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, index: int = 0
    ) -> str:
        """Validate and queue a request; raises RequestError for bad input (nothing is queued then)."""
        params.validate(self.model.config.vocab_size)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.model.config.vocab_size}): {bad[:5]}")
        budget = self.max_model_len - len(ids)
        if budget < 1:
            raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens is None or params.max_tokens > budget:
            params = params.clone(max_tokens=budget) if params.max_tokens is None else params
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.tracked:
            raise RequestError(f"request id {rid!r} is already in use")
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        req = Request(rid, ids, params, eos_token_ids=eos)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, list(params.stop),
                                       params.include_stop_str_in_output)
        self.tracked[rid] = _Tracked(req, detok, text, index)
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request wherever it is; its cache is released. Returns its final output, if it was known."""
        req = self.scheduler.abort(request_id)
        tracked = self.tracked.pop(request_id, None)
        self.runner.release(request_id)
        if req is None or tracked is None:
            return None
        return self._output(tracked, [], "")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ----- the loop -----
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that produced a token or finished."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        result = self.runner.execute(batch)
        outputs = self._update(batch, result)
        self.step_stats.append(StepStats(
            result.num_tokens, len(batch.requests), len(self.scheduler.running), len(self.scheduler.waiting),
            self.cache.usage, time.monotonic() - start, len(batch.preempted),
        ))
        return outputs

    def _update(self, batch: ScheduledBatch, result: StepOutput) -> list[RequestOutput]:
        outputs = []
        for sr in batch.requests:
            req = sr.request
            tracked = self.tracked[req.request_id]
            req.num_computed_tokens += sr.num_new_tokens
            self.cache.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if req.request_id in result.prompt_logprobs:
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = [None]
                req.prompt_logprobs.extend(result.prompt_logprobs[req.request_id])
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output(token.token_id)
            if token.logprob is not None:
                tracked.logprobs.append(token.logprob)
                tracked.top_logprobs.append(token.top_logprobs or [])
            if req.stats.first_token_time is None:
                req.stats.first_token_time = time.monotonic()
            delta = tracked.detok.push([token.token_id])
            reason = self._finish_reason(req, token.token_id, tracked.detok)
            if reason is not None:
                delta += tracked.detok.finish() if tracked.detok.stopped is None else ""
                self._finish(req, reason)
            outputs.append(self._output(tracked, [token.token_id], delta))
        return outputs

    def _finish_reason(self, req: Request, token_id: int, detok: IncrementalDetokenizer) -> str | None:
        p = req.params
        if token_id in req.eos_token_ids and len(req.output_token_ids) >= p.min_tokens:
            return "stop"
        if token_id in p.stop_token_ids and len(req.output_token_ids) >= p.min_tokens:
            req.stop_reason = token_id
            return "stop"
        if detok.stopped is not None:
            req.stop_reason = detok.stopped
            return "stop"
        if len(req.output_token_ids) >= (p.max_tokens or 0) or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.running.remove(req)
        self.cache.release(req.request_id)
        self.runner.release(req.request_id)
        req.transition(RequestState.FINISHED)
        req.finish_reason = reason
        req.stats.finished_time = time.monotonic()

    def _output(self, tracked: _Tracked, new_ids: list[int], delta: str) -> RequestOutput:
        req = tracked.request
        done = req.state.is_done
        if done:
            self.tracked.pop(req.request_id, None)
        s = req.stats
        metrics = RequestMetrics(
            queue_time=None if s.first_scheduled_time is None else s.first_scheduled_time - s.arrival_time,
            ttft=None if s.first_token_time is None else s.first_token_time - s.arrival_time,
            e2e=None if s.finished_time is None else s.finished_time - s.arrival_time,
            num_preemptions=s.num_preemptions,
        )
        completion = CompletionOutput(
            index=tracked.index, text=tracked.detok.text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(tracked.logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(tracked.top_logprobs) if req.params.logprobs else None,
            delta_text=delta, delta_token_ids=new_ids,
        )
        usage = Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens)
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], done, usage, metrics,
                             tracked.prompt, req.prompt_logprobs)
