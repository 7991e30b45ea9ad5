"""Gated activations: SiLU (SwiGLU) and SiTU, computed in fp32 and cast back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Activation:
    """A gated activation act(gate, up).

    kind: "silu" -> silu(gate) * up; "situ" -> [beta*tanh(gate/beta)*sigmoid(gate)] * [lin*tanh(up/lin)].
    """

    kind: str = "silu"
    beta: float = 4.0
    linear_beta: float = 25.0


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in fp32, cast to gate.dtype. gate, up: same shape."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def situ_and_mul(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU: soft-capped SiLU on the gate times a soft clip of the up branch (fp32 inside).

    The sigmoid takes the raw gate. gate, up: same shape; returns gate.dtype.
    """
    a, u = gate.float(), up.float()
    gate_branch = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    up_branch = linear_beta * torch.tanh(u / linear_beta)
    return (gate_branch * up_branch).to(gate.dtype)


def gated_activation(gate: Tensor, up: Tensor, act: Activation) -> Tensor:
    """Apply `act` to a (gate, up) pair of the same shape: fp32 inside, one rounding to gate.dtype. Pure."""
    if act.kind == "silu":
        return silu_and_mul(gate, up)
    if act.kind == "situ":
        return situ_and_mul(gate, up, act.beta, act.linear_beta)
    raise ValueError(f"unknown gated activation {act.kind!r}; supported: 'silu', 'situ'")


def gated_activation_merged(gate_up: Tensor, act: Activation) -> Tensor:
    """`act` of the merged projection gate_up [..., 2I] (gate = the first I columns, up = the last I), as a gated
    MLP's `gate_up_proj` returns it: `gated_activation(*gate_up.chunk(2, -1), act)` -> [..., I] in gate_up.dtype.
    Pure."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate ; up); got {gate_up.shape[-1]}")
    gate, up = gate_up.chunk(2, dim=-1)
    return gated_activation(gate, up, act)
