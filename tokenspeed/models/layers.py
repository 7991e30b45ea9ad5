"""Small building blocks shared by the model modules: parameters that know their checkpoint source and shard.

A parameter created by `weight()` carries loader metadata as attributes:
  hf_sources: checkpoint names relative to the owning module (default: its own name), concatenated on dim 0;
              hf_scope_up > 0 makes them relative to that many modules above (a Linear names its siblings)
  hf_stack:   stack the sources on a new dim 0 instead (routed experts, `StackedLinear`)
  hf_split_sizes: the dim-0 rows of each source's piece in the parameter (this rank's), when the concatenated
              pieces differ in size (`MergedLinear`); None: equal pieces. The loader checks each piece against
              it; checkpoint writing splits the parameter back by it
  hf_transform: applied to each source tensor before sharding (e.g. A_log's three stored shapes)
  hf_untransform: its inverse, giving the stored layout back (used when writing a checkpoint)
  tp_shard_dim: the dim of each source tensor split across tensor-parallel ranks (None: replicated), or a tuple
              with one such entry per source (a merged projection of column-parallel and replicated parts);
              `source_shard_dim` reads it for one source
Dtype policy: parameters are created in the model dtype except the fp32 islands, which are created fp32.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from tokenspeed import ops

ShardDim = int | None | tuple[int | None, ...]


def weight(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    *,
    sources: Sequence[str] | None = None,
    shard_dim: ShardDim = None,
    split_sizes: Sequence[int] | None = None,
    stack: bool = False,
    transform: Callable[[Tensor], Tensor] | None = None,
    untransform: Callable[[Tensor], Tensor] | None = None,
    sources_scope_up: int = 0,
) -> nn.Parameter:
    """An uninitialised, frozen parameter with loader metadata (see module docstring). Raises ValueError when a
    per-source `shard_dim` tuple or `split_sizes` does not have one entry per source, or `split_sizes` does not
    sum to shape[0]."""
    n = len(sources) if sources else 1
    if isinstance(shard_dim, tuple) and len(shard_dim) != n:
        raise ValueError(f"shard_dim has {len(shard_dim)} entries for {n} sources")
    if split_sizes is not None and (len(split_sizes) != n or sum(split_sizes) != shape[0] or stack):
        raise ValueError(f"split_sizes {tuple(split_sizes)} must give dim 0 ({shape[0]}) of each of {n} "
                         "concatenated sources")
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.hf_sources = tuple(sources) if sources else None  # type: ignore[attr-defined]
    p.hf_scope_up = sources_scope_up  # type: ignore[attr-defined]
    p.hf_stack = stack  # type: ignore[attr-defined]
    p.hf_split_sizes = tuple(split_sizes) if split_sizes is not None else None  # type: ignore[attr-defined]
    p.hf_transform = transform  # type: ignore[attr-defined]
    p.hf_untransform = untransform  # type: ignore[attr-defined]
    p.tp_shard_dim = shard_dim  # type: ignore[attr-defined]
    return p


def source_shard_dim(p: nn.Parameter, index: int) -> int | None:
    """The tensor-parallel shard dim of source `index` of parameter `p` (None: replicated)."""
    dim = getattr(p, "tp_shard_dim", None)
    return dim[index] if isinstance(dim, tuple) else dim


_SHARD_DIMS = {None: None, "out": 0, "in": 1}


class Linear(nn.Module):
    """y = x W^T (no bias). shard: None (replicated), "out" (column-parallel), "in" (row-parallel), or a tuple
    with one of those per source (the sources concatenated on dim 0; `split_sizes` their rows when unequal).

    A row-parallel layer's output is a partial sum; the caller all-reduces it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        shard: str | None | tuple[str | None, ...] = None,
        sources: Sequence[str] | None = None,
        split_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        shard_dim = tuple(_SHARD_DIMS[s] for s in shard) if isinstance(shard, tuple) else _SHARD_DIMS[shard]
        self.weight = weight((out_features, in_features), dtype, device, sources=sources, shard_dim=shard_dim,
                             split_sizes=split_sizes, sources_scope_up=1)

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight)  # F.linear, or the Triton GEMV where the routing table picks it


class Part(NamedTuple):
    """One checkpoint projection inside a `MergedLinear`: `name` (its checkpoint weight is `{name}.weight`, a
    sibling of the merged module), its rows in this rank's weight, and whether those rows are this rank's shard of
    the stored rows (column-parallel) or all of them (replicated)."""

    name: str
    rows: int
    sharded: bool


class MergedLinear(Linear):
    """Several projections of the same input as one GEMM: the weight is the parts' weights concatenated on dim 0
    in order (each part column-parallel or replicated on its own), y = x W^T is [..., sum(rows)], and `part(y,
    name)` is one part's columns, a view (row stride = the merged width; no copy)."""

    def __init__(self, in_features: int, parts: Sequence[Part], dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        parts = tuple(parts)
        super().__init__(in_features, sum(p.rows for p in parts), dtype, device,
                         shard=tuple("out" if p.sharded else None for p in parts),
                         sources=[f"{p.name}.weight" for p in parts], split_sizes=[p.rows for p in parts])
        ends = list(itertools.accumulate(p.rows for p in parts))
        self.slices = {p.name: slice(end - p.rows, end) for p, end in zip(parts, ends, strict=True)}

    def part(self, y: Tensor, first: str, last: str | None = None) -> Tensor:
        """The columns of part `first` (through part `last`, inclusive, when given: adjacent parts as one span) of
        an output y [..., merged width]: a view of y. Raises ValueError when `last` comes before `first`."""
        start, stop = self.slices[first].start, self.slices[last or first].stop
        if stop <= start:
            raise ValueError(f"part {last!r} comes before {first!r}")
        return y[..., start:stop]

    def part_weight(self, name: str) -> Tensor:
        """Part `name`'s rows of the merged weight [rows, in_features]: a view."""
        return self.weight[self.slices[name]]


class StackedLinear(nn.Module):
    """G independent projections of G adjacent column groups of one input, as one batched GEMM (`ops.stacked_linear`):
    x [T, G * in_features] (any row stride, unit column stride; e.g. a `MergedLinear.part` view) ->
    y [G, T, out_features] contiguous, y[g] = x[:, g * in : (g + 1) * in] @ W[g]^T: the products and sums of G
    separate projections (no padding, no cross-group terms; the summation order is the GEMM library's). The
    weight [G, out, in] stacks one checkpoint source per group (`sources`, siblings of this module), each sharded
    by `shard` ("out" or None) alike."""

    def __init__(self, in_features: int, out_features: int, sources: Sequence[str], dtype: torch.dtype,
                 device: torch.device | str | None = None, *, shard: str | None = None) -> None:
        super().__init__()
        if shard not in (None, "out"):
            raise ValueError(f"StackedLinear shards its outputs or nothing; got shard={shard!r}")
        self.weight = weight((len(sources), out_features, in_features), dtype, device, sources=sources,
                             stack=True, shard_dim=_SHARD_DIMS[shard], sources_scope_up=1)

    def forward(self, x: Tensor) -> Tensor:
        return ops.stacked_linear(x, self.weight)  # torch.bmm, or one PDL launch at decode sizes


class RMSNorm(nn.Module):
    """RMSNorm with a [dim] gain (see `ops.rms_norm` for the rounding)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight((dim,), dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
