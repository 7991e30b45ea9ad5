"""Gated MLP (dense layer 0 and the shared experts): down(act(gate(x), up(x))), SiLU or SiTU."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.layers import Linear


def activation_of(config: KimiConfig) -> ops.Activation:
    return ops.Activation(config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)


class GatedMLP(nn.Module):
    """Column-parallel gate/up (merged as gate_up_proj), row-parallel down.

    reduce_output: all-reduce the row-parallel partial sum here (False when the caller fuses the reduction).
    """

    def __init__(
        self,
        config: KimiConfig,
        intermediate_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device=None,
        *,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.reduce_output = reduce_output
        self.act = activation_of(config)
        inter = parallel.shard(intermediate_size, "MLP intermediate size")
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, dtype, device, shard="out",
                                   sources=("gate_proj.weight", "up_proj.weight"))
        self.down_proj = Linear(inter, config.hidden_size, dtype, device, shard="in")

    def forward(self, x: Tensor) -> Tensor:
        """x: [T, hidden] -> [T, hidden] (a partial sum over ranks when reduce_output is False)."""
        y = self.down_proj(ops.gated_activation_merged(self.gate_up_proj(x), self.act))
        return self.parallel.all_reduce(y) if self.reduce_output else y
