"""Chunked KDA prefill on CUDA through fla-core's `chunk_kda` (varlen, from and into a state pool).

`kda_chunk_scan`: the contract of `tokenspeed.ops.kda_scan` with form="chunk": q, k [T, H, K] L2-normalised,
v [T, H, V], g [T, H, K] fp32 log decay, beta [T, H] fp32; rows `state_indices` of the fp32 pool `state`
[S, H, K, V] are read as initial states and overwritten with the final ones. q/k/v run in v.dtype inside fla (fp32
state and gates).

`kda_chunk_fused`: the contract of `tokenspeed.ops.kda_prefill`: the same scan from raw inputs: q / k L2-normalised by
`triton.norm.l2_normalize` (fla's own l2norm autotunes per cdiv(T * H, 65536), so each new prefill size compiled 25
variants mid-serve: two stalls of 7.7 and 8.4 s in an H200 swe-smith run at concurrency 16), then fla doing the
gate (K3's bounded `lambda * sigmoid(exp(A) (f + dt_bias))` through fla's `safe_gate`, or
Kimi-Linear's `-exp(A) softplus(f + dt_bias)`) and the beta sigmoid inside its kernels, so none of the [T, H, K]
fp32 intermediates of the composed path is written to memory. The host copy of cu_seqlens spares fla its
device-to-host read of the lengths.

fla memoises its chunk index table (`prepare_chunk_indices`) by the identity of its arguments, and builds it with a
blocking host-to-device copy, which drains the stream. `_host_offsets` hands every layer of one forward the same
CPU tensor, so only the first KDA layer of a forward pays that synchronisation: with a fresh tensor per call, all
20 layers of Kimi-Linear did, each time idling the GPU while the host issued fla's kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.triton.norm import l2_normalize


def available() -> bool:
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


_last_offsets: tuple[Tensor, list[int], Tensor] | None = None


def _host_offsets(cu_seqlens: Tensor, cu_seqlens_host: list[int]) -> Tensor:
    """A CPU int64 tensor of `cu_seqlens_host`, the same object for repeated calls with the same device tensor and
    values (one forward's layers), so fla's identity-keyed caches hit."""
    global _last_offsets
    last = _last_offsets
    if last is not None and last[0] is cu_seqlens and last[1] == cu_seqlens_host:
        return last[2]
    host = torch.tensor(cu_seqlens_host, dtype=torch.int64)
    _last_offsets = (cu_seqlens, list(cu_seqlens_host), host)
    return host


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


def kda_chunk_fused(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                    lower_bound: float | None, *, scale: float, state: Tensor, state_indices: Tensor,
                    cu_seqlens: Tensor, cu_seqlens_host: list[int]) -> Tensor:
    from fla.ops.kda import chunk_kda

    dt = v.dtype
    bounded = lower_bound is not None
    o, final = chunk_kda(
        l2_normalize(q.to(dt)).unsqueeze(0), l2_normalize(k.to(dt)).unsqueeze(0), v.unsqueeze(0), f.unsqueeze(0),
        b.unsqueeze(0), scale=scale, initial_state=state[state_indices].contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        safe_gate=bounded, lower_bound=lower_bound, A_log=A_log.float().contiguous(),
        dt_bias=dt_bias.float().reshape(-1).contiguous(),
        cu_seqlens=cu_seqlens.to(torch.int64), cu_seqlens_cpu=_host_offsets(cu_seqlens, cu_seqlens_host),
    )
    state[state_indices] = final.float()
    return o.squeeze(0)
