"""KDA verify windows in the chunk form: `KdaConfig(wy=True)`, the schedule `ops.kda_decode` takes for
update_state=False from 96 (sequence, head) pairs (`kda_config.MULTI_TABLE`). One program per (sequence, head), the
head's V axis in tiles of BV.

The split loop walks a window token by token, so every token's inputs, norms and two reductions over the state tile
wait on the previous token's update; 4-token windows run at 9-13% of HBM on the H200 (benchmarks/README.md), and a
program per V tile recomputes the window's key side. Here the key side is computed once per (sequence, head), and
the state enters the outputs through one product per token. With d_t = exp(G_t), G_t the inclusive cumulative log
decay of the window (per key channel), S the state before the window, Qd = q * d, Kd = k * d (rows t):

    A[t, i] = beta_t k_t^T diag(d_t / d_i) k_i  (i < t),    B[t, i] = q_t^T diag(d_t / d_i) k_i  (i <= t)
    U = (I + A)^-1 diag(beta) (V - Kd S)                     (the delta rule's updates u_t, S_t = S'_t + k_t u_t^T)
    O = Qd S + B U = Qe S + C V,   C = B (I + A)^-1 diag(beta),   Qe = Qd - C Kd

the token-by-token recurrence in another summation order (fp32; ~1e-6 relative to it). d_t / d_i <= 1 for
i <= t, so no exp(-G) and any gate (K3's bounded one, the softplus one) is safe. (I + A)^-1 = (I - A)(I + A^2)
(I + A^4)..., A nilpotent. Per V tile: Qe S (TW reductions over the key axis) and C V (V's conv for the tile), in
a `tl.range` that Triton software-pipelines (the next tiles' state loads in flight through shared memory).

The window TW is a power of two >= ceil(T / N) (or >= the caller's bound on every sequence's tokens,
`max_seq_tokens`), <= 16. Without such a bound a sequence longer than TW is possible: it takes the windows in turn,
tile by tile, the tile carried between them (S = diag(d_last) S + (k * d_last / d)^T U) and the key side redone per
tile; that path costs registers for every program (255 against 124 at BV 32 on sm_90), so the model passes the
bound (its verify windows are uniform). Padding rows (slot < 0) store zeros. Pools are not written. The fused gated
norm (`_norm_rows`) runs after a CTA barrier (the program owns the head). PDL: the slot and bounds are read before
the wait.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.kda_decode_kernel import _gate, _norm_rows, _pdl_sync, _prefetch_l2_bulk

MAX_WINDOW = 16  # TW cap: the [TW, TW, D] pair tensors stay in registers


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
    w = tl.load(CW + ch[None, :] * 4 + J + pos[:, None] * 0)  # as [R, C] rows: x's layout, no conversion
    return w * x.to(tl.float32)


@triton.jit
def _seq_row(SLOTS, CU, n):
    """Sequence n's state slot as given (< 0: a padding row), the slot to read (>= 0), its first row and length."""
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    bos = tl.load(CU + n).to(tl.int64)
    return slot_raw, tl.maximum(slot_raw, 0), bos, tl.load(CU + n + 1).to(tl.int64) - bos


@triton.jit
def _tile_ptrs(S, stride_ss, slot, h, ok, ov, D: tl.constexpr, V_FIRST: tl.constexpr):
    """Pointers of head h's [D, BV] state tile of V columns `ov` in `slot`: element (k, v) of a head's state is
    v * D + k in a [V, K] pool (V_FIRST; a tile is BV contiguous rows) or k * D + v."""
    if V_FIRST:
        return S + slot * stride_ss + h * D * D + ov[None, :] * D + ok[:, None]
    return S + slot * stride_ss + h * D * D + ok[:, None] * D + ov[None, :]


@triton.jit
def _mm(a, b):
    """a @ b of small register tensors ([M, K] x [K, N], fp32) as a broadcast product summed over K."""
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _key_rows(QKV, stride_qkv, F, stride_ft, Bt, stride_bt, CW, cs, stride_csc, stride_csw, dtb, rate, lower_bound,
              bos, pos, live, mrk, ck, ok, HAS_LB: tl.constexpr, OUT_TY: tl.constexpr):
    """The key side of a window's rows `pos` [TW] (`live` [TW], `mrk` [TW, D] its mask): k [TW, D] (conv, SiLU,
    L2 norm; 0 on dead rows), G [TW, D] (the inclusive cumulative log decay; no decay on dead rows) and beta [TW]
    (0 on dead rows). F and Bt point at this head's columns; dtb as in `_window_form`."""
    yk = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, ck, mrk, OUT_TY)
    k = yk * tl.rsqrt(tl.sum(yk * yk, axis=1) + 1e-6)[:, None]
    t = bos + pos
    f = tl.load(F + t[:, None] * stride_ft + ok[None, :], mask=mrk, other=0.0).to(tl.float32)
    g = tl.where(mrk, _gate(f + dtb, rate, lower_bound, HAS_LB), 0.0)  # past the window: no decay
    braw = tl.load(Bt + t * stride_bt, mask=live, other=0.0).to(tl.float32)
    beta = tl.where(live, 1.0 / (1.0 + tl.exp(-braw)), 0.0)
    return k, tl.cumsum(g, axis=0), beta


