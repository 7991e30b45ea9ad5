"""The flash loop of `mla_decode`'s split kernel (and of its ragged form): @triton.jit helpers only.

* `_kv_tile`: one key tile [BLOCK_N, v_dim] + [BLOCK_N, rope] gathered through the page table (one page-table
  entry and compile-time row offsets when the tile lies in one page: ROW > 0);
* `_flash_step` / `_flash_step_t`: one tile of the online softmax, rows-major ([rows, keys] scores) or keys-major
  ([keys, rows] scores, [v_dim, rows] output: the key tile and v_dim are the wgmma M on sm_90);
* `_flash_rows`: the loop over a split's keys in either orientation (keys-major in-page: each tile's page read one
  tile ahead);
* `_store_rows`: a row tile's normalised output, direct or as a partial + log2 LSE.

The contracts (shapes, the causal limits, the workspace) are `tokenspeed.ops.triton.mla_decode`'s module
docstring; the orientation and the launch knobs (KEYS_MAJOR, KEYS_MAJOR_LAUNCH) live there too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_tile(CACHE, stride_cp, stride_cr, pt_row, k0, hi, dv, dv_ok, dr, dr_ok, PAGE: tl.constexpr, DV: tl.constexpr,
             BLOCK_N: tl.constexpr, ROW: tl.constexpr = 0):
    """The keys k0..k0+BLOCK_N-1 (masked at hi) of one sequence, gathered through its page-table row:
    (latent part [BLOCK_N, BLOCK_DV], rope part [BLOCK_N, BLOCK_DR]) in the cache dtype; nothing read past hi.
    ROW > 0 (the cache's row stride, when PAGE % BLOCK_N == 0 and k0 % BLOCK_N == 0): the tile lies in one page,
    so one page-table entry and compile-time row offsets (one base address per thread, not one per row)."""
    pos = k0 + tl.arange(0, BLOCK_N)
    pos_ok = pos < hi
    if ROW > 0:
        page = tl.load(pt_row + k0 // PAGE).to(tl.int64)
        base = CACHE + page * stride_cp + (k0 % PAGE) * ROW
        r = tl.arange(0, BLOCK_N) * ROW
        kv = tl.load(base + r[:, None] + dv[None, :], mask=pos_ok[:, None] & dv_ok[None, :], other=0.0)
        kr = tl.load(base + r[:, None] + DV + dr[None, :], mask=pos_ok[:, None] & dr_ok[None, :], other=0.0)
    else:
        page = tl.load(pt_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        roff = page * stride_cp + (pos % PAGE) * stride_cr
        kv = tl.load(CACHE + roff[:, None] + dv[None, :], mask=pos_ok[:, None] & dv_ok[None, :], other=0.0)
        kr = tl.load(CACHE + roff[:, None] + DV + dr[None, :], mask=pos_ok[:, None] & dr_ok[None, :], other=0.0)
    return kv, kr


@triton.jit
def _to_compute(x, CT: tl.constexpr):
    """A cache tile in the dots' dtype CT, exact. An fp8 tile goes through fp32: on sm_90 e4m3 -> f16x2 unpacks,
    HADD2.F32 and an F2FP pack run at full rate, where the direct e4m3 -> bf16 cast converts f16 -> bf16 one
    element at a time on the quarter-rate F2F unit (`mla_gluon._fp8_to_bf16`, docs/kernels.md)."""
    if x.dtype.is_fp8():
        x = x.to(tl.float32)
    return x.to(CT)


@triton.jit
def _flash_step(q_v, q_r, kv, kr, pos, hi, lim, acc, m_i, l_i, sm_scale_log2, IEEE: tl.constexpr):
    """One key tile of the online softmax: returns (acc, m_i, l_i) updated with keys pos (masked at hi and at
    each row's causal limit lim)."""
    CT = tl.float32 if IEEE else tl.bfloat16
    kv = _to_compute(kv, CT)
    kr = _to_compute(kr, CT)
    if IEEE:
        qk = tl.dot(q_v, tl.trans(kv), input_precision="ieee")
        qk = tl.dot(q_r, tl.trans(kr), acc=qk, input_precision="ieee")
    else:
        qk = tl.dot(q_v, tl.trans(kv))
        qk = tl.dot(q_r, tl.trans(kr), acc=qk)
    qk = qk * sm_scale_log2
    vis = (pos[None, :] <= lim[:, None]) & (pos < hi)[None, :]
    qk = tl.where(vis, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if IEEE:
        acc = tl.dot(pr.to(CT), kv, acc=acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(pr.to(CT), kv, acc=acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _flash_step_t(q_v, q_r, kv, kr, pos, hi, lim, acc_t, m_i, l_i, sm_scale_log2, IEEE: tl.constexpr):
    """`_flash_step` keys-major: scores [BLOCK_N, BLOCK_H] = kv q_v^T + kr q_r^T and the output acc_t
    [BLOCK_DV, BLOCK_H] += kv^T p, so BLOCK_N and BLOCK_DV are the dots' M. Returns (acc_t, m_i, l_i)."""
    CT = tl.float32 if IEEE else tl.bfloat16
    kv = _to_compute(kv, CT)
    kr = _to_compute(kr, CT)
    if IEEE:
        st = tl.dot(kv, tl.trans(q_v), input_precision="ieee")
        st = tl.dot(kr, tl.trans(q_r), acc=st, input_precision="ieee")
    else:
        st = tl.dot(kv, tl.trans(q_v))
        st = tl.dot(kr, tl.trans(q_r), acc=st)
    st = st * sm_scale_log2
    vis = (pos[:, None] <= lim[None, :]) & (pos < hi)[:, None]
    st = tl.where(vis, st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pt = tl.exp2(st - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(pt, axis=0)
    if IEEE:
        acc_t = tl.dot(tl.trans(kv), pt, acc=acc_t * alpha[None, :], input_precision="ieee")
    else:
        acc_t = tl.dot(tl.trans(kv), pt.to(CT), acc=acc_t * alpha[None, :])
    return acc_t, m_new, l_i


@triton.jit
def _flash_rows(q_v, q_r, lim, CACHE, stride_cp, stride_cr, pt_row, lo, hi, sm_scale_log2, dv, dv_ok, dr, dr_ok,
                PAGE: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_DV: tl.constexpr, IEEE: tl.constexpr, KEYS_MAJOR: tl.constexpr = False, ROW: tl.constexpr = 0):
    """Online softmax of BLOCK_H query rows (q_v [BLOCK_H, BLOCK_DV], q_r [BLOCK_H, BLOCK_DR] in the dot type)
    over the keys lo..hi-1 of one sequence (page-table row pt_row); row i sees keys <= lim[i].
    Returns (acc [BLOCK_H, BLOCK_DV] fp32 unnormalised, running max m_i and sum l_i [BLOCK_H], log2 domain).
    KEYS_MAJOR: the dots keys-major (`_flash_step_t`), transposed back once at the end. ROW: `_kv_tile`'s."""
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if KEYS_MAJOR and ROW > 0:
        # The page of each tile is read one tile ahead (a loop-carried scalar): no key load of the loop then waits
        # on a page-table read of the same iteration, and Triton's pipeliner double-buffers the tiles (with the
        # page read in the same iteration it kept one buffer, waited for at the top of every iteration).
        acc_t = tl.zeros([BLOCK_DV, BLOCK_H], dtype=tl.float32)
        page = tl.load(pt_row + lo // PAGE, mask=lo < hi, other=0).to(tl.int64)
        rows = tl.arange(0, BLOCK_N)
        for k0 in range(lo, hi, BLOCK_N):
            nxt = k0 + BLOCK_N
            page_next = tl.load(pt_row + nxt // PAGE, mask=nxt < hi, other=0).to(tl.int64)
            pos = k0 + rows
            pos_ok = pos < hi
            base = CACHE + page * stride_cp + (k0 % PAGE) * ROW
            kv = tl.load(base + (rows * ROW)[:, None] + dv[None, :], mask=pos_ok[:, None] & dv_ok[None, :],
                         other=0.0)
            kr = tl.load(base + (rows * ROW)[:, None] + DV + dr[None, :], mask=pos_ok[:, None] & dr_ok[None, :],
                         other=0.0)
            acc_t, m_i, l_i = _flash_step_t(q_v, q_r, kv, kr, pos, hi, lim, acc_t, m_i, l_i, sm_scale_log2, IEEE)
            page = page_next
        acc = tl.trans(acc_t)
    elif KEYS_MAJOR:
        acc_t = tl.zeros([BLOCK_DV, BLOCK_H], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_N):
            kv, kr = _kv_tile(CACHE, stride_cp, stride_cr, pt_row, k0, hi, dv, dv_ok, dr, dr_ok, PAGE, DV, BLOCK_N,
                              ROW)
            acc_t, m_i, l_i = _flash_step_t(q_v, q_r, kv, kr, k0 + tl.arange(0, BLOCK_N), hi, lim, acc_t, m_i, l_i,
                                            sm_scale_log2, IEEE)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_N):
            kv, kr = _kv_tile(CACHE, stride_cp, stride_cr, pt_row, k0, hi, dv, dv_ok, dr, dr_ok, PAGE, DV, BLOCK_N,
                              ROW)
            acc, m_i, l_i = _flash_step(q_v, q_r, kv, kr, k0 + tl.arange(0, BLOCK_N), hi, lim, acc, m_i, l_i,
                                        sm_scale_log2, IEEE)
    return acc, m_i, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, kv_scale, direct, O, o_base, o_rows, PART, LSE, p_base, p_rows, row_ok, dv, dv_ok,
                DV: tl.constexpr):
    """The normalised output of a row tile: to O rows o_base + o_rows when `direct` (the sequence's only split),
    else to the partial rows p_base + p_rows (fp32 output and log2 LSE, -inf for a row that saw no key)."""
    inv = tl.where(l_i > 0, kv_scale / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    omask = row_ok[:, None] & dv_ok[None, :]
    if direct:  # the bases widen to int64 here (not before the caller's loop, where they would hold registers)
        tl.store(O + (o_base.to(tl.int64) + o_rows[:, None]) * DV + dv[None, :], o.to(O.dtype.element_ty),
                 mask=omask)
    else:
        tl.store(PART + (p_base.to(tl.int64) + p_rows[:, None]) * DV + dv[None, :], o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE + p_base.to(tl.int64) + p_rows, lse, mask=row_ok)
