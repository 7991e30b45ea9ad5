"""Expert weights of the routed-experts tests (the kernel tests each draw their own routings)."""

from __future__ import annotations

import torch

KIMI = {"E": 256, "k": 8, "D": 2304, "I": 1024}  # Kimi-Linear-48B routed experts


def make_weights(E: int, D: int, DI: int, dtype: torch.dtype, device, seed: int = 0):
    """w1, w3 [E, DI, D] and w2 [E, D, DI], scaled by 1/sqrt(fan-in)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w1 = (torch.randn(E, DI, D, generator=g) * D ** -0.5).to(device=device, dtype=dtype)
    w3 = (torch.randn(E, DI, D, generator=g) * D ** -0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, D, DI, generator=g) * DI ** -0.5).to(device=device, dtype=dtype)
    return w1, w3, w2
