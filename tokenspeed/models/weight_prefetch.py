"""Side-stream L2 prefetch of the weights a small decode step reads next.

At batch 1-16 a decoder layer alternates weight streams that run at HBM speed (the input projection, the routed
experts) with latency-bound kernels during which HBM idles: the KDA recurrence, MLA attention, the MoE router.
The weights read right after those kernels (the attention's o_proj, the router, a folded shared expert) are known
before the layer runs. `fork` launches an L2 prefetch of them (`ops.triton.l2_prefetch`) on a side stream that
starts after everything the current stream has issued so far, so the prefetch overlaps the latency-bound kernels
that follow on the main stream, and the projections then read L2 instead of HBM. `join` makes the current stream
wait for the side stream (the model calls it at the end of its forward, so a CUDA-graph capture's streams are
rejoined before the capture ends).

Nothing here changes a result: a prefetch writes nothing. Off by default until the H200 A/B says otherwise;
`TOKENSPEED_L2_SIDE_PREFETCH=1` turns it on (read on every call, so a benchmark can flip it between captures).
Only batches of at most MAX_TOKENS rows prefetch (larger steps are not latency-bound), at most BUDGET_BYTES a
fork (well under the H200's 50 MB L2, so lines are not evicted before they are read).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from tokenspeed.ops.triton.l2_prefetch import l2_prefetch, prefetchable

ENV = "TOKENSPEED_L2_SIDE_PREFETCH"
MAX_TOKENS = 16
BUDGET_BYTES = 40 << 20


def enabled() -> bool:
    """TOKENSPEED_L2_SIDE_PREFETCH == "1" (default off). Raises ValueError on a value other than 0 / 1."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1; got {value!r}")
    return value == "1"


class SideStreamPrefetch:
    """One side stream per device; `fork` / `join` as in the module docstring."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._forked: set[int] = set()

    def fork(self, tensors: Sequence[Tensor], num_tokens: int) -> int:
        """Prefetch `tensors` (in order, until BUDGET_BYTES) on the side stream of their device, after the work
        issued so far on its current stream, when `enabled()` and num_tokens <= MAX_TOKENS. Returns the bytes
        requested (0: nothing launched). Mutates nothing but the streams' dependencies."""
        targets = [t for t in tensors if prefetchable(t)]
        if not targets or num_tokens > MAX_TOKENS or not enabled():
            return 0
        device = targets[0].device
        idx = device.index if device.index is not None else torch.cuda.current_device()
        side = self._streams.get(idx)
        if side is None:
            side = self._streams[idx] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        issued = 0
        with torch.cuda.stream(side):
            for t in targets:
                if issued + t.numel() * t.element_size() > BUDGET_BYTES:
                    break
                issued += l2_prefetch(t)
        self._forked.add(idx)
        return issued

    def join(self) -> None:
        """Make each device's current stream wait for its side stream's prefetches (no-op when none forked)."""
        for idx in self._forked:
            torch.cuda.current_stream(idx).wait_stream(self._streams[idx])
        self._forked.clear()


PREFETCH = SideStreamPrefetch()
