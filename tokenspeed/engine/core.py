"""The engine core: one loop of schedule -> execute -> update, plus request intake and abort. With asynchronous
scheduling the loop is schedule N+1 -> launch N+1 -> read back N: the host work of one step overlaps the GPU work
of the previous (`docs/gpu.md`).

Owns the model runner, the scheduler and the cache manager, and speaks tokens only: text (tokenization, stop
strings, detokenization) is the `OutputProcessor`'s job, in the caller's process. Single-threaded: callers (the
offline `LLM`, the engine process behind the server) call `add_request`, `abort` and `step`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed.cache import CacheManager
from tokenspeed.config import EngineConfig
from tokenspeed.core.request import Request, RequestState
from tokenspeed.core.sampling_params import RequestError, SamplingParams
from tokenspeed.core.tokens import ExtendedTokens
from tokenspeed.engine.memory import kv_cache_torch_dtype, plan_cache, resolve_dtype
from tokenspeed.engine.outputs import EngineOutput, StepStats
from tokenspeed.engine.tokenizer import Tokenizer, load_tokenizer
from tokenspeed.executor.compile_watch import serving_started, watch_compiles
from tokenspeed.executor.launched import LaunchedStep
from tokenspeed.executor.runner import ModelRunner, StepOutput
from tokenspeed.executor.sampler import samples_on_device
from tokenspeed.models import load_model, resolve_config
from tokenspeed.models.kimi.moe import set_routing_simulation
from tokenspeed.scheduler import ScheduledBatch, Scheduler
from tokenspeed.spec.proposer import make_proposer

logger = logging.getLogger(__name__)


# Mixed steps the start-up warm-up runs (new tokens per sequence, each on a cached history), one per class of
# compiled kernel variants that multi-turn serving meets beyond the lone prompts' (benchmarks/compile_stalls.py
# lists them): decodes beside a short tail at 2 and 4 sequences (the ragged MLA kernel; the fused KDA kernel's two
# V-tile choices), beside a tail longer than the fused KDA limit (the chunked scan from cached states, the expanded
# MLA beside the ragged kernel), beside one that puts 16-32 rows on each expert (the MoE tiles of that bucket), and
# two expanded-MLA tails whose key lengths are odd and 2 mod 4 (the first such torch SDPA call of a process took
# over a second on an H200: benchmarks/results/compile_stalls_h200_5450477_profiled.json). They commit, as serving's
# steps do (they used to run as verifications, so the committing fused-KDA variant at 3+ sequences compiled
# mid-serve in every full-scale swe-smith run: results/swe_smith_cuda_48b_server_scale1_413ec63_diagnosis.log).
WARM_UP_MIXED = ((1, 40), (1, 1, 1, 40), (1, 1, 1000), (1, 1, 1, 600), (1, 301, 302))
# Tails the warm-up also runs on a long history, each on the shortest (odd) history that takes MLA's split attention
# with exact-shape cuDNN plans too (`ops/cuda/sdpa.py`, SPLIT_MIN_WORK): new-token counts that are and are not
# multiples of 128, for the kernels around the split (the merge, the expansion), both longer than the fused KDA
# limit (FUSED_MAX_TAIL_CUDA) for the chunked KDA scan from a cached state. The cuDNN plans themselves are built per
# length bucket after the warm-up (`warm_attention_plans`): the first full-scale swe-smith run, without them, had
# steps of 1.8 and 1.0 s at its first chunks on a history; with them none
# (benchmarks/results/swe_smith_cuda_48b_server_scale1_{049266f,dc09fa4}.log).
WARM_UP_LONG_TAILS = (1024, 900)
# A step taking longer than this many seconds is logged at WARNING with its shape (new tokens per sequence), so a
# stall in serving (a kernel compiled mid-request, an allocator retry) can be traced to the batch that caused it.
SLOW_STEP_ENV = "TOKENSPEED_SLOW_STEP_S"
SLOW_STEP_S = 1.0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        model_config, self.model_dir = resolve_config(mc.model)
        dtype = resolve_dtype(mc.dtype, mc.device)
        self.model = load_model(mc.model, dtype, mc.device, load_format=mc.load_format, seed=mc.seed)
        if mc.moe_routing_simulation != "off":
            layers = set_routing_simulation(self.model, mc.moe_routing_simulation)
            logger.warning("MoE routing simulation %r in %d layers: outputs are not the model's (benchmarks only)",
                           mc.moe_routing_simulation, layers)
        self.tokenizer: Tokenizer = load_tokenizer(self.model_dir, model_config.vocab_size,
                                                   model_config.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = mc.max_model_len or model_config.max_position_embeddings
        kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        plan = plan_cache(model_config, config.cache, config.scheduler, dtype, kv_dtype, mc.device)
        self.cache = CacheManager(plan)
        self.scheduler = Scheduler(config.scheduler, self.cache, config.cache.checkpoint_chunk_ends,
                                   num_spec_tokens=config.spec.num_draft_tokens, max_model_len=self.max_model_len)
        self.runner = ModelRunner(self.model, plan, kv_dtype, make_proposer(config.spec),
                                  config.spec.speculative_force_accept_length, self._drafter(plan, dtype))
        if mc.device.startswith("cuda"):
            watch_compiles()  # records the variants the warm-up and the capture compile
            self._warm_up(config.scheduler.chunked_prefill_size)
        if self._use_cuda_graphs():
            k = config.spec.num_draft_tokens
            self.runner.capture_graphs(mc.cuda_graph_max_bs or config.scheduler.max_num_seqs, self.max_model_len,
                                       (1, k + 1) if k else (1,))
        if mc.device.startswith("cuda"):  # from here on a Triton compile stalls a serving step: log each one
            serving_started()
        if config.spec.speculative_force_accept_length is not None:
            logger.warning("FORCED ACCEPTANCE: %d draft tokens are accepted per step whatever the target says; "
                           "outputs are not the model's (benchmarking only)", config.spec.speculative_force_accept_length)
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self.async_scheduling = self._use_async_scheduling()
        self._in_flight: _InFlight | None = None  # async scheduling: the launched step not read back yet
        self._num_sync_requests = 0  # live requests whose parameters need the synchronous step
        self.num_async_steps = 0  # steps launched before the previous step's tokens were read (for tests, bench)
        torch.manual_seed(mc.seed)

    def _warm_up(self, chunk: int) -> None:
        """Compile the prefill kernels before serving: a full chunk and a few short prompts (their tiles differ), a
        prompt at each row count where the model's kernels change launch variant (`warm_up_token_counts`: the
        routed experts' tiles), then mixed steps of decodes beside a short or a longer tail on a cached history
        (WARM_UP_MIXED, the shapes of multi-turn serving: ragged and expanded MLA, short-tail KDA, MoE row buckets,
        SDPA key lengths), so that no Triton kernel compiles in the middle of a request (`docs/gpu.md`)."""
        start = time.perf_counter()
        lengths = {min(chunk, n) for n in (chunk, 1024, 100, 17)}
        counts = getattr(self.model, "warm_up_token_counts", None)
        if counts is not None:  # one prompt per launch variant of the kernels that pick tiles by row count
            lengths.update(counts(chunk))
        lengths = sorted(lengths, reverse=True)
        max_seqs = self.config.scheduler.max_num_seqs
        mixed = [q for q in WARM_UP_MIXED if len(q) <= max_seqs and sum(q) <= chunk]
        long = [(t, h) for t, h in ((t, split_history(t)) for t in WARM_UP_LONG_TAILS)
                if t <= chunk and t + h <= self.max_model_len]
        logger.info("warming up kernels (on a machine without a Triton cache this compiles every kernel: about "
                    "2-3 minutes on an H200; later starts reuse the on-disk cache)")
        device = torch.device(self.config.model.device)
        torch.cuda.reset_peak_memory_stats(device)
        self.runner.warm_up([n for n in lengths if n <= self.max_model_len], mixed,
                            num_drafts=self.config.spec.num_draft_tokens, long_tails=long)
        plans = getattr(self.model, "warm_attention_plans", None)
        plan_calls = plans(chunk, self.max_model_len) if plans is not None else 0
        logger.info("warmed up prefill kernels for %s-token prompts, mixed steps %s, (tail, history) %s and %d "
                    "attention plans in %.1f s", lengths, mixed, long, plan_calls, time.perf_counter() - start)
        free, total = torch.cuda.mem_get_info(device)
        logger.info("device memory: %.1f GiB allocated at the warm-up's peak (weights, cache pools, its largest step), "
                    "%.1f GiB of %.1f GiB free now; a step that runs out ends its own requests (`docs/gpu.md`)",
                    torch.cuda.max_memory_allocated(device) / 2**30, free / 2**30, total / 2**30)

    def _use_cuda_graphs(self) -> bool:
        """Graphs need a CUDA device and the Triton ops (the references synchronise). With EAGLE3 the target's
        graphs also output the features the drafter reads; the drafter itself runs eagerly."""
        from tokenspeed.ops import dispatch

        mc = self.config.model
        return (str(mc.device).startswith("cuda") and not mc.enforce_eager and dispatch.mode() != "reference"
                and dispatch.triton_available())

    def _use_async_scheduling(self) -> bool:
        """`async_scheduling`: on / off, or auto = on with CUDA graphs. Never with speculation (the verify step
        needs the accepted tokens before the next proposal)."""
        mode = self.config.scheduler.async_scheduling
        if self.runner.proposer is not None or self.runner.drafter is not None:
            return False
        return mode == "on" or (mode == "auto" and bool(self.runner.graphs))

    def _drafter(self, plan, dtype: torch.dtype):
        """The EAGLE3 drafter when configured (its cache uses the target's page ids)."""
        spec = self.config.spec
        if (spec.speculative_algorithm or "").lower() != "eagle3":
            return None
        from tokenspeed.models.eagle3 import load_eagle3_draft
        from tokenspeed.spec.eagle3 import Eagle3Drafter

        draft = load_eagle3_draft(spec.speculative_draft_model_path, self.model, dtype, self.config.model.device,
                                  seed=self.config.model.seed)
        return Eagle3Drafter(draft, draft.capture_layers(self.model), plan.num_pages, plan.page_size)

    # ----- intake -----
    def check_request(self, prompt_ids: list[int] | np.ndarray, params: SamplingParams) -> SamplingParams:
        """Validate a request against this model; returns the params with max_tokens filled in. prompt_ids: a list
        of ints, or a 1-D integer numpy array (checked vectorised: the engine process receives prompts so).

        Raises RequestError (a client error) for an empty or too long prompt, bad token ids or bad parameters.
        """
        params.validate(self.vocab_size)
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty")
        if isinstance(prompt_ids, np.ndarray):
            bad = prompt_ids[(prompt_ids < 0) | (prompt_ids >= self.vocab_size)][:5].tolist()
        else:
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens"
            )
        if params.max_tokens is None:
            return params.clone(max_tokens=room)
        return params

    def add_request(self, request_id: str, prompt_ids: list[int] | np.ndarray, params: SamplingParams) -> None:
        """Queue a request (after `check_request`; prompt_ids a list of ints or a 1-D integer array); raises
        RequestError if the id is in use."""
        params = self.check_request(prompt_ids, params)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        ids = prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else list(prompt_ids)
        req = Request(request_id, ids, params, eos_token_ids=eos)
        self.requests[request_id] = req
        if _needs_sync(params):
            self._num_sync_requests += 1
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (cache released). False if it is unknown or already done."""
        req = self.scheduler.abort(request_id)
        live = self.requests.pop(request_id, None)
        if live is not None and _needs_sync(live.params):
            self._num_sync_requests -= 1
        self.runner.release(request_id)
        return req is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ----- the loop -----
    def step(self) -> list[EngineOutput]:
        """Run one step; returns an output for every request that produced a token or finished.

        With asynchronous scheduling the step is launched before the previous one's tokens are read, and the
        outputs returned are the previous step's (see `_step_async`)."""
        if self.async_scheduling:
            if self._can_pipeline():
                return self._step_async()
            if self._in_flight is not None:  # the next step needs the host to know every token first
                outputs = self._read_back(self._take_in_flight())
                self.last_step = self.stats()  # the counters after the read-back (a request may have ended)
                return outputs
        return self._step_sync()

    def _step_sync(self) -> list[EngineOutput]:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        try:
            result = self.runner.execute(batch)
        except torch.OutOfMemoryError as e:
            outputs = self._fail(batch, e)
            self.last_step = self.stats()
            return outputs
        outputs = self._update(batch, result)
        self.last_step = self.stats(result.num_tokens, len(batch.requests), time.monotonic() - start,
                                    len(batch.preempted))
        _warn_if_slow(self.last_step.duration, batch, None)
        return outputs

    def stats(self, num_tokens: int = 0, num_seqs: int = 0, duration: float = 0.0, preempted: int = 0) -> StepStats:
        """The engine's counters now (with the figures of a step when given)."""
        return StepStats(
            num_tokens=num_tokens, num_seqs=num_seqs, num_running=self.num_running, num_waiting=self.num_waiting,
            cache_usage=self.cache.usage, duration=duration, num_preempted=preempted,
            num_cache_hit_tokens=self.cache.num_hit_tokens, num_cache_query_tokens=self.cache.num_query_tokens,
        )

    def _update(self, batch: ScheduledBatch, result: StepOutput) -> list[EngineOutput]:
        outputs = []
        sampled, prompt_logprobs, commit = result.sampled, result.prompt_logprobs, self.cache.commit
        for sr in batch.requests:
            req = sr.request
            rid = req.request_id
            req.num_computed_tokens += sr.num_new_tokens
            prompt_lp = prompt_logprobs.get(rid) if prompt_logprobs else None
            tokens = sampled.get(rid)
            if tokens is None:
                commit(rid, req.all_token_ids, req.num_computed_tokens)
                if prompt_lp:
                    outputs.append(EngineOutput.of(req, [], prompt_logprobs=prompt_lp))
                continue
            if sr.num_draft_tokens:  # the accepted drafts were computed too (the bonus token was not)
                req.num_computed_tokens += len(tokens) - 1
                req.stats.num_draft_tokens += result.num_drafts.get(rid, 0)
                req.stats.num_accepted_tokens += len(tokens) - 1
                req.stats.num_spec_steps += 1
            if len(tokens) == 1:  # one new token (a decode step): the common case, without the general loop
                token = tokens[0]
                # The computed positions are all_token_ids itself: no O(context) copy per request per step.
                commit(rid, req.all_token_ids, req.num_computed_tokens)
                req.append_output(token.token_id)
                if req.stats.first_token_time is None:
                    req.stats.first_token_time = time.monotonic()
                reason = self._finish_reason(req, token.token_id)
                if reason is not None:
                    self._finish(req, reason)
                outputs.append(EngineOutput.of(
                    req, [token.token_id], None if token.logprob is None else [token.logprob],
                    None if token.top_logprobs is None else [token.top_logprobs], prompt_lp,
                ))
                continue
            # Positions computed so far: the known tokens plus the accepted drafts (not yet appended), as a view:
            # no O(context) copy per request per verify step.
            commit(rid, ExtendedTokens(req.all_token_ids, [t.token_id for t in tokens[:-1]]), req.num_computed_tokens)
            emitted = []
            for token in tokens:
                req.append_output(token.token_id)
                emitted.append(token)
                if req.stats.first_token_time is None:
                    req.stats.first_token_time = time.monotonic()
                reason = self._finish_reason(req, token.token_id)
                if reason is not None:
                    self._finish(req, reason)
                    break
            outputs.append(EngineOutput.of(
                req, [t.token_id for t in emitted],
                None if emitted[0].logprob is None else [t.logprob for t in emitted],
                None if emitted[0].top_logprobs is None else [t.top_logprobs for t in emitted], prompt_lp,
            ))
        return outputs

    # ----- asynchronous scheduling -----
    def _can_pipeline(self) -> bool:
        """Whether the next step may be launched before the host knows the in-flight step's tokens: no live
        request needs its host tokens to sample (`_needs_sync`), and the pool has pages for
        a full step's budget plus one per running request, so the schedule cannot preempt (a preempted request
        would re-enter with a token the host does not know)."""
        if self._num_sync_requests:
            return False
        sc = self.config.scheduler
        need = -(-sc.max_num_batched_tokens // self.cache.page_size) + len(self.scheduler.running)
        return self.cache.pages.num_available_pages >= need

    def _step_async(self) -> list[EngineOutput]:
        """Schedule and launch step N+1 (its decode rows feed step N's tokens on the device), then read step N's
        tokens while N+1 runs, and return N's outputs. Requests that finish at N have run one row too many in
        N+1: its token is dropped, and their pages and slots are released now (N+1's writes to them come before
        any later step's on the stream)."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        prev = self._take_in_flight()
        outputs: list[EngineOutput] = []
        if not batch.is_empty:
            try:
                launched = self.runner.launch(batch, prev.launched if prev is not None else None)
            except torch.OutOfMemoryError as e:  # the launched step's tokens are still good: read them first
                outputs = self._read_back(prev) if prev is not None else []
                outputs += self._fail(batch, e)
                self.last_step = self.stats()
                return outputs
            computed = []
            for sr in batch.requests:
                sr.request.num_computed_tokens += sr.num_new_tokens
                computed.append(sr.request.num_computed_tokens)
                if sr.sample:
                    sr.request.append_placeholder()
            self._in_flight = _InFlight(batch, launched, computed)
            if prev is not None:
                self.num_async_steps += 1
        if prev is not None:
            outputs = self._read_back(prev)
        elapsed = time.monotonic() - start
        if batch.is_empty:
            self.last_step = self.stats()  # nothing launched: the counters after the read-back
        else:
            self.last_step = self.stats(self._in_flight.launched.num_tokens, len(batch.requests), elapsed,
                                        len(batch.preempted))
        _warn_if_slow(elapsed, batch, prev.batch if prev is not None else None)
        return outputs

    def _take_in_flight(self) -> _InFlight | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _read_back(self, step: _InFlight) -> list[EngineOutput]:
        """Read a launched step's tokens (waits for it), resolve its placeholders, commit its pages, finish."""
        tokens = iter(step.launched.token_ids())
        outputs: list[EngineOutput] = []
        commit = self.cache.commit
        for sr, computed in zip(step.batch.requests, step.computed, strict=True):
            req = sr.request
            token = next(tokens) if sr.sample else None
            if req.state is not RequestState.RUNNING:  # aborted meanwhile (launched steps never preempt)
                continue
            commit(req.request_id, req.all_token_ids, computed)
            if token is None:
                continue
            req.resolve_placeholder(token)
            if req.stats.first_token_time is None:
                req.stats.first_token_time = time.monotonic()
            reason = self._finish_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(EngineOutput.of(req, [token]))
        return outputs

    def _finish_reason(self, req: Request, token_id: int) -> str | None:
        p = req.params
        num_out = req.num_known_output_tokens
        if token_id in req.eos_token_ids and num_out >= p.min_tokens:
            return "stop"
        if token_id in p.stop_token_ids and num_out >= p.min_tokens:
            req.stop_reason = token_id
            return "stop"
        if num_out >= (p.max_tokens or 0) or req.num_tokens - req.num_placeholders >= self.max_model_len:
            return "length"
        return None

    def _fail(self, batch: ScheduledBatch, error: BaseException) -> list[EngineOutput]:
        """A step whose forward ran out of device memory: its requests end with finish_reason "error" (the forward
        may have advanced their KDA states part of the way, so nothing of them can be resumed) and release their
        cache; every other request goes on. Returns the failed requests' final outputs."""
        logger.error("a step of %s ran out of device memory; its %d requests end with an error, the others go on: %s",
                     _shape(batch), len(batch.requests), error)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        message = ("the engine ran out of device memory in a step with this request (lower --chunked-prefill-size "
                   "or --gpu-memory-utilization); the other requests go on")
        outputs = []
        for sr in batch.requests:
            req = sr.request
            if self.abort(req.request_id):
                req.finish_reason = "error"
                req.stats.finished_time = time.monotonic()
                outputs.append(EngineOutput.of(req, [], error=message))
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        req.drop_placeholders()
        if _needs_sync(req.params):
            self._num_sync_requests -= 1
        self.scheduler.forget(req.request_id)
        self.scheduler.running.remove(req)
        self.cache.release(req.request_id, req.all_token_ids, req.num_prompt_tokens)
        self.runner.release(req.request_id)
        self.requests.pop(req.request_id, None)
        req.transition(RequestState.FINISHED)
        req.finish_reason = reason
        req.stats.finished_time = time.monotonic()


# ----- asynchronous scheduling -----
@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read."""

    batch: ScheduledBatch
    launched: LaunchedStep
    computed: list[int]  # each request's num_computed_tokens right after this step (what `commit` publishes)


def split_history(tail: int) -> int:
    """The shortest odd history on which a `tail`-token chunk takes MLA's split attention (SPLIT_MIN_WORK)."""
    from tokenspeed.ops.cuda.sdpa import SPLIT_MIN_WORK

    return -(-SPLIT_MIN_WORK // tail) | 1


def _shape(batch: ScheduledBatch) -> str:
    """A batch's new tokens per sequence, decodes counted: "12 x 1 + [300, 8192]"."""
    lens = [r.num_new_tokens for r in batch.requests]
    ones = lens.count(1)
    rest = [n for n in lens if n != 1]
    return " + ".join(([f"{ones} x 1"] if ones else []) + ([str(rest)] if rest else [])) or "no tokens"


def _warn_if_slow(seconds: float, batch: ScheduledBatch, read_back: ScheduledBatch | None) -> None:
    """Log a step slower than TOKENSPEED_SLOW_STEP_S (default SLOW_STEP_S) seconds with its batch's shape and, with
    asynchronous scheduling, the shape of the step read back in it (whose kernels the host waited for)."""
    limit = float(os.environ.get(SLOW_STEP_ENV, SLOW_STEP_S))
    if seconds > limit:
        tail = f"; read back the step of {_shape(read_back)}" if read_back is not None else ""
        logger.warning("slow step: %.2f s for new tokens %s%s", seconds, _shape(batch), tail)


def _needs_sync(params: SamplingParams | None) -> bool:
    """Requests that the synchronous step serves: penalties, min_tokens (the sampler reads the host tokens),
    logit_bias, logprobs and prompt logprobs. Greedy and plain sampled (temperature, top-k/p, min-p, seeds)
    requests do not."""
    if params is None:
        return False
    return not samples_on_device(params) or params.prompt_logprobs is not None
