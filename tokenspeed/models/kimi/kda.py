"""KDA (Kimi Delta Attention) layer: projections, short conv, gated delta rule, gated output norm.

Math: k3-architecture.md section 2.4. Heads are split over tensor-parallel ranks (f_a and the low-rank gate's
down projection are replicated; o_proj is row-parallel and all-reduced).

Projections (the checkpoint keeps its names; only the in-memory layout is merged): every projection of the normed
input x is one GEMM, `in_proj` (a `MergedLinear`), whose weight rows are, in this order,
    q_proj | k_proj | v_proj | f_a_proj | g_a_proj | b_proj      (low-rank output gate, Kimi Linear)
    q_proj | k_proj | v_proj | g_proj | f_a_proj | b_proj        (full-rank output gate, K3)
(q, k, v, g and b column-parallel: this rank's heads; f_a and g_a replicated: all hd rows). Its consumers read
column views of the output (row stride = the merged width, no copy): the fused decode and the conv read q|k|v
and b in place. The low-rank gate's two up projections run as one `StackedLinear` (`fg_b_proj`, weight
[2, local, hd] from f_b_proj and g_b_proj) on the adjacent f_a|g_a columns, giving f and g contiguous; the
full-rank config keeps `f_b_proj`. Per decode step a KDA layer launches in_proj, fg_b_proj (or f_b_proj), the
fused kda_decode (the gated output norm is its epilogue) and o_proj (+ the all-reduce under tensor parallelism);
at small batch (`ops.kda_fuses_gate_projections`) the up projections run inside kda_decode from the f_a / g_a
columns and the weights (`low_rank_inputs`), one launch fewer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.batch import CacheBuffers, ForwardBatch, ReplayInputs
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.layers import Linear, MergedLinear, Part, StackedLinear, weight


def _a_log_to_heads(num_heads: int):
    """A_log is stored as [H], [128] zero-padded, or [1, 1, H, 1]: all become [H]."""

    def transform(t: Tensor) -> Tensor:
        flat = t.reshape(-1)
        if flat.numel() < num_heads:
            raise ValueError(f"A_log has {flat.numel()} values, need {num_heads} (one per KDA head)")
        return flat[:num_heads]

    return transform


def _in_parts(local: int, hd: int, heads: int, full_rank_gate: bool) -> list[Part]:
    """The parts of `in_proj` in column order (module docstring): f_a and g_a adjacent (one `fg_b_proj` input)."""
    gate = [Part("g_proj", local, True)] if full_rank_gate else []
    low_rank = [] if full_rank_gate else [Part("g_a_proj", hd, False)]
    return [Part("q_proj", local, True), Part("k_proj", local, True), Part("v_proj", local, True), *gate,
            Part("f_a_proj", hd, False), *low_rank, Part("b_proj", heads, True)]


# Batches whose sequences all have this many new tokens or fewer (decode, verify windows) take the fused path.
FUSED_MAX_QUERY_LEN = 16
# On CUDA, other batches (prefill chunks, steps mixing decodes or verify windows with a prompt's tail) take it too
# when no sequence has more than this many new tokens: the fused kernel walks each sequence's tokens in one launch,
# while the chunked scan's dozen launches per layer (fla's Python included) make an eager step of a short agentic
# tail host-bound. Chosen from `benchmarks/step_profile_h200.py` (tail_policy section): on a 64K history the fused
# window loop wins up to 512 new tokens (56 vs 76 ms alone, 59 vs 79 ms beside 15 decodes), ties at 800 and loses
# from 1300 (93 vs 83 ms).
FUSED_MAX_TAIL_CUDA = 768
# The same bound for verifications, lower: their prompt tails are not committed by the forward but replayed token
# by token with the accepted windows (`replay_kda`), which a longer tail would make the step's long pole.
FUSED_MAX_VERIFY_TAIL_CUDA = 256


def takes_fused_path(batch: ForwardBatch, on_cuda: bool) -> bool:
    """Whether a KDA layer runs `batch` through the fused `ops.kda_decode` rather than conv + `ops.kda_prefill`:
    every sequence has the same 1..FUSED_MAX_QUERY_LEN new tokens (decode, verify; any device), or, on CUDA, no
    sequence has more than FUSED_MAX_TAIL_CUDA new tokens (FUSED_MAX_VERIFY_TAIL_CUDA in a verification, whose
    short prompt tails are then replayed with the windows). A host decision from the batch's host lengths only."""
    ql = batch.uniform_query_len
    if ql is not None and 1 <= ql <= FUSED_MAX_QUERY_LEN:
        return True
    limit = FUSED_MAX_VERIFY_TAIL_CUDA if batch.verify else FUSED_MAX_TAIL_CUDA
    return on_cuda and batch.num_tokens > 0 and max(batch.query_lens_host) <= limit


