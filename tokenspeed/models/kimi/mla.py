"""Gated NoPE MLA layer (K3), plain MLA (Kimi Linear), and MLA with RoPE/YaRN (drafts).

Math: k3-architecture.md section 2.5. New latent rows [c_kv ; k_pe] are written to the paged cache first, then
each sequence attends over its whole cached context. Sequences with few new tokens (decode, verify; with the
Triton kernel, tails up to ABSORBED_MAX_TAIL) use the absorbed form (MQA over the latent cache); longer ones
(prefill chunks) expand keys/values per head with kv_b_proj. Both are the same function; tests check they agree.
Inside attention the reference keeps fp32 (the absorbed query, the expanded keys/values, the softmax) and rounds
once at the output.

Without q-LoRA (Kimi Linear) q_proj and kv_a_proj_with_mqa both read x: they are one `MergedLinear`
(`q_kv_a_proj`, one GEMM a layer instead of two; checkpoints keep the two names, the loader concatenates them, q's
rows sharded by head under tensor parallelism, kv_a's replicated), and q / kv_a are strided views of its output.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.layers import Linear, MergedLinear, Part, RMSNorm
from tokenspeed.ops.cuda.sdpa import padded_rows
from tokenspeed.ops.h2d import to_device

# A sequence with at most this many new tokens attends in the absorbed (latent) form through the torch reference
# (`_attend_absorbed`: the CPU path, and wherever the Triton kernel is not used).
ABSORBED_MAX_QUERY_LEN = 8
# With the Triton kernel (`ops.mla_decode_kernel_usable`): a sequence with at most this many new tokens attends in the
# absorbed form through the ragged kernel (`_attend_ragged`), longer ones expanded. FLOPs per new token and context
# row, summed over the H heads: absorbed 2 H (Dl + r) (QK over the 576-wide latent row, PV over its 512 columns:
# 69.6K at Kimi-Linear's H 32), expanded 2 H (qk + v) (192 + 128: 20.5K), plus the expansion itself, once per
# context row: 2 r H (nope + v) = 8.4M. So for a history much longer than the tail the absorbed form is cheaper
# below 8.4M / (69.6K - 20.5K) ~ 171 new tokens (~340 for a fresh prompt, where causality halves the attention
# terms but not the expansion). The expanded form also writes and reads per-head K/V (20 KB per context row
# against the 1.2 KB latent row: 335 MB at 16K, GBs at 200K) and gathers on the host, while the absorbed kernel
# runs its dots in 32-row tiles below cuBLAS's / SDPA's tensor-core efficiency. Measured on an H200 (one layer's
# attention, a tail on a 16K history, benchmarks/results/mla_ragged_h200_1b048d5.json): ragged vs today's path
# 0.59 vs 1.51 ms at 16 new tokens, 1.25 vs 1.43 at 64, 1.84 vs 1.28 at 128 (beside 15 decodes: 0.59 vs 2.54,
# 1.57 vs 2.33, 2.41 vs 2.45), so the crossover is near 100 tokens: 64.
ABSORBED_MAX_TAIL = 64
# Where the whole batch attends through the absorbed Triton kernel (`_fused_form`): the W_UK absorption runs inside
# the latent store's launch (`ops.mla_norm_store_absorb`) and the W_UV product inside mla_decode's combine
# (`w_uv`): 3 launches (store+absorb, split, combine+W_UV) instead of 5. False: the unfused ops (the reference
# composition the fused path is tested against). The default of `fused_decode_enabled`, which the environment
# variable TOKENSPEED_MLA_FUSED overrides at each call ("1" on, "0" off), so a benchmark can A/B the two paths
# between CUDA-graph captures in one process.
FUSED_DECODE = True
FUSED_ENV = "TOKENSPEED_MLA_FUSED"
# ... for batches of at least this many sequences. H200, kimi-linear-48b-a3b decode at 4K, CUDA graphs, PDL, the
# whole step with the fused vs the unfused MLA (benchmarks/results/step_profile_h200_{cc6f0b0,a31b058}.json): batch 1
# 2.766 vs 2.710 ms (the combine + W_UV program re-reads its head's fp32 partials of all 64 split slots: 22 us
# against 5 + 4 us for combine and bmm), batch 4 4.656 vs 4.698, batch 16 9.644 vs 9.729, batch 64 17.344 vs 17.504.
FUSED_MIN_SEQS = 4
# Ragged batches (mixed steps: decodes beside short tails) take the fused form only when this is set or
# TOKENSPEED_MLA_FUSED=1 forces it: only uniform decode steps were timed (above), and the one end-to-end run with the
# ragged form on (swe-smith at concurrency 4, benchmarks/results/swe_smith_cuda_48b_{b6cf34e,ba0ffe1}*) had a p90
# time to first token of 1.6-2.1 s against 0.7 s before this fusion; its combine + W_UV re-reads every split's
# partials for each 16-token tile, which grows with the history. Not proven the cause; kept off until timed.
FUSED_RAGGED = False
# Memory layout of the per-head keys / values the expanded form builds on CUDA (`_expand_per_head`): "bshd" (on the
# H200 at 64K rows, 1.12 ms for both GEMMs against 1.49 head-major and 2.33 for the kv_b GEMM + cat, and the layout
# whose cuDNN plans are kept per length bucket: `ops/cuda/sdpa.py`) or "bhsd"; the variable overrides it per call.
EXPAND_LAYOUT = "bshd"
EXPAND_LAYOUT_ENV = "TOKENSPEED_MLA_EXPAND_LAYOUT"
# The expanded form builds per-head keys and values for every cached row of the sequences it takes (20 KB a row on
# kimi-linear-48b-a3b: 32 heads x (192 + 128) bf16): it takes them in groups whose keys and values fit in this many
# bytes (131,072 rows there; a longer sequence alone). Without the bound, a step of many chunks on long histories
# (sixteen 512-token chunks on 34K histories in the full-scale swe-smith run with --prefill-chunk-beside-decodes 512)
# asked for 11 GB at once and ran out of memory.
EXPANDED_MAX_BYTES = 5 << 29


def fused_decode_enabled(num_seqs: int | None = None) -> bool:
    """Whether the layer may take the fused decode path for a batch of `num_seqs` sequences: TOKENSPEED_MLA_FUSED
    "1" / "0" when set (read on every call), else FUSED_DECODE and num_seqs >= FUSED_MIN_SEQS (None: any batch).
    Raises ValueError on another value."""
    v = os.environ.get(FUSED_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{FUSED_ENV} must be 0 or 1; got {v!r}")
    if v:
        return v == "1"
    return FUSED_DECODE and (num_seqs is None or num_seqs >= FUSED_MIN_SEQS)


class MLAAttention(nn.Module):
    """One MLA layer. `cache_index` is this layer's ordinal among the model's MLA layers."""

    def __init__(
        self, config: KimiConfig, cache_index: int, parallel: ParallelContext, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        d = config.hidden_size
        self.cache_index = cache_index
        self.parallel = parallel
        self.num_heads = h = parallel.shard(config.num_attention_heads, "MLA heads")
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk = self.nope + self.rope
        self.scale = 1.0 / math.sqrt(qk)
        self.use_rope = not config.mla_use_nope
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling_dict
        if self.use_rope and self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):
            m = ops.yarn_mscale(float(self.rope_scaling["factor"]),
                                               float(self.rope_scaling["mscale_all_dim"]))
            self.scale *= m * m
        if config.q_lora_rank is not None:
            self.q_a_proj = Linear(d, config.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps, dtype, device)
            self.q_b_proj = Linear(config.q_lora_rank, h * qk, dtype, device, shard="out")
            self.kv_a_proj_with_mqa = Linear(d, config.kv_lora_rank + self.rope, dtype, device)
        else:  # q_proj and kv_a_proj_with_mqa both read x: one GEMM (see `_project`)
            self.q_kv_a_proj = MergedLinear(d, (Part("q_proj", h * qk, sharded=True),
                                                Part("kv_a_proj_with_mqa", config.kv_lora_rank + self.rope,
                                                     sharded=False)), dtype, device)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.mla_norm_eps, dtype, device)
        self.kv_b_proj = Linear(config.kv_lora_rank, h * (self.nope + self.v_dim), dtype, device, shard="out")
        if config.mla_use_output_gate:
            self.g_proj = Linear(d, h * self.v_dim, dtype, device, shard="out")
        self.o_proj = Linear(h * self.v_dim, d, dtype, device, shard="in")

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, hidden] -> (q [T, H, nope + rope], kv_a [T, kv_lora + rope]). Without q_lora, one GEMM of the
        merged weight [q_proj ; kv_a_proj_with_mqa] (`q_kv_a_proj`, loaded from the two checkpoint names; q's rows
        this rank's heads, kv_a's replicated) and both are strided views of its output (row stride H * (nope +
        rope) + kv_lora + rope): every consumer reads them in place (unit last stride). With q_lora (K3): q_a_proj
        -> q_a_layernorm -> q_b_proj, and kv_a_proj_with_mqa on its own."""
        t, qk = x.shape[0], self.nope + self.rope
        if hasattr(self, "q_kv_a_proj"):
            y = self.q_kv_a_proj(x)
            return self.q_kv_a_proj.part(y, "q_proj").view(t, self.num_heads, qk), \
                self.q_kv_a_proj.part(y, "kv_a_proj_with_mqa")
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(t, self.num_heads, qk), self.kv_a_proj_with_mqa(x)

    def projection_weight(self, name: str) -> Tensor:
        """The weight [rows, hidden] of input projection `name` ("q_proj" or "kv_a_proj_with_mqa" without q_lora;
        any projection module's name with it): a view of the merged weight where merged."""
        if hasattr(self, "q_kv_a_proj") and name in self.q_kv_a_proj.slices:
            return self.q_kv_a_proj.part_weight(name)
        return getattr(self, name).weight

    def _kv_b(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj split per head in fp32: W_UK [H, nope, r] and W_UV [H, v, r]."""
        w = self.kv_b_proj.weight.float().view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x: Tensor, batch: ForwardBatch, cache: CacheBuffers) -> Tensor:
        """x: [T, hidden] normed input -> [T, hidden]. Writes the new tokens' latent rows into the cache."""
        q, kv_a = self._project(x)
        k_pe = kv_a[:, self.kv_lora_rank :]
        if self.use_rope:
            cos, sin = ops.rope_cos_sin(batch.positions, self.rope, self.rope_theta, self.rope_scaling)
            q = torch.cat([q[..., : self.nope], ops.apply_rope(q[..., self.nope :], cos, sin)], dim=-1)
            k_pe = ops.apply_rope(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        latent_cache = cache.mla_latent[self.cache_index]
        norm = self.kv_a_layernorm
        form = self._fused_form(q, batch, latent_cache)
        if form is not None:
            o = self._attend_fused(q, kv_a[:, : self.kv_lora_rank], k_pe, batch, latent_cache, cache.mla_kv_scale,
                                   ragged=form == "ragged")
            return self._output(o, x)
        # kv_a_layernorm of c_kv, [c_kv ; k_pe] and the cache write: one launch on CUDA, reading kv_a in place.
        ops.mla_norm_store_latent(kv_a[:, : self.kv_lora_rank], k_pe, norm.weight, norm.eps, latent_cache,
                                  batch.slot_mapping, cache.mla_kv_scale)
        if _uniform_form(batch, q):
            o = self._attend_uniform(q, batch, latent_cache, cache.mla_kv_scale)
        else:  # mixed query lengths (or one longer than a verify window): by sequence, see `_attend`
            o = self._attend(q, batch, latent_cache, cache.mla_kv_scale)  # [T, H, v]
        return self._output(o, x)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """o [T, H, v] -> the output gate (if any), o_proj and the tensor-parallel reduction: [T, hidden]."""
        o = o.reshape(x.shape[0], self.num_heads * self.v_dim)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.parallel.all_reduce(self.o_proj(o))

    def _fused_form(self, q: Tensor, batch: ForwardBatch, latent_cache: Tensor) -> str | None:
        """"uniform" / "ragged" when the whole batch takes the absorbed Triton kernel in that form (the cases where
        the unfused path calls `_attend_latent` once for the batch) and `fused_decode_enabled()` (ragged: also
        FUSED_RAGGED or TOKENSPEED_MLA_FUSED=1); else None. fp32 off
        CUDA only: there the unfused absorption runs in fp32 whatever the model dtype."""
        if not fused_decode_enabled(batch.num_seqs) or not (q.is_cuda or q.dtype == torch.float32):
            return None
        if not ops.mla_decode_kernel_usable(latent_cache, self.kv_lora_rank, q, batch.page_table, batch.kv_lens,
                                            batch.cu_seqlens):
            return None
        if _uniform_form(batch, q):
            return "uniform"
        ragged = FUSED_RAGGED or os.environ.get(FUSED_ENV, "").strip() == "1"
        return "ragged" if ragged and all(n <= ABSORBED_MAX_TAIL for n in batch.query_lens_host) else None

    def _attend_fused(self, q: Tensor, kv_c: Tensor, k_pe: Tensor, batch: ForwardBatch, latent_cache: Tensor,
                      kv_scale: float, ragged: bool) -> Tensor:
        """The latent store + `_attend_latent` of the whole batch in 3 launches on CUDA: `ops.mla_norm_store_absorb`
        (the store and q_lat = q_nope @ W_UK, in the model dtype), then `ops.mla_decode` with w_uv (split, and the
        combine with the W_UV product). q [T, H, nope + rope]; returns [T, H, v] in the model dtype; writes the
        new latent rows."""
        t, h, r = q.shape[0], self.num_heads, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, r)
        norm = self.kv_a_layernorm
        q_lat = ops.mla_norm_store_absorb(kv_c, k_pe, norm.weight, norm.eps, latent_cache, batch.slot_mapping,
                                          kv_scale, q[..., : self.nope], w[:, : self.nope])
        q_rope, w_uv = q[..., self.nope :], w[:, self.nope :]
        if ragged:
            o = ops.mla_decode(q_lat, latent_cache, batch.page_table, batch.kv_lens, self.scale, r, kv_scale,
                               q_rope=q_rope, cu_seqlens_q=batch.cu_seqlens,
                               max_q=max(batch.query_lens_host, default=0), w_uv=w_uv)
        else:
            n = batch.kv_lens.shape[0]
            o = ops.mla_decode(q_lat.view(n, t // n, h, r), latent_cache, batch.page_table, batch.kv_lens, self.scale,
                               r, kv_scale, q_rope=q_rope.view(n, t // n, h, self.rope), w_uv=w_uv)
        return o.view(t, h, self.v_dim).to(self.kv_b_proj.weight.dtype)

    def _attend_uniform(self, q: Tensor, batch: ForwardBatch, latent_cache: Tensor, kv_scale: float) -> Tensor:
        """Absorbed attention when every sequence has the same q_len (decode, verify): device values only, so it
        can be captured in a CUDA graph. See `_attend_latent` (q [N*Q, H, .] viewed as [N, Q, H, .])."""
        return self._attend_latent(q, latent_cache, batch.page_table, batch.kv_lens, kv_scale)

    def _attend_latent(self, q: Tensor, latent_cache: Tensor, page_table: Tensor, kv_lens: Tensor, kv_scale: float,
                       cu_seqlens_q: Tensor | None = None, max_q: int = 0) -> Tensor:
        """Absorbed attention through `ops.mla_decode`: q [T, H, nope + rope] the sequences' query rows, page_table
        / kv_lens [N] (device) theirs; uniform (T = N * Q, rows sequence-major) or, with cu_seqlens_q [N+1] (device)
        and max_q (host), ragged. Returns [T, H, v] in the model dtype. On CUDA the absorption runs in the model
        dtype (tensor cores); elsewhere in fp32 like `_attend_absorbed`, so CPU results do not depend on which path
        a batch took.

        Launches on CUDA: the W_UK product, mla_decode (split + combine), the W_UV product (the unfused path, the
        reference of `_attend_fused`, which the layer takes when `fused_decode_enabled()`); the products are
        `ops.stacked_linear` over the heads (bmm, or its PDL kernel at a few rows). The absorbed query is passed
        as two views (q_lat, and q_pe read in place from q), not concatenated; the W_UV product writes straight
        into a [T, H, v] buffer (through its [H, T, v] transpose), so the o_proj input needs no copy."""
        t, h, r = q.shape[0], self.num_heads, self.kv_lora_rank
        cdt = q.dtype if q.is_cuda else torch.float32
        w = self.kv_b_proj.weight.to(cdt).view(h, self.nope + self.v_dim, r)
        q_lat = ops.stacked_linear(q[..., : self.nope].to(cdt), w[:, : self.nope].transpose(1, 2))  # [H, T, r]
        if cu_seqlens_q is None:
            n = kv_lens.shape[0]
            o_lat = ops.mla_decode(q_lat.transpose(0, 1).view(n, t // n, h, r), latent_cache, page_table, kv_lens,
                                   self.scale, r, kv_scale,
                                   q_rope=q[..., self.nope :].to(cdt).view(n, t // n, h, self.rope))
        else:
            o_lat = ops.mla_decode(q_lat.transpose(0, 1), latent_cache, page_table, kv_lens, self.scale, r, kv_scale,
                                   q_rope=q[..., self.nope :].to(cdt), cu_seqlens_q=cu_seqlens_q, max_q=max_q)
        o = torch.empty(t, h, self.v_dim, dtype=cdt, device=q.device)
        ops.stacked_linear(o_lat.view(t, h, r), w[:, self.nope :], out=o.transpose(0, 1))
        return o.to(self.kv_b_proj.weight.dtype)

    def _attend(self, q: Tensor, batch: ForwardBatch, latent_cache: Tensor, kv_scale: float) -> Tensor:
        """Attention of every sequence, each routed to the absorbed or the expanded form by its query length.

        Where `mla_decode` runs the Triton kernel, sequences with up to ABSORBED_MAX_TAIL new tokens take the ragged
        absorbed kernel (`_attend_ragged`; the whole batch in one launch when none is longer); otherwise (the CPU
        path) those with up to ABSORBED_MAX_QUERY_LEN take the torch reference (`_attend_absorbed`)."""
        qlens = batch.query_lens_host
        kernel = ops.mla_decode_kernel_usable(latent_cache, self.kv_lora_rank, q, batch.page_table, batch.kv_lens,
                                              batch.cu_seqlens)
        limit = ABSORBED_MAX_TAIL if kernel else ABSORBED_MAX_QUERY_LEN
        absorbed = self._attend_ragged if kernel else self._attend_absorbed
        short = [n for n, ql in enumerate(qlens) if 0 < ql <= limit]
        long = [n for n, ql in enumerate(qlens) if ql > limit]
        if kernel and not long:  # sequences without new tokens take no work in the ragged kernel
            return self._attend_ragged(q, list(range(len(qlens))), batch, latent_cache, kv_scale, batch.page_table)
        if len(short) == len(qlens) or len(long) == len(qlens):  # one form for the whole batch: no gathers
            fn = absorbed if short else self._attend_expanded
            return fn(q, list(range(len(qlens))), batch, latent_cache, kv_scale, batch.page_table)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        for subset, fn in ((short, absorbed), (long, self._attend_expanded)):
            if subset:
                cu = batch.cu_seqlens_host
                tokens = to_device([t for n in subset for t in range(cu[n], cu[n + 1])], torch.long, q.device)
                pages = batch.page_table.index_select(0, to_device(subset, torch.long, q.device))
                out.index_copy_(0, tokens, fn(q.index_select(0, tokens), subset, batch, latent_cache, kv_scale,
                                              pages))
        return out

    def _attend_ragged(self, q, subset, batch, latent_cache, kv_scale, page_table) -> Tensor:
        """`subset`'s sequences (host indices into the batch; their query rows `q`, page-table rows `page_table`)
        through the ragged absorbed kernel. The whole batch uses the batch's device offsets and lengths (no host
        copy: graph-safe once max_q is fixed); a subset copies its own in."""
        qlens = batch.query_lens_host
        max_q = max((qlens[n] for n in subset), default=0)
        if len(subset) == batch.num_seqs:
            cu, kv_lens = batch.cu_seqlens, batch.kv_lens
        else:
            kv_lens = to_device([batch.kv_lens_host[n] for n in subset], torch.long, q.device)
            if all(qlens[n] == 1 for n in subset):  # decodes beside a long chunk: the decode kernels (Gluon on sm_90)
                return self._attend_latent(q, latent_cache, page_table, kv_lens, kv_scale)
            cu = to_device(_cumsum([qlens[n] for n in subset]), torch.long, q.device)
        return self._attend_latent(q, latent_cache, page_table, kv_lens, kv_scale, cu, max_q)

    def _attend_absorbed(self, q, subset, batch, latent_cache, kv_scale, page_table) -> Tensor:
        """`subset`'s sequences (host indices into the batch), their query rows `q` and page-table rows."""
        w_uk, w_uv = self._kv_b()
        q = q.float()
        q_abs = torch.cat([torch.einsum("thn,hnr->thr", q[..., : self.nope], w_uk), q[..., self.nope :]], dim=-1)
        cu = _cumsum([batch.query_lens_host[n] for n in subset])
        o_latent = ops.mla_attention_paged(
            q_abs, latent_cache, page_table, cu, [batch.kv_lens_host[n] for n in subset],
            self.scale, self.kv_lora_rank, kv_scale,
        )
        return torch.einsum("thr,hvr->thv", o_latent, w_uv).to(self.kv_b_proj.weight.dtype)

    def _attend_expanded(self, q, subset, batch, latent_cache, kv_scale, page_table) -> Tensor:
        """`subset`'s sequences (host indices into the batch; their query rows `q`, page-table rows `page_table`)
        in the expanded form, in groups whose per-head keys and values fit in EXPANDED_MAX_BYTES."""
        kv_lens = [batch.kv_lens_host[n] for n in subset]
        cdt = q.dtype if q.is_cuda else torch.float32
        row_bytes = self.num_heads * (self.nope + self.rope + self.v_dim) * cdt.itemsize
        groups = _key_row_groups(kv_lens, max(1, EXPANDED_MAX_BYTES // row_bytes))
        if len(groups) == 1:
            return self._attend_expanded_group(q, subset, batch, latent_cache, kv_scale, page_table)
        cu = _cumsum([batch.query_lens_host[n] for n in subset])
        return torch.cat([self._attend_expanded_group(q[cu[lo] : cu[hi]], subset[lo:hi], batch, latent_cache,
                                                      kv_scale, page_table[lo:hi]) for lo, hi in groups])

    def _attend_expanded_group(self, q, subset, batch, latent_cache, kv_scale, page_table) -> Tensor:
        """Keys/values expanded per head from the cached latent rows; fp32 on the CPU (the reference numerics),
        the model dtype on CUDA (tensor cores, fused SDPA with an fp32 softmax)."""
        cdt = q.dtype if q.is_cuda else torch.float32
        kv_lens = [batch.kv_lens_host[n] for n in subset]
        latent = ops.mla_gather_latent(latent_cache, page_table, kv_lens, cdt, kv_scale)
        if q.is_cuda:
            k, v = self._expand_per_head(latent)
        else:
            kv = nn.functional.linear(latent[:, : self.kv_lora_rank], self.kv_b_proj.weight.to(cdt))
            kv = kv.view(-1, self.num_heads, self.nope + self.v_dim)
            k_pe = latent[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
            k, v = torch.cat([kv[..., : self.nope], k_pe], dim=-1), kv[..., self.nope :]
        return ops.mla_attention_expanded(
            q.to(cdt), k, v, _cumsum([batch.query_lens_host[n] for n in subset]), _cumsum(kv_lens), self.scale,
        ).to(q.dtype)

    def _expand_per_head(self, latent: Tensor, layout: str | None = None) -> tuple[Tensor, Tensor]:
        """Per-head keys [S, H, nope + rope] and values [S, H, v] from latent rows [S, r + rope], without a cat:
        keys come from the whole 576-wide row times [W_UK[h] 0 ; 0 I] per head, so k_pe is copied exactly (the
        same bf16 bits as the kv_b GEMM followed by the cat on an H200, `benchmarks/mla_expanded_h200.py`).

        layout (default EXPAND_LAYOUT, or the TOKENSPEED_MLA_EXPAND_LAYOUT variable): "bshd", contiguous [S, H, d]
        from one plain GEMM each, in storage with `sdpa.ROW_SLACK` spare rows (what the bucketed cuDNN plans take,
        `ops/cuda/sdpa.py`); "bhsd", views of contiguous head-major [H, S, d] tensors from one batched GEMM each."""
        layout = layout or os.environ.get(EXPAND_LAYOUT_ENV, "").strip() or EXPAND_LAYOUT
        w_k, w_v = self._head_major_weights(latent.dtype)
        h, rows = self.num_heads, latent.shape[0]
        if layout == "bshd":
            k = padded_rows(rows, h * w_k.shape[1], dtype=latent.dtype, device=latent.device)
            v = padded_rows(rows, h * w_v.shape[1], dtype=latent.dtype, device=latent.device)
            torch.mm(latent, w_k.reshape(-1, w_k.shape[-1]).t(), out=k)
            torch.mm(latent[:, : self.kv_lora_rank], w_v.reshape(-1, w_v.shape[-1]).t(), out=v)
            return k.view(rows, h, -1), v.view(rows, h, -1)
        if layout != "bhsd":
            raise ValueError(f"{EXPAND_LAYOUT_ENV} must be bhsd or bshd; got {layout!r}")
        k = torch.matmul(latent.unsqueeze(0), w_k.transpose(1, 2))
        v = torch.matmul(latent[:, : self.kv_lora_rank].unsqueeze(0), w_v.transpose(1, 2))
        return k.transpose(0, 1), v.transpose(0, 1)

    def _head_major_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(W_K' [H, nope + rope, r + rope], W_UV [H, v, r]) in `dtype`, built from kv_b_proj's weight and rebuilt
        when that weight is replaced or written in place (a reload)."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, dtype)
        cached = getattr(self, "_head_major", None)
        if cached is None or cached[0] != key:
            wh = w.detach().to(dtype).view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
            rope = self.rope
            w_k = wh.new_zeros(self.num_heads, self.nope + rope, self.kv_lora_rank + rope)
            w_k[:, : self.nope, : self.kv_lora_rank] = wh[:, : self.nope]
            w_k[:, self.nope :, self.kv_lora_rank :] = torch.eye(rope, dtype=dtype, device=w.device)
            cached = (key, w_k, wh[:, self.nope :].contiguous())
            self._head_major = cached
        return cached[1], cached[2]


def _uniform_form(batch: ForwardBatch, q: Tensor) -> bool:
    """Whether every sequence attends as one [N, Q, H] block (`_attend_uniform` / the fused "uniform" form): Q =
    `batch.uniform_query_len` between 1 and ABSORBED_MAX_QUERY_LEN, and on CUDA Q 1 (decode) or a verify step. On
    CUDA the split kernels compile per Q: verify windows are compiled when their graphs are captured, while equal
    short tails of other steps (a lone 4- or 8-token turn) take the ragged kernel, which compiles once for all
    lengths (they compiled mid-serve before: 1.5 s stalls in an H200 swe-smith run)."""
    ql = batch.uniform_query_len
    return ql is not None and 1 <= ql <= ABSORBED_MAX_QUERY_LEN and (ql == 1 or batch.verify or not q.is_cuda)


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _key_row_groups(kv_lens: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of `kv_lens` whose sums stay within max_rows (a longer entry alone), in order,
    covering every index once."""
    groups, lo, rows = [], 0, 0
    for n, kv in enumerate(kv_lens):
        if n > lo and rows + kv > max_rows:
            groups.append((lo, n))
            lo, rows = n, 0
        rows += kv
    groups.append((lo, len(kv_lens)))
    return groups
