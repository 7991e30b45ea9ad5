"""`PendingNorm`: a MoE layer's FFN junction held back for the one projection that reads it.

Vocabulary. The *junction* after a pre-norm layer's FFN is summed = residual + f (the new residual stream) and
normed = rms_norm(summed) (the next layer's input). For the hidden-space MoE on one rank, f is the combine of the
experts' per-pair buffer: f = cast(sum_j w_j * buf_j). A *pending* junction is that computation not yet run: the
buffer, the routing weights, the residual and the norm, plus the `summed` tensor (allocated now, written later)
that the layer returns as its residual stream. The next layer consumes it in one of two ways:

- `project(weight)`: normed @ weight^T with the combine, the add and the norm inside the projection's GEMV
  (`tokenspeed.ops.triton.gemv_junction`, one launch fewer at decode sizes); it also writes `summed`;
- `resolve()`: the normed tensor itself (`combine_add_rms_norm`, one launch; also writes `summed`), for any other
  consumer or a projection the fused kernel does not take.

`summed` is written by whichever runs first, before any later kernel in stream order reads it (CUDA-graph safe:
only device work, decided from shapes on the host). The object stands where the normed tensor would: `shape`,
`dtype`, `device` and `is_cuda` are the normed tensor's.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

JUNCTION_GEMV_ENV = "TOKENSPEED_MOE_JUNCTION_GEMV"  # "0": never fuse `project` (A/B timing); else the default
LOOKAHEAD_ENV = "TOKENSPEED_JUNCTION_LOOKAHEAD"  # "0" / "1": the kernel's LOOKAHEAD (A/B timing); default 1


class PendingNorm:
    """normed = rms_norm(residual + combine(buf, topk_weights), norm_weight, eps), not computed yet.

    buf [T * k, D] (the experts' per-pair outputs), topk_weights fp32 [T * k] contiguous, residual [T, D] (unit
    column stride), norm_weight [D]; summed [T, D] contiguous, residual.dtype: allocated here, written by the first
    `project` or `resolve`. Mutates nothing else."""

    __slots__ = ("buf", "topk_weights", "top_k", "residual", "norm_weight", "eps", "summed", "_normed")

    def __init__(self, buf: Tensor, topk_weights: Tensor, top_k: int, residual: Tensor, norm_weight: Tensor,
                 eps: float) -> None:
        self.buf, self.topk_weights, self.top_k = buf, topk_weights, top_k
        self.residual, self.norm_weight, self.eps = residual, norm_weight, eps
        self.summed = torch.empty_like(residual, memory_format=torch.contiguous_format)
        self._normed: Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.residual.dtype

    @property
    def device(self) -> torch.device:
        return self.residual.device

    @property
    def is_cuda(self) -> bool:
        return self.residual.is_cuda

    def resolve(self) -> Tensor:
        """The normed [T, D] tensor (computed on the first call, with `summed`; the same tensor afterwards)."""
        if self._normed is None:
            from tokenspeed.ops.triton.moe_combine import combine_add_rms_norm

            self._normed, _ = combine_add_rms_norm(self.buf, self.topk_weights, self.top_k, self.residual,
                                                   self.norm_weight, self.eps, summed=self.summed)
        return self._normed

    def fusable(self, weight: Tensor) -> bool:
        """Whether `project(weight)` runs the fused GEMV: not resolved yet, TOKENSPEED_MOE_JUNCTION_GEMV (read per
        call) not "0", and the kernel takes the tensors (`gemv_junction.unusable_reason`). Host-only."""
        if self._normed is not None or os.environ.get(JUNCTION_GEMV_ENV, "1").strip() == "0":
            return False
        from tokenspeed.ops.triton import gemv_junction

        return gemv_junction.unusable_reason(self.buf, self.topk_weights, self.top_k, self.residual,
                                             self.norm_weight, weight) is None

    def project(self, weight: Tensor) -> Tensor:
        """normed @ weight^T ([T, N], weight's dtype) for weight [N, D]: the fused GEMV where `fusable`, with the
        routing table's tiles for this shape (`gemv_junction.junction_config`); else `ops.linear(resolve(), w)`.
        The fused result equals the unfused one up to rounding (`tokenspeed.ops.triton.gemv_junction`)."""
        from tokenspeed import ops

        if not self.fusable(weight):
            return ops.linear(self.resolve(), weight)
        from tokenspeed.ops import dispatch
        from tokenspeed.ops.triton import gemv_junction

        T, D = self.residual.shape
        N = weight.shape[0]
        cfg = gemv_junction.junction_config(T, N, D, dispatch.linear_route(T, N, D, weight.dtype))
        lookahead = os.environ.get(LOOKAHEAD_ENV, "1").strip() != "0"
        return gemv_junction.junction_gemv(self.buf, self.topk_weights, self.top_k, self.residual,
                                           self.norm_weight, self.eps, weight, self.summed, lookahead=int(lookahead),
                                           **cfg)
