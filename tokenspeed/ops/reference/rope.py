"""Rotary position embedding (interleaved pairs), with optional DeepSeek-style YaRN scaling.

K3's own MLA is NoPE; RoPE is here for MLA drafts (EAGLE3) whose configs carry `rope_theta` and a YaRN
`rope_scaling` dict: {"type"|"rope_type": "yarn", "factor", "original_max_position_embeddings",
"beta_fast" (32), "beta_slow" (1), "mscale" (1), "mscale_all_dim" (0)}.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN attention magnitude correction: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: Mapping[str, Any]) -> tuple[Tensor, float]:
    factor = float(scaling["factor"])
    orig = float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolated = 1.0 / theta**exponents
    interpolated = extrapolated / factor

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    keep_extrapolated = 1.0 - ramp.clamp(0.0, 1.0)
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    magnitude = yarn_mscale(factor, float(scaling.get("mscale", 1))) / yarn_mscale(
        factor, float(scaling.get("mscale_all_dim", 0))
    )
    return inv_freq, magnitude


def rope_cos_sin(
    positions: Tensor, dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin tables [T, dim // 2] fp32 for integer `positions` [T]."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        magnitude = 1.0
    elif kind == "yarn":
        inv_freq, magnitude = _yarn_inv_freq(dim, theta, scaling or {})
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, yarn")
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    return (angles.cos() * magnitude).float(), (angles.sin() * magnitude).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [T, H, dim] by the angles of [T, dim // 2]; x.dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)
