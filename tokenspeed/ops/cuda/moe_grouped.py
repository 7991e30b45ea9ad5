"""Routed experts for prefill-sized calls through PyTorch's grouped GEMM (`torch._grouped_mm`, CUTLASS on sm90).

Same contract as `tokenspeed.ops.reference.moe.moe_experts`. The pairs (token, slot) are sorted by expert, the
tokens gathered into one [P, D] matrix, and each projection is one grouped GEMM over the experts' contiguous row
runs (`offs` = the runs' ends, a device tensor: no host synchronisation). Ids outside [0, E) are sorted to the end
and never multiplied (their runs lie past offs[-1]); their rows are zeroed before the combine.

Per call: three grouped GEMMs (gate, up, down: 6 * P * D * I FLOPs), the gathered x (P * D), the intermediate (3 * P * I
written and read) and the [P, D] expert outputs, all in x.dtype, plus the fp32 combine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.reference.activation import Activation, gated_activation


def available() -> bool:
    """True when this torch has the grouped GEMM."""
    return hasattr(torch, "_grouped_mm")


def moe_experts(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                act: Activation) -> Tensor:
    """x [T, D]; w1, w3 [E, I, D]; w2 [E, D, I]; topk_weights [T, k] (any float); topk_ids [T, k]. Returns [T, D].

    Each expert output is rounded to x.dtype and combined in fp32, as in the reference. Nothing is mutated.
    """
    T, D = x.shape
    E = w1.shape[0]
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, E)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    offs = counts.cumsum(0).to(torch.int32)
    xs = x.index_select(0, order // k)
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs)
    h = gated_activation(gate, up, act)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    keep = valid.index_select(0, order).unsqueeze(1)
    w = topk_weights.reshape(-1).float().index_select(0, order).unsqueeze(1)
    out = torch.empty(T * k, D, dtype=torch.float32, device=x.device)
    out.index_copy_(0, order, torch.where(keep, y.float() * w, 0.0))
    return out.view(T, k, D).sum(1).to(x.dtype)
