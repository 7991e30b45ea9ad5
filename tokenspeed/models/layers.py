"""Small building blocks shared by the model modules: parameters that know their checkpoint source and shard.

A parameter created by `weight()` carries loader metadata as attributes:
  hf_sources: checkpoint names relative to the owning module (default: its own name), concatenated on dim 0;
              hf_scope_up > 0 makes them relative to that many modules above (a Linear names its siblings)
  hf_stack:   stack the sources on a new dim 0 instead (routed experts)
  hf_transform: applied to each source tensor before sharding (e.g. A_log's three stored shapes)
  hf_untransform: its inverse, giving the stored layout back (used when writing a checkpoint)
  tp_shard_dim: the dim of each source tensor split across tensor-parallel ranks (None: replicated)
Dtype policy: parameters are created in the model dtype except the fp32 islands, which are created fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from tokenspeed import ops


def weight(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    *,
    sources: Sequence[str] | None = None,
    shard_dim: int | None = None,
    stack: bool = False,
    transform: Callable[[Tensor], Tensor] | None = None,
    untransform: Callable[[Tensor], Tensor] | None = None,
    sources_scope_up: int = 0,
) -> nn.Parameter:
    """An uninitialised, frozen parameter with loader metadata (see module docstring)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.hf_sources = tuple(sources) if sources else None  # type: ignore[attr-defined]
    p.hf_scope_up = sources_scope_up  # type: ignore[attr-defined]
    p.hf_stack = stack  # type: ignore[attr-defined]
    p.hf_transform = transform  # type: ignore[attr-defined]
    p.hf_untransform = untransform  # type: ignore[attr-defined]
    p.tp_shard_dim = shard_dim  # type: ignore[attr-defined]
    return p


class Linear(nn.Module):
    """y = x W^T (no bias). shard: None (replicated), "out" (column-parallel), "in" (row-parallel).

    A row-parallel layer's output is a partial sum; the caller all-reduces it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        shard: str | None = None,
        sources: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        shard_dim = {None: None, "out": 0, "in": 1}[shard]
        self.weight = weight((out_features, in_features), dtype, device, sources=sources, shard_dim=shard_dim,
                             sources_scope_up=1)

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight)  # F.linear, or the Triton GEMV where the routing table picks it


class RMSNorm(nn.Module):
    """RMSNorm with a [dim] gain (see `ops.rms_norm` for the rounding)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight((dim,), dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
