"""The model runner: owns the device cache buffers, turns a ScheduledBatch into a ForwardBatch, runs the model,
samples (verifying drafts when speculating), and performs the KDA state copies the cache manager asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import Tensor

from tokenspeed.cache import CachePlan
from tokenspeed.core.tokens import ExtendedTokens
from tokenspeed.executor.cuda_graphs import DecodeGraphs
from tokenspeed.executor.launched import LaunchedStep, feed_placeholders
from tokenspeed.executor.sampler import (
    SamplerInput,
    is_plain_greedy,
    make_generator,
    prompt_logprobs_chunk,
    sample,
    sample_on_device,
)
from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM
from tokenspeed.ops.h2d import device_longs
from tokenspeed.scheduler.batch import ZERO_SLOT, ScheduledBatch, ScheduledRequest
from tokenspeed.spec.acceptance import accept_chain
from tokenspeed.spec.eagle3 import Eagle3Drafter
from tokenspeed.spec.proposer import Proposer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # raw logprob of the token (when the request asked for logprobs)
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class StepOutput:
    """What one forward produced, keyed by request id."""

    sampled: dict[str, list[SampledToken]]  # requests whose step reached their last token: 1 token, or with
    # speculation the accepted drafts plus the target's bonus token
    prompt_logprobs: dict[str, list[dict[int, float]]]  # per prompt position of this chunk: {token: logprob}
    num_tokens: int  # tokens in the forward
    num_drafts: dict[str, int] = field(default_factory=dict)  # draft tokens verified per speculating request


class ModelRunner:
    """Runs steps of one model over its cache buffers (allocated once from the cache plan)."""

    def __init__(
        self,
        model: KimiForCausalLM,
        plan: CachePlan,
        kv_cache_dtype: torch.dtype,
        proposer: Proposer | None = None,
        force_accept: int | None = None,
        drafter: Eagle3Drafter | None = None,
    ) -> None:
        self.model = model
        self.drafter = drafter  # EAGLE3: a draft model fed with captured target features
        self.device = model.device
        self.proposer = proposer  # drafts for requests the scheduler gave draft tokens
        self.force_accept = force_accept  # benchmarks only: accept this many drafts whatever the target says
        self.num_pages = plan.num_pages
        self.buffers = CacheBuffers.allocate(  # one extra page: the scratch page of CUDA-graph padding rows
            model.config, plan.num_pages + 1, plan.page_size, plan.num_slots, model.dtype, self.device,
            kv_cache_dtype=kv_cache_dtype, tp_size=model.parallel.tp_size,
        )
        self.generators: dict[str, torch.Generator | None] = {}
        self.graphs: dict[int, DecodeGraphs] = {}  # query length (1: decode, k + 1: verify) -> its graphs

    def capture_graphs(self, max_batch_size: int, max_model_len: int, query_lens: tuple[int, ...] = (1,),
                       use_graphs: bool = True) -> None:
        """Capture decode (query length 1) and verify (k + 1) forwards as CUDA graphs for batch sizes up to
        `max_batch_size` (see cuda_graphs). A capture that fails leaves that query length eager, with a warning.
        use_graphs=False keeps the padded static batches but runs them eagerly (CPU tests)."""
        pages = -(-max_model_len // self.buffers.page_size)
        for q in query_lens:
            graphs = DecodeGraphs(self.model, self.buffers, max_batch_size, pages, scratch_page=self.num_pages,
                                  query_len=q, use_graphs=use_graphs,
                                  capture_layers=self.drafter.capture_layers if self.drafter else ())
            try:
                graphs.capture()
            except RuntimeError as e:  # an op outside its kernel's region fell back to a synchronising reference
                logger.warning("CUDA graphs for %d-token steps disabled, running them eagerly: capture failed (%s)",
                               q, str(e).splitlines()[0])
                torch.cuda.synchronize()
                self.buffers.replay.clear()
                continue
            self.graphs[q] = graphs

    def warm_up(self, lengths: list[int], mixed: Sequence[Sequence[int]] = (), num_drafts: int = 0,
                long_tails: Sequence[tuple[int, int]] = ()) -> None:
        """One eager prefill forward per length in `lengths` (one sequence of that many tokens), then one eager
        forward per entry of `mixed` (several sequences with a cached history, taking those many new tokens each:
        the mixed decode + tail steps of serving, whose ragged kernel variants differ from a lone prompt's), so the
        kernels that compile or autotune per shape class (Triton tiles chosen by rows per expert, fla's chunked
        scan, the ragged MLA and short-tail KDA forms) do it at start-up, not in the first requests. Every sequence
        writes only the scratch page (every page of its table) and KDA slot 0, whose state every sequence that
        takes it later zeroes or restores first (the values the warm-up leaves there are never read). With
        `num_drafts` (speculation), each mixed step runs again as a verification, its one-token rows as windows of
        1 + num_drafts tokens, followed by the KDA state replay (the eager verify kernels), and verifications of
        each shorter window (2 .. num_drafts tokens: a request whose context or budget leaves fewer drafts), alone
        and beside a full window, which have no graph. Each (tail, history) of
        `long_tails` runs one sequence taking `tail` new tokens on a `history`-token history (the scratch page
        throughout): the kernel classes of a turn on a long history (MLA's split attention, `docs/gpu.md`)."""
        page_size = self.buffers.page_size
        for n in lengths:
            pages = [self.num_pages] * (-(-n // page_size))
            forward = ForwardBatch.build([[0] * n], [0], [pages], [0], page_size, self.device)
            self.model(forward, self.buffers, device_longs([n - 1], self.device))
        for qlens in mixed:
            self._warm_up_mixed(list(qlens))
            if num_drafts:
                self._warm_up_mixed([1 + num_drafts if q == 1 else q for q in qlens],
                                    [i for i, q in enumerate(qlens) if q != 1])
        for w in range(2, 1 + num_drafts):  # the shorter windows near the end of a context: no graph, eager
            self._warm_up_mixed([w], [])
            self._warm_up_mixed([1 + num_drafts, w], [])
        for tail, history in long_tails:
            self._warm_up_mixed([tail], history=history)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _warm_up_mixed(self, qlens: list[int], prompt_rows: list[int] | None = None,
                       history: int | None = None) -> None:
        """One eager forward of sequences with a cached history (default 4 pages) taking qlens[n] new tokens each
        (scratch page, KDA slot 0): a plain (committing) step when `prompt_rows` is None or every row, else a
        verification with its replay, `prompt_rows` being the rows without drafts."""
        page_size = self.buffers.page_size
        history = 4 * page_size if history is None else history
        verify = prompt_rows is not None and len(prompt_rows) < len(qlens)
        pages = [[self.num_pages] * (-(-(history + q) // page_size)) for q in qlens]
        forward = ForwardBatch.build([[0] * q for q in qlens], [history] * len(qlens), pages, [0] * len(qlens),
                                     page_size, self.device, verify=verify, prompt_rows=prompt_rows if verify else ())
        self.model(forward, self.buffers, device_longs([c - 1 for c in accumulate(qlens)], self.device))
        if verify:
            self.model.replay_kda(self.buffers, forward, qlens)

    def release(self, request_id: str) -> None:
        """Forget per-request state (its random stream, the proposer's index) once the request has ended."""
        self.generators.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Apply (src slot or ZERO_SLOT, dst slot) copies in order, over every KDA layer's conv and recurrent state.

        When the destinations are distinct and none is also a source (the usual step: fresh slots zeroed, rolling
        checkpoints taken), the copies are independent and run as one gather-scatter per pool and layer instead of
        two kernels per copy and layer; otherwise they run one by one, in order."""
        if not copies:
            return
        zero = [dst for src, dst in copies if src == ZERO_SLOT]
        moves = [(src, dst) for src, dst in copies if src != ZERO_SLOT]
        dsts = [dst for _, dst in copies]
        if len(copies) == 1 or len(set(dsts)) < len(dsts) or set(dsts) & {src for src, _ in moves}:
            for src, dst in copies:
                self._copy_sequential(src, dst)
            return
        dev = self.buffers.kda_conv[0].device if self.buffers.kda_conv else self.device
        zero_idx = device_longs(zero, dev) if zero else None
        src_idx = device_longs([s for s, _ in moves], dev) if moves else None
        dst_idx = device_longs([d for _, d in moves], dev) if moves else None
        for pool in (*self.buffers.kda_conv, *self.buffers.kda_recurrent):
            if zero_idx is not None:
                pool.index_fill_(0, zero_idx, 0)
            if src_idx is not None:
                pool.index_copy_(0, dst_idx, pool.index_select(0, src_idx))

    def _copy_sequential(self, src: int, dst: int) -> None:
        for conv, rec in zip(self.buffers.kda_conv, self.buffers.kda_recurrent, strict=True):
            if src == ZERO_SLOT:
                conv[dst].zero_()
                rec[dst].zero_()
            else:
                conv[dst].copy_(conv[src])
                rec[dst].copy_(rec[src])

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step. With draft tokens the forward verifies (KDA state untouched), then the accepted
        tokens are replayed into the KDA state before any checkpoint copy."""
        self.copy_states(batch.state_copies_before)
        reqs = batch.requests
        if not reqs:
            return StepOutput({}, {}, 0)
        if self.drafter is not None:
            proposed = self.drafter.propose(reqs)
            drafts = {r.request.request_id: _pad(proposed.get(r.request.request_id, []), r)
                      for r in reqs if r.num_draft_tokens}
        else:
            drafts = {r.request.request_id: self._drafts(r) for r in reqs if r.num_draft_tokens}
        tokens = [r.new_token_ids + drafts.get(r.request.request_id, []) for r in reqs]
        forward = self._build(reqs, tokens, verify=bool(drafts),
                              prompt_rows=[i for i, r in enumerate(reqs) if r.request.request_id not in drafts])
        rows, row_of = self._logits_rows(reqs, forward.cu_seqlens_host, drafts)
        features = None
        graphs = self._graphs_for(forward, rows)
        if graphs is not None:
            logits = graphs.run(forward)
            if self.drafter is not None:  # copied: the pool is rewritten by the next replay
                features = graphs.last_features(forward.num_tokens).clone()
        elif self.drafter is not None:
            logits, captured = self.model(forward, self.buffers, device_longs(rows, self.device),
                                          capture_layers=self.drafter.capture_layers)
            features = torch.cat(captured, dim=-1)
        else:
            logits = self.model(forward, self.buffers, device_longs(rows, self.device))
        sampled = self._sample(reqs, logits, row_of, drafts)
        fed = [len(sampled[r.request.request_id]) if r.request.request_id in drafts else len(tokens[i])
               for i, r in enumerate(reqs)]  # positions whose computation counts (accepted ones when verifying)
        if drafts and graphs is not None:
            graphs.replay_state(fed)
        elif drafts:
            self.model.replay_kda(self.buffers, forward, fed)
        if features is not None:
            cu = forward.cu_seqlens_host
            for i, r in enumerate(reqs):
                self.drafter.record(r.request.request_id, r.num_computed_tokens, features[cu[i] : cu[i] + fed[i]])
        self.copy_states(batch.state_copies_after)
        prompt_lp = self._prompt_logprobs(reqs, logits, row_of)
        return StepOutput(sampled, prompt_lp, forward.num_tokens, {rid: len(d) for rid, d in drafts.items()})

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep:
        """Queue one step without waiting for it (asynchronous scheduling): the forward, each sampling request's
        token chosen on the device from its last row (`sampler.sample_on_device`: argmax, or one filtered draw),
        and the copy of those tokens to the host. A fed PLACEHOLDER token (a request's last) is `prev`'s sampled
        token, read on the device. No drafts, penalties, min_tokens or logprobs: the engine sends only such batches
        here. Mutates the cache buffers as `execute`."""
        self.copy_states(batch.state_copies_before)
        reqs = batch.requests
        tokens = [r.new_token_ids for r in reqs]
        forward = self._build(reqs, tokens, verify=False)
        feed_placeholders(forward.input_ids, forward.cu_seqlens_host, tokens,
                          [r.request.request_id for r in reqs], prev)
        rows, row_of = self._logits_rows(reqs, forward.cu_seqlens_host, {})
        graphs = self._graphs_for(forward, rows)
        if graphs is not None:
            logits = graphs.run(forward)
        else:
            logits = self.model(forward, self.buffers, device_longs(rows, self.device))
        todo = [r.request for r in reqs if r.sample]
        picked = [row_of[req.request_id][-1] for req in todo]
        if picked != list(range(logits.shape[0])):
            logits = logits.index_select(0, device_longs(picked, logits.device))
        if all(req.params.greedy for req in todo):
            ids = logits.argmax(dim=-1)
        else:
            ids = sample_on_device(logits, [self._sampler_input(req) for req in todo])
        launched = LaunchedStep.start([req.request_id for req in todo], ids, forward.num_tokens)
        self.copy_states(batch.state_copies_after)
        return launched

    def _build(self, reqs: list[ScheduledRequest], tokens: list[list[int]], verify: bool,
               prompt_rows: Sequence[int] = ()) -> ForwardBatch:
        """The device batch of `reqs` feeding `tokens` (each request's new tokens, plus drafts when verifying;
        `prompt_rows`: the verified batch's rows without drafts)."""
        return ForwardBatch.build(
            tokens, [r.num_computed_tokens for r in reqs], [r.page_table for r in reqs], [r.slot for r in reqs],
            self.buffers.page_size, self.device, verify=verify, prompt_rows=prompt_rows if verify else (),
        )

    def _graphs_for(self, forward: ForwardBatch, rows: list[int]) -> DecodeGraphs | None:
        """The captured graphs that can run `forward` (uniform query length, fitting shapes, logits wanted at
        every row), or None: run it eagerly."""
        graphs = self.graphs.get(forward.uniform_query_len or 0)
        if graphs is not None and graphs.can_run(forward) and rows == list(range(forward.num_tokens)):
            return graphs
        return None

    def _generator(self, req) -> torch.Generator | None:
        """The request's random stream, created on first use and kept across steps (released with it)."""
        if req.request_id not in self.generators:
            self.generators[req.request_id] = make_generator(req.params.seed)
        return self.generators[req.request_id]

    def _sampler_input(self, req) -> SamplerInput:
        """The sampler row of `req` for a step that samples from its current tokens."""
        return SamplerInput(req.params, req.prompt_token_ids, req.output_token_ids, self._generator(req),
                            req.eos_token_ids)

    def _drafts(self, r: ScheduledRequest) -> list[int]:
        """The proposer's drafts, padded to the scheduled count with copies of the last one (or of the request's
        last token): every window keeps its scheduled length, so a batch stays uniform and its verify graph runs.
        A filler is accepted only where the target itself chooses that token, so outputs do not change."""
        assert self.proposer is not None
        return _pad(self.proposer.propose(r.request.all_token_ids, r.num_draft_tokens, r.request.request_id), r)

    @staticmethod
    def _logits_rows(reqs: list[ScheduledRequest], cu: list[int], drafts: dict[str, list[int]]
                     ) -> tuple[list[int], dict[str, list[int]]]:
        """Token rows whose logits are needed: the last one of sampling requests (every verified position with
        drafts), every one for prompt logprobs."""
        rows: list[int] = []
        row_of: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            rid = r.request.request_id
            if r.request.params.prompt_logprobs is not None and r.num_computed_tokens < r.request.num_prompt_tokens:
                mine = list(range(cu[i], cu[i + 1]))
            elif r.sample:
                mine = list(range(cu[i + 1] - 1 - len(drafts.get(rid, [])), cu[i + 1]))
            else:
                continue
            row_of[rid] = list(range(len(rows), len(rows) + len(mine)))
            rows.extend(mine)
        return rows, row_of

    def _sample(self, reqs: list[ScheduledRequest], logits: Tensor, row_of: dict[str, list[int]],
                drafts: dict[str, list[int]]) -> dict[str, list[SampledToken]]:
        """The target's choice at each sampled row (every verified position with drafts), then chain acceptance."""
        todo = [r for r in reqs if r.sample]
        if not todo:
            return {}
        if all(is_plain_greedy(r.request.params, len(r.request.output_token_ids)) for r in todo):
            return self._accept_greedy(todo, logits, row_of, drafts)
        inputs, rows, owners = [], [], []
        for r in todo:
            req = r.request
            generator = self._generator(req)
            window = drafts.get(req.request_id, [])
            for i, row in enumerate(row_of[req.request_id][-(len(window) + 1):]):
                outputs = ExtendedTokens(req.output_token_ids, window[:i]) if i else req.output_token_ids  # no copy
                inputs.append(SamplerInput(req.params, req.prompt_token_ids, outputs, generator, req.eos_token_ids))
                rows.append(row)
                owners.append(req.request_id)
        out = sample(logits[rows], inputs)
        choices: dict[str, list[SampledToken]] = {}
        for i, rid in enumerate(owners):
            lp = out.logprobs[i] if out.logprobs is not None else None
            top = out.top_logprobs[i] if out.top_logprobs is not None else None
            choices.setdefault(rid, []).append(SampledToken(out.token_ids[i], lp, top))
        result = {}
        for r in todo:
            req, rid = r.request, r.request.request_id
            window, mine = drafts.get(rid, []), choices[rid]
            accepted = accept_chain([t.token_id for t in mine], window, self.force_accept if window else None)
            wants_lp, wants_top = req.params.logprobs is not None, bool(req.params.logprobs)
            result[rid] = [SampledToken(tok, mine[i].logprob if wants_lp else None,
                                        mine[i].top_logprobs if wants_top else None)
                           for i, tok in enumerate(accepted)]
        return result

    def _accept_greedy(self, todo: list[ScheduledRequest], logits: Tensor, row_of: dict[str, list[int]],
                       drafts: dict[str, list[int]]) -> dict[str, list[SampledToken]]:
        """`_sample` for steps whose requests are all plain greedy (`is_plain_greedy`: then every position of a
        verify window is too, having more output tokens), decode batches included: each position's choice is its
        row's argmax, one argmax over all rows, then chain acceptance where there are drafts; no per-position
        sampler inputs (what `sample` does for such rows) or output-list copies."""
        if not drafts:  # a decode batch: the last row of each request (a decode graph's rows are exactly these)
            rows = [row_of[r.request.request_id][-1] for r in todo]
            ids = (logits if rows == list(range(logits.shape[0])) else logits[rows]).argmax(dim=-1).tolist()
            return {r.request.request_id: [SampledToken(t, None, None)] for r, t in zip(todo, ids, strict=True)}
        rows, spans = [], []
        for r in todo:
            rid = r.request.request_id
            mine = row_of[rid][-(len(drafts.get(rid, [])) + 1):]
            spans.append((rid, len(rows), len(rows) + len(mine)))
            rows.extend(mine)
        ids = (logits if rows == list(range(logits.shape[0])) else logits[rows]).argmax(dim=-1).tolist()
        result = {}
        for rid, lo, hi in spans:
            window = drafts.get(rid, [])
            accepted = accept_chain(ids[lo:hi], window, self.force_accept if window else None)
            result[rid] = [SampledToken(tok, None, None) for tok in accepted]
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


def _pad(drafts: list[int], r: ScheduledRequest) -> list[int]:
    """`drafts` cut or padded to r.num_draft_tokens, the padding copies of the last draft (or of the request's last
    token when there is none); see `ModelRunner._drafts`."""
    k = r.num_draft_tokens
    drafts = drafts[:k]
    filler = drafts[-1] if drafts else r.request.all_token_ids[-1]
    return drafts + [filler] * (k - len(drafts))
