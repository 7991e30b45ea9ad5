"""Sparse MoE block: sigmoid/noaux router, routed experts, shared experts.

Two shapes, one class, switched by config:
- LatentMoE (K3): routed experts run in a latent of width `routed_expert_hidden_size`:
  y = up(RMSNorm(sum_j w_j E_j(down(x)))) + shared(x), the shared experts a separate `GatedMLP`.
- Hidden-space MoE (Kimi Linear): y = routed_scaling * sum_j w_j E_j(x) + shared(x) (the scaling is folded into
  the router weights, as the reference does). One shared expert of the routed experts' width (Kimi Linear's
  `num_shared_experts: 1`; same activation) is folded into the routed experts as expert E, always selected with
  weight 1.0: w1/w3/w2 are stacked [E + 1, ...] (slot E loaded from and written back to the checkpoint's
  `shared_experts.{gate,up,down}_proj.weight`, sharded over TP ranks like a routed expert), `ops.moe_route(...,
  shared_expert_id=E)` appends the (E, 1.0) column, and one `ops.moe_experts` call computes routed + shared (no
  separate shared MLP launches). Against the unfolded `moe_experts(...) + shared(x)` the only difference is
  rounding: the routed sum is no longer rounded to the model dtype before the shared output is added (about one
  ulp in bf16). Any other shared-expert shape keeps a separate `GatedMLP` added in the experts' combine.
Experts are split over tensor-parallel ranks along their intermediate dim; partial sums are all-reduced.
`forward_add_norm` also does the residual junction after the FFN (h + y and the next norm): on one rank, for the
hidden-space MoE, inside the experts' combine kernel (`ops.moe_experts(..., residual=, norm_weight=)`).
`forward_junctions` also takes the junction before the FFN (the attention output's add and the post-attention norm):
on CUDA, one rank, hidden-space MoE and batches of up to GATE_FUSED_MAX_TOKENS tokens, that junction, the router
GEMV and the routing are one launch (`ops.moe_gate`), so a MoE layer's FFN is two launches of `ops.moe_experts`
after its attention.
TOKENSPEED_MOE_GATE (read per call): unset / "1", that fusion on CUDA; "0", never (the unfused launches, for A/B
timing); "force", wherever `ops.moe_gate_kernel_usable` (also in the Triton interpreter: tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.kimi.mlp import GatedMLP, activation_of
from tokenspeed.models.layers import Linear, RMSNorm, weight

# Batches of up to this many tokens take `ops.moe_gate` on CUDA (the kernel takes up to 16). H200, kimi-linear-48b-a3b
# decode at 4K, graphs, PDL, the step with vs without it (benchmarks/results/step_profile_h200_{cc6f0b0,d4374fe}.json):
# batch 1 3.167 vs 3.317 ms, 2 3.579 vs 3.640, 4 4.711 vs 4.723, 8 6.699 vs 6.561, 16 9.700 vs 9.337: every program
# re-normalises all T rows and the last one routes them one after another, which outgrows the two launches it saves.
GATE_FUSED_MAX_TOKENS = 4


class Router(nn.Module):
    """Router logits in fp32 from a model-dtype weight, plus the fp32 selection bias."""

    def __init__(self, config: KimiConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        assert config.num_experts is not None
        self.weight = weight((config.num_experts, config.hidden_size), dtype, device)
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = weight((config.num_experts,), torch.float32, device)

        self._weight32: tuple[int, Tensor] | None = None  # fp32 copy of `weight`, keyed by its version counter

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> fp32 logits [T, E]. On CUDA a bf16/fp16 x and weight go through one widening
        projection, `ops.linear(x, w, out_dtype=torch.float32)` (products of 16-bit values are exact in fp32 and
        both kernels accumulate in fp32: the fp32 GEMM's result up to summation order, without the fp32 copy of
        the weight or the fp32 SIMT kernel): the Triton GEMV with fp32 output for T <= 16 (decode; the rule is
        `ops.dispatch.linear_config`'s), else cuBLAS with fp32 output (also under TOKENSPEED_OPS=reference).
        Elsewhere (CPU): F.linear in fp32 against a cached fp32 copy of the weight."""
        w = self.weight
        if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2:
            return ops.linear(x, w, out_dtype=torch.float32)
        if w.dtype != torch.float32:  # keep one fp32 copy instead of converting on every call
            if self._weight32 is None or self._weight32[0] != w._version or self._weight32[1].shape != w.shape:
                self._weight32 = (w._version, w.detach().float())
            w = self._weight32[1]
        return nn.functional.linear(x.float(), w)


