"""Chunked KDA prefill on CUDA through fla-core's `chunk_kda` (varlen, from and into a state pool).

Same contract as `tokenspeed.ops.kda_scan` with form="chunk": q, k [T, H, K] L2-normalised, v [T, H, V],
g [T, H, K] fp32 log decay, beta [T, H] fp32; rows `state_indices` of the fp32 pool `state` [S, H, K, V] are read
as initial states and overwritten with the final ones. q/k/v run in v.dtype inside fla (fp32 state and gates).
"""

from __future__ import annotations

import torch
from torch import Tensor


def available() -> bool:
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def kda_chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float, state: Tensor,
                   state_indices: Tensor, cu_seqlens: Tensor) -> Tensor:
    from fla.ops.kda import chunk_kda

    dt = v.dtype
    o, final = chunk_kda(
        q.to(dt).unsqueeze(0), k.to(dt).unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0),
        beta.float().unsqueeze(0), scale=scale, initial_state=state[state_indices].contiguous(),
        output_final_state=True, cu_seqlens=cu_seqlens.to(torch.int64),
    )
    state[state_indices] = final.float()
    return o.squeeze(0)
