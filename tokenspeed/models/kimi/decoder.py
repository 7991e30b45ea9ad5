"""One decoder layer: attention (KDA or MLA) then FFN (dense MLP or MoE), on either residual stream.

Block AttnRes (K3, section 2.3 of k3-architecture.md):
  1. x_a = mix_attn(blocks + [P]) (P itself when there are no blocks); 2. at a block boundary snapshot P, P = empty
  3. a = Attn(input_norm(x_a)); 4. P += a; 5. x_m = mix_mlp(blocks + [P]); 6. f = FFN(post_norm(x_m)); 7. P += f
Plain pre-norm residual (Kimi Linear): h += Attn(input_norm(h)); h += FFN(post_norm(h)). Each add is fused with
the norm that reads its result (`ops.add_rms_norm`, one kernel per junction on CUDA): the layer takes its input
already normed and the norm after it (the next layer's input norm, or the final norm), and returns its output
stream with that norm applied. A MoE layer on one rank does its second junction inside the experts' combine
kernel (`SparseMoE.forward_add_norm`): one launch fewer, the same bits; on CUDA at decode sizes its first junction
also fuses with the router GEMV and the routing (`SparseMoE.forward_junctions`, `ops.moe_gate`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.kimi.attn_res import ResidualStream, depth_query, mix_and_norm
from tokenspeed.models.kimi.kda import KDAAttention
from tokenspeed.models.kimi.mla import MLAAttention
from tokenspeed.models.kimi.mlp import GatedMLP
from tokenspeed.models.kimi.moe import SparseMoE
from tokenspeed.models.layers import Linear, RMSNorm


class DecoderLayer(nn.Module):
    """Layer `layer_id` of the stack; submodule names are the checkpoint names."""

    def __init__(
        self,
        config: KimiConfig,
        layer_id: int,
        cache_index: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device=None,
    ) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_id = layer_id
        self.eps = eps
        self.block_size = config.attn_res_block_size
        attn_cls = MLAAttention if config.is_mla_layer(layer_id) else KDAAttention
        self.self_attn = attn_cls(config, cache_index, parallel, dtype, device)
        if config.is_moe_layer(layer_id):
            self.block_sparse_moe = SparseMoE(config, parallel, dtype, device)
        else:
            self.mlp = GatedMLP(config, config.intermediate_size, parallel, dtype, device)
        self.input_layernorm = RMSNorm(d, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, device)
        if self.block_size is not None:
            self.self_attention_res_norm = RMSNorm(d, eps, dtype, device)
            self.self_attention_res_proj = Linear(d, 1, dtype, device)
            self.mlp_res_norm = RMSNorm(d, eps, dtype, device)
            self.mlp_res_proj = Linear(d, 1, dtype, device)

    def ffn(self, x: Tensor) -> Tensor:
        return self.mlp(x) if hasattr(self, "mlp") else self.block_sparse_moe(x)

    def forward_attn_res(self, stream: ResidualStream, batch: ForwardBatch, cache: CacheBuffers) -> None:
        """Advance the Block AttnRes stream through this layer (mutates `stream`)."""
        assert self.block_size is not None
        if stream.num_blocks == 0:
            x = self.input_layernorm(stream.partial)
        else:
            query = depth_query(self.self_attention_res_norm, self.self_attention_res_proj)
            x = mix_and_norm(stream, query, self.eps, self.input_layernorm)
        if self.layer_id % self.block_size == 0:
            stream.snapshot()
        stream.add(self.self_attn(x, batch, cache))
        query = depth_query(self.mlp_res_norm, self.mlp_res_proj)
        stream.add(self.ffn(mix_and_norm(stream, query, self.eps, self.post_attention_layernorm)))

    def forward_plain(self, hidden: Tensor, normed: Tensor, batch: ForwardBatch, cache: CacheBuffers,
                      next_norm: RMSNorm) -> tuple[Tensor, Tensor]:
        """Pre-norm residual with each add fused into the norm after it. hidden: the stream h entering the layer
        [T, hidden]; normed: input_layernorm(h) (the caller fused it with the add that made h); next_norm: the norm
        that reads this layer's output (the next layer's input norm, or the final norm). Returns (h'', x):
        h' = h + Attn(normed), h'' = h' + FFN(post_attention_layernorm(h')) the layer's output stream and
        x = next_norm(h''), each add and the norm after it one `ops.add_rms_norm` (a MoE on one rank: the second
        one inside the experts' combine; the first one with the router in `ops.moe_gate` where
        `SparseMoE.gate_fusable`). Nothing is mutated but the cache."""
        post = self.post_attention_layernorm
        attn_out = self.self_attn(normed, batch, cache)
        if hasattr(self, "block_sparse_moe"):  # both junctions (and, when fusable, the routing) in the MoE block
            x, hidden = self.block_sparse_moe.forward_junctions(attn_out, hidden, post, next_norm)
        else:
            x, hidden = ops.add_rms_norm(attn_out, hidden, post.weight, post.eps)
            x, hidden = ops.add_rms_norm(self.mlp(x), hidden, next_norm.weight, next_norm.eps)
        return hidden, x
