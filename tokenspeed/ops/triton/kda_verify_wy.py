"""KDA verify windows in the chunk (WY) form: an opt-in schedule of `ops.kda_decode` for update_state=False
(`KdaConfig(wy=True)`; not timed on the H200 yet).

The plain kernels walk a verify window token by token: each token's inputs, norms and two reductions over the
state tile wait on the previous token's update, so 4 tokens cost about 4 one-token latencies (benchmarks/README.md:
14.6 us at 32 heads x 1 against 8.6 for one token, 9% of HBM at 96 x 64). Here the window's tokens are processed
together, CT at a time, from the state S before them. With G the inclusive cumulative log decay within the chunk
(per key channel), Kg = k * exp(G), Qg = q * exp(G), Ki = k * exp(-G) (rows of the chunk):

    A  = strictly_lower(Kg Ki^T) * beta[:, None]     (token s's update seen by token t's prediction, s < t)
    Bm = lower(Qg Ki^T)                              (token s's update seen by token t's output, s <= t)
    U  = (I + A)^-1 (beta * (V - Kg S))              (the delta rule's per-token updates u_t)
    O  = Qg S + Bm U;     S_next = exp(G_last) * S + (k * exp(G_last - G))^T U

the same recurrence as token by token (S_t = diag(exp(g_t)) S_{t-1} + k_t u_t^T, o_t = S_t^T q_t) in another
summation order. The products are tl.dot over 16 padded rows: fp32 ieee for fp32 io (differences ~1e-6
relative), tf32 tensor cores for 16-bit io (~1e-3 relative on o, under a bf16 output's resolution: the pools are
not written, so no error carries over; the sm_90 build of the ieee form spills ~8 KB a thread, the tf32 one
0.3-1 KB at 255 registers).
(I + A)^-1 is (I - A)(I + A^2)(I + A^4)(I + A^8) (A is nilpotent: A^16 = 0).
exp(-G) is bounded only with K3's gate (g >= lower_bound per token): the launcher takes windows where
-lower_bound * CT <= 80 (fp32 exp stays normal), so the softplus gate keeps the token loop.

One program per (sequence, head), num_warps warps; the V axis in tiles of BV, each tile's state read once from the
pool (either layout, `V_FIRST`) and carried through the chunks in registers; the key-side work is redone per
tile (L1 hits). The outputs go to o, then the fused gated norm (`_norm_rows`) after a CTA barrier. The pools are
not written; a padding row (slot < 0) gets zeros. PDL: the slot and bounds are read before the wait (as
`kda_decode_kernel`), everything else after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.kda_decode_kernel import _gate, _norm_rows, _pdl_sync

CHUNK_ROWS = 16  # rows of the chunk matrices (tl.dot's minimum M); a chunk's CT <= CHUNK_ROWS tokens are the first
CM = tl.constexpr(CHUNK_ROWS)
MAX_DECAY = 80.0  # -lower_bound * CT must not exceed this (exp(-G) in fp32)


@triton.jit
def _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ch, m, OUT_TY: tl.constexpr):
    """SiLU of the width-4 conv of channels `ch` [C] at sequence positions `pos` [R] (rows), as `_conv_silu`
    computes one token: the same products summed in the same order, the same rounding. [R, C] fp32; rows / lanes
    outside `m` [R, C] read zeros."""
    y = _tap_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ch, m, 0)
    y += _tap_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ch, m, 1)
    y += _tap_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ch, m, 2)
    y += _tap_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ch, m, 3)
    return (y / (1.0 + tl.exp(-y))).to(OUT_TY).to(tl.float32)


@triton.jit
def _tap_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ch, m, J: tl.constexpr):
    """w[ch, J] * x at positions pos - 3 + J ([R, C] fp32): a new token's row, or (position < 0) a column of the
    old conv state (one load through a selected pointer; the same value as `_conv_input`'s sum of two)."""
    p = pos[:, None] + (J - 3)
    ptr = tl.where(p >= 0, QKV + (bos + tl.maximum(p, 0)) * stride_qkv + ch[None, :],
                   cs + ch[None, :] * stride_csc + (3 + tl.minimum(p, -1)) * stride_csw)
    x = tl.load(ptr, mask=m, other=0.0)
    w = tl.load(CW + ch * 4 + J)
    return w[None, :] * x.to(tl.float32)


@triton.jit
def _unit_lower_inverse(A, eye, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower [CM, CM] A (A^16 = 0): (I - A)(I + A^2)(I + A^4)(I + A^8)."""
    a2 = tl.dot(A, A, input_precision=PREC)
    a4 = tl.dot(a2, a2, input_precision=PREC)
    a8 = tl.dot(a4, a4, input_precision=PREC)
    inv = tl.dot(eye - A, eye + a2, input_precision=PREC)
    inv = tl.dot(inv, eye + a4, input_precision=PREC)
    return tl.dot(inv, eye + a8, input_precision=PREC)


@triton.jit
def _kda_verify_wy_kernel(
    QKV, stride_qkv,
    F, stride_ft, stride_fh,
    Bt, stride_bt, stride_bh,
    CW, CS, stride_css, stride_csc, stride_csw,
    A_log, DT,
    S, stride_ss,
    SLOTS, CU, O,
    G, stride_gt, stride_gh, NW,
    lower_bound, scale, norm_eps,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    CT: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    V_FIRST: tl.constexpr,
    PDL: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    OUT_TY = O.dtype.element_ty
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)
    bos = tl.load(CU + n).to(tl.int64)
    seq_len = tl.load(CU + n + 1).to(tl.int64) - bos
    _pdl_sync(PDL)

    ok = tl.arange(0, D)
    rows = tl.arange(0, CM)
    mk = (ok * 0 + 1) > 0
    cq = h * D + ok
    ck = H * D + cq
    cs = CS + slot * stride_css
    rate = tl.exp(tl.load(A_log + h).to(tl.float32))
    dtb = tl.load(DT + h * D + ok).to(tl.float32)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    strict = rows[:, None] > rows[None, :]
    for v0 in range(0, D, BV):
        ov = v0 + tl.arange(0, BV)
        mv = (ov * 0 + 1) > 0
        if V_FIRST:
            p_s = S + slot * stride_ss + h * D * D + ov[None, :] * D + ok[:, None]
        else:
            p_s = S + slot * stride_ss + h * D * D + ok[:, None] * D + ov[None, :]
        b_s = tl.load(p_s)  # [D, BV]; a padding row (slot < 0) reads slot 0 and stores zeros
        for c0 in range(0, seq_len, CT):
            live = rows < tl.minimum(seq_len - c0, CT)
            pos = c0 + rows
            mrk = live[:, None] & mk[None, :]
            yq = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, cq, mrk, OUT_TY)
            yk = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ck, mrk, OUT_TY)
            yv = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, 2 * H * D + h * D + ov,
                            live[:, None] & mv[None, :], OUT_TY)
            q = yq * tl.rsqrt(tl.sum(yq * yq, axis=1) + 1e-6)[:, None] * scale
            k = yk * tl.rsqrt(tl.sum(yk * yk, axis=1) + 1e-6)[:, None]
            t = bos + pos
            f = tl.load(F + t[:, None] * stride_ft + h * stride_fh + ok[None, :], mask=mrk, other=0.0)
            g = _gate(f.to(tl.float32) + dtb[None, :], rate, lower_bound, True)
            g = tl.where(mrk, g, 0.0)  # rows past the window: no decay, no update
            braw = tl.load(Bt + t * stride_bt + h * stride_bh, mask=live, other=0.0).to(tl.float32)
            beta = tl.where(live, 1.0 / (1.0 + tl.exp(-braw)), 0.0)
            # key-side tensors first, each [CM, D] dead as soon as its products are formed (register pressure)
            lg = tl.cumsum(g, axis=0)
            glast = tl.sum(g, axis=0)  # the chunk's total log decay per key channel (padding rows add 0)
            kt = k * tl.exp(glast[None, :] - lg)  # for the next chunk's state
            ki = k * tl.exp(-lg)
            kg = k * tl.exp(lg)
            qg = q * tl.exp(lg)
            a = tl.where(strict, tl.dot(kg, tl.trans(ki), input_precision=PREC), 0.0) * beta[:, None]
            bm = tl.where(strict | (rows[:, None] == rows[None, :]), tl.dot(qg, tl.trans(ki), input_precision=PREC),
                          0.0)
            r = beta[:, None] * (yv - tl.dot(kg, b_s, input_precision=PREC))
            u = tl.dot(_unit_lower_inverse(a, eye, PREC), r, input_precision=PREC)
            o = tl.dot(qg, b_s, input_precision=PREC) + tl.dot(bm, u, input_precision=PREC)
            o = tl.where((rows[:, None] * 0 + slot_raw) >= 0, o, 0.0)
            tl.store(O + (t[:, None] * H + h) * D + ov[None, :], o.to(OUT_TY), mask=live[:, None] & mv[None, :])
            b_s = tl.exp(glast)[:, None] * b_s + tl.dot(tl.trans(kt), u, input_precision=PREC)
    if NORM:
        tl.debug_barrier()  # every tile's o stores (all threads of this program) before the rows are read
        _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, mk, NORM_ROWS)


def wy_unsupported(D: int, block_v: int, tokens_per_seq: int, lower_bound: float | None, update_state: bool,
                   step_states: Tensor | None, seq_lens: Tensor | None) -> str | None:
    """None when the WY verify launch can run this call, else why not (the caller raises it)."""
    if update_state or step_states is not None or seq_lens is not None:
        return "KdaConfig(wy=True) is for verify windows (update_state=False, no step_states, no seq_lens)"
    if D & (D - 1) or not 16 <= D <= 128 or block_v < 16 or D % block_v:
        return f"KdaConfig(wy=True) needs a power-of-two head dim in 16..128 that block_v >= 16 divides; got {D}"
    if lower_bound is None or -lower_bound * chunk_tokens(tokens_per_seq, lower_bound) > MAX_DECAY:
        return "KdaConfig(wy=True) needs K3's bounded gate (lower_bound), small enough that exp(-G) stays finite"
    return None


def chunk_tokens(tokens_per_seq: int, lower_bound: float) -> int:
    """CT: tokens a chunk takes, a power of two >= the window (ceil(T / N)) while -lower_bound * CT <= MAX_DECAY,
    at most CHUNK_ROWS."""
    ct = 1
    while ct < min(tokens_per_seq, CHUNK_ROWS) and -lower_bound * ct * 2 <= MAX_DECAY:
        ct *= 2
    return ct


def launch_wy(qkv: Tensor, f3: Tensor, b: Tensor, cw: Tensor, conv_state: Tensor, A_log: Tensor, dt_bias: Tensor,
              state: Tensor, state_indices: Tensor, cu_seqlens: Tensor, out: Tensor, gate: Tensor,
              norm_weight: Tensor | None, *, lower_bound: float, scale: float, norm_eps: float, norm_rows: int,
              block_v: int, num_warps: int, tokens_per_seq: int, state_v_first: bool) -> None:
    """One launch over N * H programs (arguments as `kda_decode` checked them; `out` zero-filled by the caller
    for padding rows). Mutates only `out`."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    norm = norm_weight is not None
    _kda_verify_wy_kernel[(N * H,)](
        qkv, qkv.stride(0), f3, f3.stride(0), f3.stride(1), b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(), state, state.stride(0), state_indices, cu_seqlens, out,
        gate, gate.stride(0), gate.stride(1), norm_weight.contiguous() if norm else A_log,
        float(lower_bound), float(scale), float(norm_eps),
        H=H, D=D, BV=block_v, CT=chunk_tokens(tokens_per_seq, lower_bound), NORM=norm, NORM_ROWS=norm_rows,
        V_FIRST=bool(state_v_first), PDL=pdl.enabled(qkv.device, "kda"), num_warps=num_warps,
        PREC="ieee" if qkv.dtype == torch.float32 else "tf32",
        **pdl.launch_kwargs(qkv.device, "kda"),
    )