@triton.jit
def _unit_lower_inverse(a, eye, TW: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular [TW, TW] A (nilpotent: A^TW = 0) as (I - A)(I + A^2)(I + A^4)..."""
    a2 = _mm(a, a)
    inv = _mm(eye - a, eye + a2)  # TW <= 4 (A^4 = 0)
    if TW > 4:
        a4 = _mm(a2, a2)
        inv = _mm(inv, eye + a4)
        if TW > 8:
            inv = _mm(inv, eye + _mm(a4, a4))
    return inv


@triton.jit
def _window_form(QKV, stride_qkv, F, stride_ft, Bt, stride_bt, CW, cs, stride_csc, stride_csw, dtb, rate,
                 lower_bound, scale, bos, pos, live, cq, ck, ok, TW: tl.constexpr, HAS_LB: tl.constexpr,
                 OUT_TY: tl.constexpr):
    """Qe [TW, D] and C [TW, TW] of a window of `live` tokens (module docstring; rows past it give zeros), and for
    carrying the state past it Kd [TW, D], W1 = (I + A)^-1 diag(beta) [TW, TW], k and G [TW, D]. F and Bt point
    at this head's columns; dtb: the head's dt_bias, [D] or as [TW, D] rows (f's layout: no conversion)."""
    mrk = live[:, None] & ((ok * 0 + 1) > 0)[None, :]
    yq = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, cq, mrk, OUT_TY)
    q = yq * tl.rsqrt(tl.sum(yq * yq, axis=1) + 1e-6)[:, None] * scale
    k, lg, beta = _key_rows(QKV, stride_qkv, F, stride_ft, Bt, stride_bt, CW, cs, stride_csc, stride_csw, dtb, rate,
                            lower_bound, bos, pos, live, mrk, ck, ok, HAS_LB, OUT_TY)
    rows = tl.arange(0, TW)
    w3 = tl.exp(tl.minimum(lg[:, None, :] - lg[None, :, :], 0.0))  # d_t / d_i where i <= t (masked elsewhere)
    lower = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    a = tl.where(lower, tl.sum(k[:, None, :] * k[None, :, :] * w3, axis=2), 0.0) * beta[:, None]
    bm = tl.where(lower | (eye > 0), tl.sum(q[:, None, :] * k[None, :, :] * w3, axis=2), 0.0)
    w1 = _unit_lower_inverse(a, eye, TW) * beta[None, :]  # U = w1 (V - Kd S)
    c = _mm(bm, w1)
    kd = k * tl.exp(lg)
    return q * tl.exp(lg) - _mm(c, kd), c, kd, w1, k, lg


@triton.jit
def _rows_times_tile(x, rows, b_s, TW: tl.constexpr):
    """x @ b_s for x [TW, D] and the state tile b_s [D, BV]: TW reductions over the key axis -> [TW, BV]."""
    acc = tl.zeros([TW, b_s.shape[1]], dtype=tl.float32)
    for t in tl.static_range(TW):
        xt = tl.sum(tl.where(rows[:, None] == t, x, 0.0), axis=0)
        acc = tl.where(rows[:, None] == t, tl.sum(xt[:, None] * b_s, axis=0)[None, :], acc)
    return acc


@triton.jit
def _verify_short(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs, stride_csc, stride_csw, O,
        p_s, vstep, dtb, rate, lower_bound, scale, h, bos, seq_len, rows, ob, real, cq, ck, ok, H: tl.constexpr,
        D: tl.constexpr, BV: tl.constexpr, TW: tl.constexpr, STAGES: tl.constexpr, HAS_LB: tl.constexpr,
        OUT_TY: tl.constexpr):
    """A window of seq_len <= TW tokens: its key side once, then the V tiles (software-pipelined loads)."""
    live = rows < seq_len
    qe, c, _, _, _, _ = _window_form(QKV, stride_qkv, F + h * stride_fh, stride_ft, Bt + h * stride_bh, stride_bt,
                                     CW, cs, stride_csc, stride_csw, dtb, rate, lower_bound, scale, bos, rows,
                                     live, cq, ck, ok, TW, HAS_LB, OUT_TY)
    for vt in tl.range(0, D // BV, num_stages=STAGES):
        b_s = tl.load(p_s + vt * vstep)  # [D, BV]; a padding row reads slot 0 and stores zeros
        ov = vt * BV + ob
        yv = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, rows, 2 * H * D + h * D + ov,
                        live[:, None] & (ov < D)[None, :], OUT_TY)
        o = tl.where(real[None, :], _rows_times_tile(qe, rows, b_s, TW) + _mm(c, yv), 0.0)
        tl.store(O + ((bos + rows) * H + h)[:, None] * D + ov[None, :], o.to(OUT_TY),
                 mask=live[:, None] & (ov < D)[None, :])


@triton.jit
def _verify_long(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs, stride_csc, stride_csw, O,
        p_s, vstep, dtb, rate, lower_bound, scale, h, bos, seq_len, rows, ob, real, cq, ck, ok, H: tl.constexpr,
        D: tl.constexpr, BV: tl.constexpr, TW: tl.constexpr, STAGES: tl.constexpr, HAS_LB: tl.constexpr,
        OUT_TY: tl.constexpr):
    """seq_len > TW: tile by tile, the windows of TW tokens in turn with the tile carried (key side per tile)."""
    for vt in range(D // BV):
        b_s = tl.load(p_s + vt * vstep)
        ov = vt * BV + ob
        for c0 in range(0, seq_len, TW):
            pos = c0 + rows
            live = pos < seq_len
            qe, c, kd, w1, k, lg = _window_form(QKV, stride_qkv, F + h * stride_fh, stride_ft, Bt + h * stride_bh,
                                                stride_bt, CW, cs, stride_csc, stride_csw, dtb, rate, lower_bound,
                                                scale, bos, pos, live, cq, ck, ok, TW, HAS_LB, OUT_TY)
            yv = _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, pos, 2 * H * D + h * D + ov,
                            live[:, None] & (ov < D)[None, :], OUT_TY)
            o = tl.where(real[None, :], _rows_times_tile(qe, rows, b_s, TW) + _mm(c, yv), 0.0)
            tl.store(O + ((bos + pos) * H + h)[:, None] * D + ov[None, :], o.to(OUT_TY),
                     mask=live[:, None] & (ov < D)[None, :])
            if c0 + TW < seq_len:  # S = diag(d_last) S + sum_t (k_t d_last / d_t) u_t^T (every row live)
                u = _mm(w1, yv - _rows_times_tile(kd, rows, b_s, TW))
                glast = tl.sum(tl.where(rows[:, None] == TW - 1, lg, 0.0), axis=0)
                kt = k * tl.exp(glast[None, :] - lg)
                b_s = tl.exp(glast)[:, None] * b_s
                for t in tl.static_range(TW):
                    kt_t = tl.sum(tl.where(rows[:, None] == t, kt, 0.0), axis=0)
                    b_s += kt_t[:, None] * tl.sum(tl.where(rows[:, None] == t, u, 0.0), axis=0)[None, :]


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
    TW: tl.constexpr,
    STAGES: tl.constexpr,
    LONG: tl.constexpr,
    HAS_LB: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    V_FIRST: tl.constexpr,
    PDL: tl.constexpr,
    PF_STATE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    OUT_TY = O.dtype.element_ty
    slot_raw, slot, bos, seq_len = _seq_row(SLOTS, CU, n)
    ok = tl.arange(0, D)
    if PF_STATE:  # the head's state rows into L2 while the key side runs (the pool: allowed before the PDL wait)
        _prefetch_l2_bulk(S + slot * stride_ss + h * D * D + ok * D, D * 4, (ok * 0 + slot_raw) >= 0)
    _pdl_sync(PDL)

    cq = h * D + ok
    ck = H * D + cq
    cs = CS + slot * stride_css
    rate = tl.exp(tl.load(A_log + h).to(tl.float32))
    rows = tl.arange(0, TW)
    dtb = tl.load(DT + h * D + ok[None, :] + rows[:, None] * 0).to(tl.float32)  # [TW, D] rows, as f is loaded
    ob = tl.arange(0, BV)
    if V_FIRST:
        p_s = S + slot * stride_ss + h * D * D + ob[None, :] * D + ok[:, None]
        vstep = BV * D
    else:
        p_s = S + slot * stride_ss + h * D * D + ok[:, None] * D + ob[None, :]
        vstep = BV
    real = (ob * 0 + slot_raw) >= 0
    if LONG:
        if seq_len <= TW:
            _verify_short(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs, stride_csc,
                          stride_csw, O, p_s, vstep, dtb, rate, lower_bound, scale, h, bos, seq_len, rows, ob, real,
                          cq, ck, ok, H, D, BV, TW, STAGES, HAS_LB, OUT_TY)
        else:
            _verify_long(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs, stride_csc,
                         stride_csw, O, p_s, vstep, dtb, rate, lower_bound, scale, h, bos, seq_len, rows, ob, real,
                         cq, ck, ok, H, D, BV, TW, STAGES, HAS_LB, OUT_TY)
    else:  # the caller bounds every sequence by TW tokens: the short path only (fewer registers)
        _verify_short(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs, stride_csc,
                      stride_csw, O, p_s, vstep, dtb, rate, lower_bound, scale, h, bos, seq_len, rows, ob, real, cq,
                      ck, ok, H, D, BV, TW, STAGES, HAS_LB, OUT_TY)
    if NORM:
        tl.debug_barrier()  # every tile's o stores (all threads of this program) before the rows are read
        _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, (ok * 0 + 1) > 0,
                   NORM_ROWS)


