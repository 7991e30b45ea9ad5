"""KDA decode over row chunks of the state: an opt-in schedule of `ops.kda_decode` (`KdaConfig(rows=True)`).

The chunked schedule (`kda_decode_kernel.py`) walks a head's [K, V] fp32 state (row-major: row k holds the V values
of key channel k) in [K, block_v] column tiles: every tile is D pieces of block_v * 4 bytes, D * 4 bytes apart,
and one tile is in flight per pipeline stage. This schedule walks it in [block_v, V] row chunks instead, each one
contiguous block of block_v * D * 4 bytes (16 KB at head dim 128, 32 rows), in two passes per token:
  1. pred = sum_k decay_k k_k S[k, :] over the chunks (every chunk's load independent: all of the head's state can
     be in flight at once through the software pipeline);
  2. nu = beta (v - pred); each chunk read again (from L2: pass 1 just brought it in), updated
     S[k, :] = decay_k S[k, :] + k_k nu, written back, and o += q_k S[k, :] accumulated.
So HBM traffic is the same as the chunked schedule's (one read and one write of the state); L2 serves the second
read. The arithmetic is the chunked schedule's per element, but the K sums add D / block_v partial sums, so
results differ from it by fp32 rounding only.

Decode only: the pool is updated (no verify, no step states, no per-sequence count), one program per
(sequence, head), tokens of a sequence one after another; head dim a power of two that block_v divides. The
token's q / k / gate / beta, the conv-state advance and the gated-RMSNorm epilogue are the chunked schedule's
helpers. PDL as there: only the slot and the bounds are read before the wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed.ops.triton.kda_decode_kernel import (
    _conv_silu,
    _norm_rows,
    _pdl_sync,
    _store_conv_states3,
    _token_inputs,
)


@triton.jit
def _row_chunk(x, c, CH: tl.constexpr, RB: tl.constexpr):
    """Elements c * RB .. c * RB + RB - 1 of the [CH * RB] vector x, as a [RB] vector."""
    x2 = tl.reshape(x, (CH, RB))
    return tl.sum(tl.where((tl.arange(0, CH) == c)[:, None], x2, 0.0), axis=0)


@triton.jit
def _kda_decode_rows_kernel(
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
    RB: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_LB: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    HD = H * D
    OUT_TY = O.dtype.element_ty
    CH: tl.constexpr = D // RB
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)
    bos = tl.load(CU + n).to(tl.int64)
    seq_len = tl.load(CU + n + 1).to(tl.int64) - bos
    ok = tl.arange(0, D)
    lk = ok < D
    mk = (ok * 0 + slot_raw) >= 0  # a padding row (slot -1): reads slot 0, computes zeros, writes no pool
    cq = h * D + ok
    ck = HD + cq
    cw = 2 * HD + cq
    cs = CS + slot * stride_css
    r = tl.arange(0, RB)
    mrow = ((r * 0 + slot_raw) >= 0)[:, None] & (ok[None, :] >= 0)
    base = S + slot * stride_ss + h * D * D + r[:, None] * D + ok[None, :]  # rows of chunk 0
    rate = tl.exp(tl.load(A_log + h).to(tl.float32))
    _pdl_sync(PDL)
    for i in range(seq_len):
        t = bos + i
        q, k, decay, beta = _token_inputs(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, F, stride_ft, stride_fh,
                                          Bt, stride_bt, stride_bh, DT, h, t, 0, cq, ck, ok, mk, lk, rate,
                                          lower_bound, scale, D, True, HAS_LB, True, OUT_TY)
        yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, t, 0, cw, mk, lk, True, OUT_TY)
        pred = tl.zeros([D], dtype=tl.float32)
        for c in tl.range(0, CH, num_stages=STAGES):  # pass 1: every chunk's load independent
            s = tl.where(mrow, tl.load(base + c * RB * D), 0.0)
            dc = _row_chunk(decay, c, CH, RB)
            kc = _row_chunk(k, c, CH, RB)
            pred += tl.sum(s * dc[:, None] * kc[:, None], axis=0)
        nu = beta * (yv - pred)
        o = tl.zeros([D], dtype=tl.float32)
        for c in tl.range(0, CH, num_stages=STAGES):  # pass 2: the chunks again (L2), updated and written back
            s = tl.where(mrow, tl.load(base + c * RB * D), 0.0)
            dc = _row_chunk(decay, c, CH, RB)
            kc = _row_chunk(k, c, CH, RB)
            qc = _row_chunk(q, c, CH, RB)
            s = s * dc[:, None] + kc[:, None] * nu[None, :]
            o += tl.sum(s * qc[:, None], axis=0)
            tl.store(base + c * RB * D, s, mask=mrow)
        tl.store(O + (t * H + h) * D + ok, tl.where(mk, o, 0.0).to(OUT_TY))
        _store_conv_states3(QKV, stride_qkv, cs, stride_csc, stride_csw, t, 1, cw, mk, cq, ck, mk)
        tl.debug_barrier()  # the state and conv-state writes before the next token's reads (other threads)
    if NORM:
        _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, lk, NORM_ROWS)


def rows_supported(D: int, block_v: int, update_state: bool, step_states, seq_lens) -> str | None:
    """Why the row-chunk schedule cannot run this launch (None: it can)."""
    if not update_state or step_states is not None or seq_lens is not None:
        return "KdaConfig(rows=True) is for decode (update_state=True, no step_states, no seq_lens)"
    if D & (D - 1) or D % block_v or block_v < 2:
        return f"KdaConfig(rows=True) needs a power-of-two head dim that block_v divides; got D={D}, block_v={block_v}"
    return None


def launch_rows(qkv, f3, b, cw, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens, out, gate, norm_weight,
                *, lower_bound, scale, norm_eps, norm: bool, norm_rows: int, block_v: int, num_warps: int,
                num_stages: int, pdl_on: bool, launch_kwargs: dict) -> None:
    """One launch of `_kda_decode_rows_kernel` over N * H programs (arguments as `kda_decode` checked them)."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    _kda_decode_rows_kernel[(N * H,)](
        qkv, qkv.stride(0), f3, f3.stride(0), f3.stride(1), b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(), state, state.stride(0), state_indices, cu_seqlens, out,
        gate, gate.stride(0), gate.stride(1), norm_weight.contiguous() if norm else A_log,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale), float(norm_eps),
        H=H, D=D, RB=block_v, STAGES=num_stages, HAS_LB=lower_bound is not None, NORM=norm, NORM_ROWS=norm_rows,
        PDL=pdl_on, num_warps=num_warps, num_stages=num_stages, **launch_kwargs,
    )

