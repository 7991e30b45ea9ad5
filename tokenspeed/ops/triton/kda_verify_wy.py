"""KDA verify windows in the chunk form, one program per (V tile, sequence, head): `KdaConfig(wy=True)`, an
opt-in schedule of `ops.kda_decode` for update_state=False.

The plain split loop walks a window token by token: each token's two reductions over the state tile wait on the
previous token's update, so a 4-token window costs about 4 one-token latencies and the H200 runs it at 9-13% of
HBM (benchmarks/README.md). Here every product with the state S (the tile before the window) is independent of the
other tokens. With d_t = exp(G_t), G_t the inclusive cumulative log decay of the window (per key channel):

    S'_t   = diag(d_t) S + sum_{i<t} diag(d_t / d_i) k_i u_i^T          (the tile after token t's decay)
    u_t    = beta_t (v_t - (k_t * d_t)^T S - sum_{i<t} A[t, i] u_i),    A[t, i] = k_t^T diag(d_t / d_i) k_i
    o_t    = (q_t * d_t)^T S + sum_{i<=t} B[t, i] u_i,                  B[t, i] = q_t^T diag(d_t / d_i) k_i

the same recurrence as token by token (S_t = S'_t + k_t u_t^T, o_t = S_t^T q_t) in another summation order. So
the 2 TW reductions over the tile are independent (they overlap), and what stays sequential is the forward
substitution for u over TW vectors of BV. d_t / d_i = exp(G_t - G_i) <= 1 for i <= t: no exp(-G) as in the
textbook WY form, so any gate (K3's bounded one and the softplus one) is safe. fp32 throughout (differences to
the token loop ~1e-6 relative).

Tokens go TW at a time (a power of two <= 8, >= the window); a longer sequence carries the tile to its next
chunk: S = diag(d_last) S + sum_t (k_t * d_last / d_t) u_t^T. Padding rows (slot < 0) store zeros. Pools are not
written. The fused gated norm (`_norm_rows`) runs in the last program of the head to finish (the per-(sequence,
head) counter, as the split kernel's). PDL: the slot, bounds and state tile are read before the wait.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.kda_decode_kernel import _conv_silu, _gate, _norm_rows, _pdl_sync

MAX_WINDOW = 8  # TW cap: the [TW, TW, D] pair tensors stay in registers


@triton.jit
def _token_keys(QKV, stride_qkv, F, stride_ft, Bt, stride_bt, CW, cs, stride_csc, stride_csw, dtb, rate, lower_bound,
                scale, bos, i, ok, cq, ck, live, HAS_LB: tl.constexpr, OUT_TY: tl.constexpr):
    """Token i's q (scaled), k and log decay g [D] and beta, as `_token_inputs` computes them; a token past the
    sequence (`live` [D] False) gives q = k = g = 0 and beta = 0. F and Bt point at this head's columns."""
    t = bos + i
    yq = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cq, live, live, True, OUT_TY)
    yk = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, ck, live, live, True, OUT_TY)
    q = yq * tl.rsqrt(tl.sum(yq * yq, axis=0) + 1e-6) * scale
    k = yk * tl.rsqrt(tl.sum(yk * yk, axis=0) + 1e-6)
    f = tl.load(F + t * stride_ft + ok, mask=live, other=0.0).to(tl.float32)
    g = tl.where(live, _gate(f + dtb, rate, lower_bound, HAS_LB), 0.0)  # past the sequence: no decay
    braw = tl.load(Bt + t * stride_bt + ok * 0, mask=live, other=0.0).to(tl.float32)
    beta = tl.max(tl.where(live, 1.0 / (1.0 + tl.exp(-braw)), 0.0), axis=0)
    return q, k, g, beta


