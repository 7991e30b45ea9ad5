"""KDA (Kimi Delta Attention) layer: projections, short conv, gated delta rule, gated output norm.

Math: k3-architecture.md section 2.4. Heads are split over tensor-parallel ranks (f_a and the low-rank gate's
down projection are replicated; o_proj is row-parallel and all-reduced).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.batch import CacheBuffers, ForwardBatch, ReplayInputs
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.layers import Linear, weight


def _a_log_to_heads(num_heads: int):
    """A_log is stored as [H], [128] zero-padded, or [1, 1, H, 1]: all become [H]."""

    def transform(t: Tensor) -> Tensor:
        flat = t.reshape(-1)
        if flat.numel() < num_heads:
            raise ValueError(f"A_log has {flat.numel()} values, need {num_heads} (one per KDA head)")
        return flat[:num_heads]

    return transform


# Batches whose sequences all have this many new tokens or fewer (decode, verify windows) take the fused path.
FUSED_MAX_QUERY_LEN = 16


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
        self.qkv_proj = Linear(d, 3 * local, dtype, device, shard="out",
                               sources=("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        self.conv_weight = weight(
            (3 * local, config.short_conv_kernel_size), torch.float32, device, shard_dim=0,
            sources=("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
            transform=lambda t: t.reshape(t.shape[0], -1), untransform=lambda t: t.unsqueeze(1),
        )
        self.f_a_proj = Linear(d, hd, dtype, device)
        self.f_b_proj = Linear(hd, local, dtype, device, shard="out")
        self.b_proj = Linear(d, self.num_heads, dtype, device, shard="out")
        if config.use_full_rank_gate:
            self.g_proj = Linear(d, local, dtype, device, shard="out")
        else:
            self.g_a_proj = Linear(d, hd, dtype, device)
            self.g_b_proj = Linear(hd, local, dtype, device, shard="out")
        self.A_log = weight((self.num_heads,), torch.float32, device, shard_dim=0,
                            transform=_a_log_to_heads(config.kda_num_heads))
        self.dt_bias = weight((self.num_heads, hd), torch.float32, device, shard_dim=0,
                              transform=lambda t: t.reshape(config.kda_num_heads, hd),
                              untransform=lambda t: t.reshape(-1))
        self.o_norm = nn.Module()
        self.o_norm.weight = weight((hd,), torch.float32, device)
        self.o_proj = Linear(local, d, dtype, device, shard="in")

    def output_gate(self, x: Tensor) -> Tensor:
        return self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: Tensor, batch: ForwardBatch, cache: CacheBuffers) -> Tensor:
        """x: [T, hidden] normed input -> [T, hidden].

        Commit mode (default): advances the KDA state of batch.kda_slots in place. Verify mode
        (`batch.verify`): reads the states but leaves them untouched, and records in `cache.replay[cache_index]`
        what the model's replay (`replay_kda`, through `replay_tensors`) needs to advance them later by the accepted
        tokens only. Batches where every sequence has the same few new tokens (decode, verify) run the fused
        `ops.kda_decode` (one launch, graph-safe); others (prefill chunks, mixed steps) compose conv, gate and
        `ops.kda_scan`.
        """
        t, h, hd = x.shape[0], self.num_heads, self.head_dim
        projected = self.qkv_proj(x)
        f = self.f_b_proj(self.f_a_proj(x))
        b = self.b_proj(x)
        if batch.verify:
            cache.replay[self.cache_index] = ReplayInputs(projected, f, b)
        conv_state, rec_state = cache.kda_conv[self.cache_index], cache.kda_recurrent[self.cache_index]
        ql = batch.uniform_query_len
        if ql is not None and 1 <= ql <= FUSED_MAX_QUERY_LEN:
            o = ops.kda_decode(projected, f, b, self.conv_weight, conv_state, self.A_log, self.dt_bias, rec_state,
                               batch.kda_slots, batch.cu_seqlens, lower_bound=self.lower_bound,
                               scale=1.0 / math.sqrt(hd), update_state=not batch.verify)
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
                                cu_seqlens=batch.cu_seqlens, cu_seqlens_host=batch.cu_seqlens_host)
        o = ops.gated_rms_norm(o, self.output_gate(x).view(t, h, hd), self.o_norm.weight, self.eps)
        return self.parallel.all_reduce(self.o_proj(o.reshape(t, h * hd).to(x.dtype)))

    def replay_tensors(self, cache: CacheBuffers) -> ops.KdaLayerTensors:
        """This layer's part of the KDA state replay after a verify forward (`ops.kda_replay_layers`): the inputs
        that verification recorded in `cache.replay[cache_index]` (read in place: no gather, no projection
        recomputed), this layer's weights and its conv / recurrent pools (what the replay mutates, at the batch's
        slots). Raises KeyError when no verification was recorded for this layer."""
        rec = cache.replay[self.cache_index]
        return ops.KdaLayerTensors(rec.projected, rec.f, rec.b, self.conv_weight, cache.kda_conv[self.cache_index],
                                   self.A_log, self.dt_bias, cache.kda_recurrent[self.cache_index])
