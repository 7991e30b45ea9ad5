"""A step whose GPU work is queued but whose sampled tokens the host has not read yet (asynchronous scheduling).

The engine launches step N+1 before reading step N's tokens: N+1's decode rows feed N's tokens straight from the
device tensor `LaunchedStep.token_ids_device` (`feed_placeholders`), and the host reads N's tokens (one pinned
copy, one event) while N+1 runs. Everything is ordered on the one compute stream, so N+1's writes (KV rows, KDA
state, reused pages and slots) always follow N's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenspeed.core.request import PLACEHOLDER
from tokenspeed.ops.h2d import device_longs


@dataclass
class LaunchedStep:
    """The sampled tokens of a queued step, per sampling request, in batch order."""

    request_ids: list[str]  # the requests that sample in this step, in batch order
    token_ids_device: Tensor  # [len(request_ids)] int64 on the device: the sampled token of each
    num_tokens: int  # tokens in the step's forward
    _host: Tensor | None = None  # pinned copy of token_ids_device (CUDA), filled when the step completes
    _event: torch.cuda.Event | None = None

    @classmethod
    def start(cls, request_ids: list[str], token_ids: Tensor, num_tokens: int) -> LaunchedStep:
        """Queue the device -> host copy of `token_ids` behind the step's kernels; returns immediately."""
        step = cls(request_ids, token_ids, num_tokens)
        if token_ids.is_cuda:
            step._host = torch.empty(token_ids.shape, dtype=torch.long, pin_memory=True)
            step._host.copy_(token_ids, non_blocking=True)
            step._event = torch.cuda.Event()
            step._event.record()
        return step

    def token_ids(self) -> list[int]:
        """The sampled tokens (waits for the step to finish on the device)."""
        if self._event is None:
            return self.token_ids_device.tolist()
        self._event.synchronize()
        assert self._host is not None
        return self._host.tolist()

    def index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.request_ids)}


def feed_placeholders(input_ids: Tensor, cu_seqlens: Sequence[int], new_tokens: Sequence[Sequence[int]],
                      request_ids: Sequence[str], prev: LaunchedStep | None) -> None:
    """Write into `input_ids` (the forward's device token ids, mutated) the device value of every PLACEHOLDER
    token: a request's last fed token, sampled by `prev`. Raises RuntimeError for a placeholder `prev` did not
    sample (an engine bug: at most one step is in flight)."""
    dst: list[int] = []
    src: list[int] = []
    index = None
    for i, toks in enumerate(new_tokens):
        if not toks or toks[-1] != PLACEHOLDER:
            continue
        if index is None:
            index = prev.index() if prev is not None else {}
        j = index.get(request_ids[i])
        if j is None or PLACEHOLDER in toks[:-1]:
            raise RuntimeError(f"request {request_ids[i]} feeds a token no step in flight sampled")
        dst.append(cu_seqlens[i + 1] - 1)
        src.append(j)
    if dst:
        assert prev is not None
        dev = input_ids.device
        input_ids.index_copy_(0, device_longs(dst, dev), prev.token_ids_device.index_select(0, device_longs(src, dev)))