class SparseMoE(nn.Module):
    """The FFN of a MoE layer (checkpoint prefix `block_sparse_moe.`)."""

    def __init__(self, config: KimiConfig, parallel: ParallelContext, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        assert config.num_experts is not None
        self.parallel = parallel
        self.config = config
        self.act = activation_of(config)
        self.gate = Router(config, dtype, device)
        self.latent = config.routed_expert_hidden_size
        expert_in = self.latent or config.hidden_size
        if self.latent is not None:
            self.routed_expert_down_proj = Linear(config.hidden_size, self.latent, dtype, device)
            self.routed_expert_up_proj = Linear(self.latent, config.hidden_size, dtype, device)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(self.latent, config.rms_norm_eps, dtype, device)
        e, inter = config.num_experts, parallel.shard(config.moe_intermediate_size, "MoE intermediate size")
        # Hidden-space MoE with one shared expert of the routed width (the same activation: `activation_of`):
        # the shared expert is expert E of the stacked weights, always selected with weight 1.0.
        self.fold_shared = self.latent is None and config.num_shared_experts == 1
        experts = [f"experts.{i}" for i in range(e)]
        w1_src, w3_src, w2_src = ([f"{n}.{w}.weight" for n in experts] for w in ("w1", "w3", "w2"))
        if self.fold_shared:
            w1_src.append("shared_experts.gate_proj.weight")
            w3_src.append("shared_experts.up_proj.weight")
            w2_src.append("shared_experts.down_proj.weight")
        n = len(w1_src)
        self.w1 = weight((n, inter, expert_in), dtype, device, sources=w1_src, stack=True, shard_dim=0)
        self.w3 = weight((n, inter, expert_in), dtype, device, sources=w3_src, stack=True, shard_dim=0)
        self.w2 = weight((n, expert_in, inter), dtype, device, sources=w2_src, stack=True, shard_dim=1)
        if config.num_shared_experts > 0 and not self.fold_shared:
            self.shared_experts = GatedMLP(config, config.num_shared_experts * config.moe_intermediate_size,
                                           parallel, dtype, device, reduce_output=False)
        # `set_routing_simulation`: None (the router's choice) or the salt of this layer's simulated routing
        self.routing_salt: int | None = None

    def experts_launch_shape(self) -> tuple[int, int, int, int]:
        """(k, E, D, DI) of this layer's `ops.moe_experts` calls: routing columns (a folded shared expert's
        included), stacked experts, the experts' input width and their (sharded) intermediate width."""
        E, DI, D = self.w1.shape
        return self.config.num_experts_per_token + int(self.fold_shared), E, D, DI

    def _route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights fp32, ids int64) [T, k] (k + 1 with the folded shared expert's column)."""
        c = self.config
        return self._simulated(*ops.moe_route(
            self.gate(x), self._bias(), c.num_experts_per_token,
            scoring=c.moe_router_activation_func, renormalize=c.moe_renormalize,
            routed_scaling_factor=c.routed_scaling_factor,
            shared_expert_id=c.num_experts if self.fold_shared else None,
        ))

    def _simulated(self, weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The routing as given, or with its routed ids replaced in place (`set_routing_simulation`)."""
        if self.routing_salt is not None:
            c = self.config
            ops.moe_simulate_routing(weights, ids, c.num_experts_per_token, c.num_experts, self.routing_salt)
        return weights, ids

    def forward(self, x: Tensor) -> Tensor:
        """x: [T, hidden] (post-attention normed) -> [T, hidden]."""
        weights, ids = self._route(x)
        if self.latent is None:
            # folded: the shared expert is the last (weight 1.0) column of the routing; else routed + shared in
            # the experts' combine (one rounding of the routed sum, then the add, as `y + s`); either way
            # all-reduced once
            shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
            return self.parallel.all_reduce(ops.moe_experts(x, self.w1, self.w3, self.w2, weights, ids, self.act,
                                                            add=shared, prefetch_expert=self._shared_id()))
        z = ops.moe_experts(self.routed_expert_down_proj(x), self.w1, self.w3, self.w2, weights, ids, self.act)
        z = self.parallel.all_reduce(z)
        if hasattr(self, "routed_expert_norm"):
            z = self.routed_expert_norm(z)
        y = self.routed_expert_up_proj(z)
        if hasattr(self, "shared_experts"):
            return y + self.parallel.all_reduce(self.shared_experts(x))
        return y

    def gate_fusable(self, attn_out: Tensor, residual: Tensor, post_norm: RMSNorm) -> bool:
        """Whether `forward_junctions` runs the junction before the FFN and the routing as one `ops.moe_gate`
        launch: one rank, hidden-space MoE, sigmoid scoring, the kernel usable for these tensors (2-D [T, hidden]
        in the router weight's dtype), on CUDA at most GATE_FUSED_MAX_TOKENS rows, unless TOKENSPEED_MOE_GATE says
        otherwise (see the module docstring; "force" ignores the row limit). Host-only (no sync)."""
        mode = os.environ.get("TOKENSPEED_MOE_GATE", "1").strip().lower()
        if mode == "0" or (mode != "force" and (not attn_out.is_cuda or attn_out.shape[0] > GATE_FUSED_MAX_TOKENS)):
            return False
        c = self.config
        return self.latent is None and self.parallel.tp_size == 1 and ops.moe_gate_kernel_usable(
            attn_out, residual, post_norm.weight, self.gate.weight, self._bias(), c.num_experts_per_token,
            c.moe_router_activation_func)

    def forward_junctions(self, attn_out: Tensor, residual: Tensor, post_norm: RMSNorm, norm: RMSNorm
                          ) -> tuple[Tensor, Tensor]:
        """Both junctions of a pre-norm MoE layer around its FFN: h' = residual + attn_out, x = post_norm(h'),
        h'' = h' + self(x); returns (norm(h''), h'') (new tensors, nothing mutated), exactly
        `self.forward_add_norm(*ops.add_rms_norm(attn_out, residual, post_norm.weight, post_norm.eps), norm)` up
        to the fp32 summation order of the router logits. When `gate_fusable`: `ops.moe_gate` (the first junction,
        the router GEMV and the routing in one launch), then the experts with the second junction in their
        combine; otherwise that composition."""
        if not self.gate_fusable(attn_out, residual, post_norm):
            x, h = ops.add_rms_norm(attn_out, residual, post_norm.weight, post_norm.eps)
            return self.forward_add_norm(x, h, norm)
        c = self.config
        x, h, weights, ids = ops.moe_gate(
            attn_out, residual, post_norm.weight, post_norm.eps, self.gate.weight, self._bias(),
            c.num_experts_per_token, scoring=c.moe_router_activation_func, renormalize=c.moe_renormalize,
            routed_scaling_factor=c.routed_scaling_factor, shared_expert_id=self._shared_id())
        return self._experts_add_norm(x, h, *self._simulated(weights, ids), norm)

    def forward_add_norm(self, x: Tensor, residual: Tensor, norm: RMSNorm) -> tuple[Tensor, Tensor]:
        """The FFN and the pre-norm junction after it: (norm(residual + y), residual + y), y = forward(x) (new
        tensors, nothing mutated), exactly `ops.add_rms_norm(self(x), residual, norm.weight, norm.eps)`. Hidden-space
        MoE on one rank: the add and the norm run in the experts' combine (`ops.moe_experts(..., residual=)`, one
        launch fewer). Tensor-parallel ranks hold partial sums that are all-reduced before the add, and the latent
        MoE ends in a projection: both keep the separate junction."""
        if self.latent is not None or self.parallel.tp_size > 1:
            return ops.add_rms_norm(self(x), residual, norm.weight, norm.eps)
        weights, ids = self._route(x)
        return self._experts_add_norm(x, residual, weights, ids, norm)

    def _experts_add_norm(self, x: Tensor, residual: Tensor, weights: Tensor, ids: Tensor, norm: RMSNorm
                          ) -> tuple[Tensor, Tensor]:
        """One rank, hidden-space MoE: the experts of the routing (weights, ids) with the junction after them in
        their combine: (norm(residual + y), residual + y)."""
        shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
        return ops.moe_experts(x, self.w1, self.w3, self.w2, weights, ids, self.act, add=shared, residual=residual,
                               norm_weight=norm.weight, norm_eps=norm.eps, prefetch_expert=self._shared_id())

    def _bias(self) -> Tensor | None:
        """The router's fp32 selection bias (noaux_tc), or None."""
        return getattr(self.gate, "e_score_correction_bias", None)

    def _shared_id(self) -> int | None:
        """The folded shared expert's id (in every row of the routing), or None: a prefetch hint for the experts'
        gate/up launch (its weights are fetched while the router still runs)."""
        return self.config.num_experts if self.fold_shared else None


ROUTING_SIMULATIONS = ("off", "uniform")


def set_routing_simulation(model: nn.Module, mode: str) -> int:
    """Benchmarks with random weights: "uniform" makes every MoE layer of `model` replace its routed experts by
    `ops.moe_simulate_routing`'s (each expert picked by a token with probability k / E, independently; layer i
    salted with i), "off" restores the router's choice. Random weights route correlated tokens to the same few
    experts (kimi-linear-48b-a3b decode at batch 64 touched 126 experts a layer, against 226 with this simulation:
    benchmarks/results/serving_h200_uniform_routing_3fe8dfb.json), which understates the experts' cost against a trained, load-balanced router. Changes the outputs.
    Returns the number of MoE layers set; ValueError for another mode."""
    if mode not in ROUTING_SIMULATIONS:
        raise ValueError(f"routing simulation {mode!r}: choose one of {', '.join(ROUTING_SIMULATIONS)}")
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for i, layer in enumerate(layers):
        layer.routing_salt = i if mode == "uniform" else None
    return len(layers)