class KDAAttention(nn.Module):
    """One KDA layer. `cache_index` is this layer's ordinal among the model's KDA layers."""

    def __init__(
        self, config: KimiConfig, cache_index: int, parallel: ParallelContext, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.kda_head_dim
        self.cache_index = cache_index
        self.parallel = parallel
        self.num_heads = parallel.shard(config.kda_num_heads, "KDA heads")
        self.head_dim = hd
        self.lower_bound = config.gate_lower_bound
        self.eps = config.rms_norm_eps
        local = self.num_heads * hd
        self.full_rank_gate = config.use_full_rank_gate
        self.in_proj = MergedLinear(d, _in_parts(local, hd, self.num_heads, self.full_rank_gate), dtype, device)
        self.conv_weight = weight(
            (3 * local, config.short_conv_kernel_size), torch.float32, device, shard_dim=0,
            sources=("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
            transform=lambda t: t.reshape(t.shape[0], -1), untransform=lambda t: t.unsqueeze(1),
        )
        if self.full_rank_gate:
            self.f_b_proj = Linear(hd, local, dtype, device, shard="out")
        else:
            self.fg_b_proj = StackedLinear(hd, local, ("f_b_proj.weight", "g_b_proj.weight"), dtype, device,
                                           shard="out")
        self.A_log = weight((self.num_heads,), torch.float32, device, shard_dim=0,
                            transform=_a_log_to_heads(config.kda_num_heads))
        self.dt_bias = weight((self.num_heads, hd), torch.float32, device, shard_dim=0,
                              transform=lambda t: t.reshape(config.kda_num_heads, hd),
                              untransform=lambda t: t.reshape(-1))
        self.o_norm = nn.Module()
        self.o_norm.weight = weight((hd,), torch.float32, device)
        self.o_proj = Linear(local, d, dtype, device, shard="in")

    def projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, hidden] -> (qkv [T, 3 * local], f [T, local], b [T, heads], gate [T, local]), all in x.dtype:
        the pre-conv q|k|v, the decay-gate logits, the beta logits and the output-gate logits. Two launches:
        `in_proj`, then `fg_b_proj` (f and gate contiguous) or `f_b_proj` (full-rank gate: gate is a view).
        qkv and b are views of the merged output (row stride = its width, unit column stride), read in place."""
        y = self.in_proj(x)
        qkv, b = self.in_proj.part(y, "q_proj", "v_proj"), self.in_proj.part(y, "b_proj")
        if self.full_rank_gate:
            return qkv, self.f_b_proj(self.in_proj.part(y, "f_a_proj")), b, self.in_proj.part(y, "g_proj")
        f, gate = self.fg_b_proj(self.in_proj.part(y, "f_a_proj", "g_a_proj")).unbind(0)
        return qkv, f, b, gate

    def low_rank_inputs(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor, Tensor | None,
                                                  tuple[Tensor, Tensor] | None]:
        """`projections` without the low-rank up projections, for `ops.kda_decode` to run them in its kernel:
        (qkv, (f_a, f_b weight), b, gate or None, (g_a, g_b weight) or None). One launch, `in_proj`; the full-rank
        config's gate is the in_proj view as before."""
        y = self.in_proj(x)
        qkv, b = self.in_proj.part(y, "q_proj", "v_proj"), self.in_proj.part(y, "b_proj")
        if self.full_rank_gate:
            f_in = (self.in_proj.part(y, "f_a_proj"), self.f_b_proj.weight)
            return qkv, f_in, b, self.in_proj.part(y, "g_proj"), None
        w = self.fg_b_proj.weight
        return qkv, (self.in_proj.part(y, "f_a_proj"), w[0]), b, None, (self.in_proj.part(y, "g_a_proj"), w[1])

    def forward(self, x: Tensor, batch: ForwardBatch, cache: CacheBuffers) -> Tensor:
        """x: [T, hidden] normed input -> [T, hidden].

        Commit mode (default): advances the KDA state of batch.kda_slots in place. Verify mode
        (`batch.verify`): reads the states but leaves them untouched, and records in `cache.replay[cache_index]`
        what the model's replay (`replay_kda`, through `replay_tensors`) needs to advance them later by the accepted
        tokens only; on the chunked-scan path the prompt rows (`batch.prompt_rows_host`, no drafts) are the
        exception: their scan's final state is committed and recorded as such (`ReplayInputs.committed`).
        Batches where every sequence has the same few new tokens (decode, verify) run the fused
        `ops.kda_decode` (one launch, graph-safe), and so do CUDA batches whose longest run of new tokens is
        short (FUSED_MAX_TAIL_CUDA); others (prefill chunks, mixed steps) compose conv, gate and `ops.kda_prefill`.
        """
        t, h, hd = x.shape[0], self.num_heads, self.head_dim
        fused = takes_fused_path(batch, x.is_cuda)
        f_in = gate_in = None
        if fused and not batch.verify and batch.uniform_query_len == 1 \
                and ops.kda_fuses_gate_projections(x, batch.num_seqs * h):  # decode: the up projections in-kernel
            projected, f_in, b, gate, gate_in = self.low_rank_inputs(x)
            f = None
        else:
            projected, f, b, gate = self.projections(x)
        if batch.verify:
            cache.replay[self.cache_index] = ReplayInputs(projected, f, b,
                                                          committed=() if fused else batch.prompt_rows_host)
        conv_state, rec_state = cache.kda_conv[self.cache_index], cache.kda_recurrent[self.cache_index]
        if fused:  # the output norm is the fused kernel's epilogue
            o = ops.kda_decode(projected, f, b, self.conv_weight, conv_state, self.A_log, self.dt_bias, rec_state,
                               batch.kda_slots, batch.cu_seqlens, lower_bound=self.lower_bound,
                               scale=1.0 / math.sqrt(hd), update_state=not batch.verify,
                               norm_gate=None if gate is None else gate.view(t, h, hd),
                               norm_weight=self.o_norm.weight, norm_eps=self.eps,
                               state_v_first=cache.kda_state_v_first, max_seq_tokens=batch.uniform_query_len,
                               f_low_rank=f_in, gate_low_rank=gate_in)
        else:
            slots = batch.kda_slots
            if batch.verify:  # scratch copies: the committed state is never written by a verification
                conv_state, rec_state = conv_state[slots], rec_state[slots]
                slots = torch.arange(batch.num_seqs, device=x.device)
            qkv = torch.empty(3, t, h * hd, dtype=projected.dtype, device=x.device)  # q, k, v each contiguous
            ops.causal_conv1d(projected, self.conv_weight, conv_state, slots, batch.cu_seqlens, activation="silu",
                              out=qkv.permute(1, 0, 2))
            q, k, v = qkv.view(3, t, h, hd).unbind(0)
            o = ops.kda_prefill(q, k, v, f.view(t, h, hd), b, self.A_log, self.dt_bias, self.lower_bound,
                                scale=1.0 / math.sqrt(hd), state=rec_state, state_indices=slots,
                                cu_seqlens=batch.cu_seqlens, cu_seqlens_host=batch.cu_seqlens_host,
                                state_v_first=cache.kda_state_v_first)
            if batch.verify and batch.prompt_rows_host:  # prompt chunks keep their scan's final state
                rows = batch.prompt_rows
                dst = batch.kda_slots[rows]
                cache.kda_conv[self.cache_index].index_copy_(0, dst, conv_state[rows])
                cache.kda_recurrent[self.cache_index].index_copy_(0, dst, rec_state[rows])
            o = ops.gated_rms_norm(o, gate.view(t, h, hd), self.o_norm.weight, self.eps)
        return self.parallel.all_reduce(self.o_proj(o.reshape(t, h * hd).to(x.dtype)))

    def replay_tensors(self, cache: CacheBuffers) -> ops.KdaLayerTensors:
        """This layer's part of the KDA state replay after a verify forward (`ops.kda_replay_layers`): the inputs
        that verification recorded in `cache.replay[cache_index]` (read in place: no gather, no projection
        recomputed), this layer's weights and its conv / recurrent pools (what the replay mutates, at the batch's
        slots). Raises KeyError when no verification was recorded for this layer."""
        rec = cache.replay[self.cache_index]
        return ops.KdaLayerTensors(rec.projected, rec.f, rec.b, self.conv_weight, cache.kda_conv[self.cache_index],
                                   self.A_log, self.dt_bias, cache.kda_recurrent[self.cache_index])
