"""Small host -> device copies that do not synchronise the host with the device.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of pageable memory) waits for the stream to drain,
which would stall asynchronous scheduling behind the step in flight; these go through pinned memory with a
non-blocking copy instead (the caching host allocator keeps the pinned block until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(values: Sequence[int] | Sequence[float] | Tensor, dtype: torch.dtype, device: torch.device | str
              ) -> Tensor:
    """`values` (a host list or CPU tensor) as a `dtype` tensor on `device`, without a host synchronisation on
    CUDA (pinned, non-blocking); a plain copy elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return (values.to(dtype) if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)).to(device)
    if isinstance(values, Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def device_longs(values: Sequence[int], device: torch.device | str) -> Tensor:
    """int64 [len(values)] on `device` (see `to_device`)."""
    return to_device(values, torch.long, device)
