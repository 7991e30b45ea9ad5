"""RMSNorm variants, written for clarity (fp32 statistics)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, rounded as the reference model does.

    y = weight * cast(x_f32 / sqrt(mean(x_f32^2) + eps), x.dtype); the gain multiplies after the downcast.
    x: [..., D] any float dtype; weight: [D]. Returns x.dtype, same shape. Pure (no mutation).
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A pre-norm residual junction: summed = residual + x (torch's `+`: one rounding to the common dtype), then
    normed = rms_norm(summed, weight, eps) of the rounded sum (the rounding of `rms_norm`).

    x, residual: [..., D] of one shape; weight: [D]. Returns (normed, summed), both new tensors; nothing is mutated
    (summed is the residual stream the next junction adds to).
    """
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * sigmoid(gate), all in fp32 (KDA output norm, FLA `FusedRMSNormGated`).

    x, gate: [..., D]; weight: [D] shared across leading dims (e.g. heads). Returns x.dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)
