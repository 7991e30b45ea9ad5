"""The WY verify form in two launches (`KdaConfig(wy=True, keys_pass=True)`; `MULTI_TABLE`'s row from 96 pairs): a
key pass that writes each (sequence, head)'s window matrices, then a state pass over (V tile, sequence, head)
programs.

On the H200 the one-launch WY kernel (`kda_verify_wy.py`, one program per head) runs 4-token windows at 29% of HBM
at 96 heads x 64 sequences: before its first state tile a program spends several us on the window's key side
(conv loads, norms, the scan, the pair products and the layout conversions between them, each through shared
memory), so few state bytes are in flight per SM. Here the key side is its own launch, without state traffic:

- `_kda_verify_keys_kernel`, grid (N * H,): Qe [TW, D] and C [TW, TW] (`_window_form`) of the window into fp32
  scratch (rows past the window hold zeros);
- `_kda_verify_tiles_kernel`, grid (D / BV, N * H): the [D, BV] state tile (read before the PDL wait: only KDA
  launches of earlier steps write the pool), then o = Qe S + C V for its V slice, the rows of Qe read straight
  from the scratch in the layout the products want. The fused gated norm runs in the last program of the head
  to arrive (the per-(sequence, head) counter of the split kernel).

Needs every sequence within the window (the caller's `max_seq_tokens` <= MAX_WINDOW); pools are not written;
padding rows (slot < 0) store zeros. The scratch is 4 (TW D + TW^2) bytes per (sequence, head), about 3% of the
state bytes at TW 4 and D 128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.kda_decode_kernel import _norm_rows, _pdl_sync
from tokenspeed.ops.triton.kda_verify_wy import _conv_rows, _mm, _seq_row, _tile_ptrs, _window_form, window_rows


@triton.jit
def _kda_verify_keys_kernel(
    QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, CS, stride_css, stride_csc, stride_csw,
    A_log, DT, SLOTS, CU, O, QE, CM, lower_bound, scale,
    H: tl.constexpr, D: tl.constexpr, TW: tl.constexpr, HAS_LB: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    OUT_TY = O.dtype.element_ty  # the conv output's rounding (O itself is not written here)
    n = pid // H
    h = pid % H
    _, slot, bos, seq_len = _seq_row(SLOTS, CU, n)
    _pdl_sync(PDL)
    ok = tl.arange(0, D)
    rows = tl.arange(0, TW)
    cq = h * D + ok
    qe, c, _, _, _, _ = _window_form(QKV, stride_qkv, F + h * stride_fh, stride_ft, Bt + h * stride_bh, stride_bt, CW,
                                     CS + slot * stride_css, stride_csc, stride_csw,
                                     tl.load(DT + h * D + ok[None, :] + rows[:, None] * 0).to(tl.float32),
                                     tl.exp(tl.load(A_log + h).to(tl.float32)), lower_bound, scale, bos, rows,
                                     rows < seq_len, cq, H * D + cq, ok, TW, HAS_LB, OUT_TY)
    tl.store(QE + pid * TW * D + rows[:, None] * D + ok[None, :], qe)
    tl.store(CM + pid * TW * TW + rows[:, None] * TW + rows[None, :], c)


@triton.jit
def _kda_verify_tiles_kernel(
    QKV, stride_qkv, CW, CS, stride_css, stride_csc, stride_csw, S, stride_ss, SLOTS, CU, O, CNT, QE, CM,
    G, stride_gt, stride_gh, NW, norm_eps,
    H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, TW: tl.constexpr, NORM: tl.constexpr,
    NORM_ROWS: tl.constexpr, V_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    n = pid_nh // H
    h = pid_nh % H
    OUT_TY = O.dtype.element_ty
    slot_raw, slot, bos, seq_len = _seq_row(SLOTS, CU, n)
    ok = tl.arange(0, D)
    ov = pid_v * BV + tl.arange(0, BV)
    b_s = tl.load(_tile_ptrs(S, stride_ss, slot, h, ok, ov, D, V_FIRST))
    _pdl_sync(PDL)  # the key pass's scratch from here on

    rows = tl.arange(0, TW)
    live = rows < seq_len
    yv = _conv_rows(QKV, stride_qkv, CS + slot * stride_css, stride_csc, stride_csw, CW, bos, rows,
                    2 * H * D + h * D + ov, live[:, None] & ((ov * 0 + 1) > 0)[None, :], OUT_TY)
    o = _mm(tl.load(CM + pid_nh * TW * TW + rows[:, None] * TW + rows[None, :]), yv)
    for t in tl.static_range(TW):
        qt = tl.load(QE + (pid_nh * TW + t) * D + ok)
        o = tl.where(rows[:, None] == t, o + tl.sum(qt[:, None] * b_s, axis=0)[None, :], o)
    o = tl.where((rows[:, None] * 0 + slot_raw) >= 0, o, 0.0)
    tl.store(O + ((bos + rows) * H + h)[:, None] * D + ov[None, :], o.to(OUT_TY),
             mask=live[:, None] & ((ov * 0 + 1) > 0)[None, :])
    if NORM:
        last = True
        if NV > 1:  # the head's o row is spread over NV programs: the last to arrive norms it
            tl.debug_barrier()  # every warp's o stores before the release
            arrived = tl.atomic_add(CNT + pid_nh, 1, sem="acq_rel")
            tl.atomic_xchg(CNT + pid_nh, 0, mask=arrived == NV - 1)
            last = arrived == NV - 1
        if last:
            tl.debug_barrier()
            _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, (ok * 0 + 1) > 0,
                       NORM_ROWS)


def launch_keys_pass(qkv: Tensor, f3: Tensor, b: Tensor, cw: Tensor, conv_state: Tensor, A_log: Tensor,
                     dt_bias: Tensor, state: Tensor, state_indices: Tensor, cu_seqlens: Tensor, out: Tensor,
                     gate: Tensor, norm_weight: Tensor | None, counters: Tensor, *, lower_bound: float | None,
                     scale: float, norm_eps: float, norm_rows: int, block_v: int, num_warps: int,
                     max_seq_tokens: int, state_v_first: bool) -> None:
    """The two launches (arguments as `kda_decode` checked them; `counters`: zeroed int32 >= N * H when the norm
    is fused and block_v < D; every sequence has at most max_seq_tokens <= MAX_WINDOW tokens). Mutates `out` (the
    counters return to 0)."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    tw = window_rows(max_seq_tokens)
    qe = torch.empty(N * H, tw, D, dtype=torch.float32, device=qkv.device)
    cm = torch.empty(N * H, tw, tw, dtype=torch.float32, device=qkv.device)
    use_pdl = pdl.enabled(qkv.device, "kda")
    _kda_verify_keys_kernel[(N * H,)](
        qkv, qkv.stride(0), f3, f3.stride(0), f3.stride(1), b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), A_log, dt_bias.contiguous(),
        state_indices, cu_seqlens, out, qe, cm, float(lower_bound) if lower_bound is not None else 0.0, float(scale),
        H=H, D=D, TW=tw, HAS_LB=lower_bound is not None, PDL=use_pdl, num_warps=4,
        **pdl.launch_kwargs(qkv.device, "kda"),
    )
    norm = norm_weight is not None
    nv = D // block_v
    _kda_verify_tiles_kernel[(nv, N * H)](
        qkv, qkv.stride(0), cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        state, state.stride(0), state_indices, cu_seqlens, out, counters, qe, cm,
        gate, gate.stride(0), gate.stride(1), norm_weight.contiguous() if norm else A_log, float(norm_eps),
        H=H, D=D, BV=block_v, NV=nv, TW=tw, NORM=norm, NORM_ROWS=norm_rows, V_FIRST=bool(state_v_first),
        PDL=use_pdl, num_warps=num_warps, **pdl.launch_kwargs(qkv.device, "kda"),
    )