def wy_unsupported(D: int, block_v: int, update_state: bool, step_states: Tensor | None,
                   seq_lens: Tensor | None) -> str | None:
    """None when the WY verify launch can run this call, else why not (the caller raises it)."""
    if update_state or step_states is not None or seq_lens is not None:
        return "KdaConfig(wy=True) is for verify windows (update_state=False, no step_states, no seq_lens)"
    return wy_shape_unsupported(D, block_v)


def wy_shape_unsupported(D: int, block_v: int) -> str | None:
    """None when the WY kernels (verify and replay) take head dim D in V tiles of block_v, else why not."""
    if D & (D - 1) or not 16 <= D <= 256 or block_v < 2 or D % block_v:
        return f"KdaConfig(wy=True) needs a power-of-two head dim in 16..256 that block_v divides; got {D}"
    return None


def window_rows(tokens_per_seq: int) -> int:
    """TW: the window the chunk form takes, a power of two >= ceil(T / N), at most MAX_WINDOW (longer sequences run
    the token loop)."""
    return min(next_pow2(max(tokens_per_seq, 1)), MAX_WINDOW)


def launch_wy(qkv: Tensor, f3: Tensor, b: Tensor, cw: Tensor, conv_state: Tensor, A_log: Tensor, dt_bias: Tensor,
              state: Tensor, state_indices: Tensor, cu_seqlens: Tensor, out: Tensor, gate: Tensor,
              norm_weight: Tensor | None, *, lower_bound: float | None, scale: float, norm_eps: float,
              norm_rows: int, block_v: int, num_warps: int, num_stages: int | None, tokens_per_seq: int,
              max_seq_tokens: int | None, state_v_first: bool, prefetch_state: bool = False) -> None:
    """One launch over N * H programs (arguments as `kda_decode` checked them). `max_seq_tokens`, a bound on every
    sequence's token count the caller guarantees: up to MAX_WINDOW, the window TW and no long-sequence path.
    `prefetch_state`: an L2 bulk prefetch of each head's state first (sm_90, 16-byte aligned rows: the caller
    checks). Mutates only `out`."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    norm = norm_weight is not None
    stages = num_stages or 3
    bounded = max_seq_tokens is not None and max_seq_tokens <= MAX_WINDOW
    tw = window_rows(max_seq_tokens if bounded else tokens_per_seq)
    _kda_verify_wy_kernel[(N * H,)](
        qkv, qkv.stride(0), f3, f3.stride(0), f3.stride(1), b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(), state, state.stride(0), state_indices, cu_seqlens, out,
        gate, gate.stride(0), gate.stride(1), norm_weight.contiguous() if norm else A_log,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale), float(norm_eps),
        H=H, D=D, BV=block_v, TW=tw, STAGES=stages, LONG=not bounded, HAS_LB=lower_bound is not None,
        NORM=norm, NORM_ROWS=norm_rows, V_FIRST=bool(state_v_first), PDL=pdl.enabled(qkv.device, "kda"),
        PF_STATE=bool(prefetch_state), num_warps=num_warps, num_stages=stages, **pdl.launch_kwargs(qkv.device, "kda"),
    )