@triton.jit
def _kda_verify_wy_kernel(
    QKV, stride_qkv,
    F, stride_ft, stride_fh,
    Bt, stride_bt, stride_bh,
    CW, CS, stride_css, stride_csc, stride_csw,
    A_log, DT,
    S, stride_ss,
    SLOTS, CU, O, CNT,
    G, stride_gt, stride_gh, NW,
    lower_bound, scale, norm_eps,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    TW: tl.constexpr,
    HAS_LB: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    V_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    n = pid_nh // H
    h = pid_nh % H
    OUT_TY = O.dtype.element_ty
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)
    bos = tl.load(CU + n).to(tl.int64)
    seq_len = tl.load(CU + n + 1).to(tl.int64) - bos
    ok = tl.arange(0, D)
    ov = pid_v * BV + tl.arange(0, BV)
    if V_FIRST:
        s_off = ov[None, :] * D + ok[:, None]
    else:
        s_off = ok[:, None] * D + ov[None, :]
    b_s = tl.load(S + slot * stride_ss + h * D * D + s_off)  # [D, BV]; a padding row reads slot 0, stores zeros
    _pdl_sync(PDL)

    real = (ov * 0 + slot_raw) >= 0
    cq = h * D + ok
    ck = H * D + cq
    cv = 2 * H * D + h * D + ov
    cs = CS + slot * stride_css
    rate = tl.exp(tl.load(A_log + h).to(tl.float32))
    dtb = tl.load(DT + h * D + ok).to(tl.float32)
    cols = tl.arange(0, TW)
    for c0 in range(0, seq_len, TW):
        km = tl.zeros([D, TW], dtype=tl.float32)  # column j: k of the chunk's token j (0 until it is reached)
        gm = tl.zeros([D, TW], dtype=tl.float32)  # column j: its cumulative log decay G_j
        u = tl.zeros([TW, BV], dtype=tl.float32)  # row j: its update u_j
        lg = tl.zeros([D], dtype=tl.float32)
        for r in tl.static_range(TW):  # v of the window staged in o (its io-dtype rounding): a compact conv layout
            yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, c0 + r, cv,
                            (ov * 0 + c0 + r) < seq_len, ov < D, True, OUT_TY)
            tl.store(O + ((bos + c0 + r) * H + h) * D + ov, yv.to(OUT_TY), mask=(ov * 0 + c0 + r) < seq_len)
        tl.debug_barrier()  # visible to the threads that read it back
        for j in range(tl.minimum(seq_len - c0, TW)):  # a runtime trip count: not unrolled (registers)
            i = c0 + j
            live = (ok * 0 + i) < seq_len
            q, k, g, beta = _token_keys(QKV, stride_qkv, F + h * stride_fh, stride_ft, Bt + h * stride_bh,
                                        stride_bt, CW, cs, stride_csc, stride_csw, dtb, rate, lower_bound, scale, bos,
                                        i, ok, cq, ck, live, HAS_LB, OUT_TY)
            yv = tl.load(O + ((bos + i) * H + h) * D + ov).to(tl.float32)
            lg += g
            d = tl.exp(lg)
            pred = tl.sum((k * d)[:, None] * b_s, axis=0)  # the state products: no dependence on other tokens
            o = tl.sum((q * d)[:, None] * b_s, axis=0)
            km = tl.where(cols[None, :] == j, k[:, None], km)
            gm = tl.where(cols[None, :] == j, lg[:, None], gm)
            w = tl.exp(tl.minimum(lg[:, None] - gm, 0.0)) * km  # diag(d_j / d_i) k_i (0 for i > j)
            a = tl.sum(k[:, None] * w, axis=0)  # A[j, i] (i = j meets u_j = 0 below)
            bm = tl.sum(q[:, None] * w, axis=0)  # B[j, i], i <= j
            uj = beta * (yv - pred - tl.sum(a[:, None] * u, axis=0))
            u = tl.where(cols[:, None] == j, uj[None, :], u)
            o = tl.where(real, o + tl.sum(bm[:, None] * u, axis=0), 0.0)
            tl.store(O + ((bos + i) * H + h) * D + ov, o.to(OUT_TY))
        if c0 + TW < seq_len:  # carry the tile to the next chunk: every token of this one is live
            b_s = tl.exp(lg)[:, None] * b_s
            for r in tl.static_range(TW):
                kt = tl.sum(tl.where(cols[None, :] == r, tl.exp(lg[:, None] - gm) * km, 0.0), axis=1)
                b_s += kt[:, None] * tl.sum(tl.where(cols[:, None] == r, u, 0.0), axis=0)[None, :]
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


def wy_unsupported(D: int, block_v: int, update_state: bool, step_states: Tensor | None,
                   seq_lens: Tensor | None) -> str | None:
    """None when the WY verify launch can run this call, else why not (the caller raises it)."""
    if update_state or step_states is not None or seq_lens is not None:
        return "KdaConfig(wy=True) is for verify windows (update_state=False, no step_states, no seq_lens)"
    if D & (D - 1) or not 16 <= D <= 256 or block_v < 2 or D % block_v:
        return f"KdaConfig(wy=True) needs a power-of-two head dim in 16..256 that block_v divides; got {D}"
    return None


def window_rows(tokens_per_seq: int) -> int:
    """TW: tokens a chunk takes, a power of two >= the window (ceil(T / N)), at most MAX_WINDOW."""
    return min(next_pow2(max(tokens_per_seq, 1)), MAX_WINDOW)


def launch_wy(qkv: Tensor, f3: Tensor, b: Tensor, cw: Tensor, conv_state: Tensor, A_log: Tensor, dt_bias: Tensor,
              state: Tensor, state_indices: Tensor, cu_seqlens: Tensor, out: Tensor, gate: Tensor,
              norm_weight: Tensor | None, counters: Tensor, *, lower_bound: float | None, scale: float,
              norm_eps: float, norm_rows: int, block_v: int, num_warps: int, tokens_per_seq: int,
              state_v_first: bool) -> None:
    """One launch over (D / block_v, N * H) programs (arguments as `kda_decode` checked them; `counters`: zeroed
    int32, >= N * H, when the norm is fused and block_v < D). Mutates only `out` (and returns the counters to 0)."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    norm = norm_weight is not None
    nv = D // block_v
    _kda_verify_wy_kernel[(nv, N * H)](
        qkv, qkv.stride(0), f3, f3.stride(0), f3.stride(1), b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(), state, state.stride(0), state_indices, cu_seqlens, out, counters,
        gate, gate.stride(0), gate.stride(1), norm_weight.contiguous() if norm else A_log,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale), float(norm_eps),
        H=H, D=D, BV=block_v, NV=nv, TW=window_rows(tokens_per_seq), HAS_LB=lower_bound is not None, NORM=norm,
        NORM_ROWS=norm_rows, V_FIRST=bool(state_v_first), PDL=pdl.enabled(qkv.device, "kda"), num_warps=num_warps,
        **pdl.launch_kwargs(qkv.device, "kda"),
    )
