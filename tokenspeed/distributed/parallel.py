"""The parallel context a layer takes its shard from (tensor parallelism over one process group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tokenspeed.errors import ConfigError


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the tensor-parallel group. World size 1 makes every collective a no-op."""

    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None  # torch.distributed ProcessGroup when tp_size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} must be in [0, tp_size={self.tp_size})")

    def shard(self, n: int, what: str) -> int:
        """n // tp_size; raises ConfigError when `what` (e.g. 'KDA heads') does not divide evenly."""
        if n % self.tp_size:
            raise ConfigError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.tp_size}")
        return n // self.tp_size

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum x over the group in place (identity at world size 1). Returns x."""
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x
