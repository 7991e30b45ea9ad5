"""Absorbed-MLA decode / k-token verify over the paged latent cache, split-KV, balanced per request.

The function of `tokenspeed.ops.reference.mla.mla_attention_paged` (and `_paged_decode`) for the batch shape
of decode and verify: N sequences with the same number Q of new tokens (1 for decode, up to ~8 for verify):

    q          [N, Q, H, Dl]   absorbed queries [W_UK^T q_nope ; q_pe] (fp32 / bf16), unit last stride
    cache      [P, page_size, Dl]  latent rows [c_kv (v_dim) ; k_pe]; bf16 / fp32 / fp8 e4m3 (stored / kv_scale)
    page_table [N, W] int32    a sequence's row i is page_table[n, i // page_size] * page_size + i % page_size
    kv_lens    [N] int (device) context length after this step (the new rows already stored); <= 0: padding
    out        [N, Q, H, v_dim] in q.dtype

Keys are the full latent rows (Dl = v_dim + rope, 576 = 512 + 64 in the real models), values their first v_dim
columns; query j of sequence n sits at position kv_lens[n] - Q + j and sees keys 0..that position (causal,
bottom-right aligned). A padding sequence (kv_len <= 0) gets zeros and nothing of it is read.

Schedule. The Q*H query rows of a sequence share every key, so they are processed together as the rows of one
tile (row r = j * H + h, each with its own causal limit), BLOCK_H rows per program. Grid (HB, max_splits, N)
with HB = cdiv(Q*H, BLOCK_H): G = N * max_splits split slots. The number of splits of each sequence and the
split length are computed on the device from kv_lens by every program (no host synchronisation; the grid
depends only on shapes and max_splits, so the launch is CUDA-graph capturable):

* balanced (default): chunk = max(cdiv(sum(kv_lens), max(G - N, 1)), MIN_CHUNK) rounded up to BLOCK_N, and
  splits_n = cdiv(kv_len_n, chunk); so every split in the batch covers about `chunk` rows whatever the mix of
  history lengths (a 64K history gets many splits, a 1K one a single one). The slots are a flat work list:
  slot p = n_slot * max_splits + s serves the split p - start_m of the sequence m with
  start_m <= p < start_m + splits_m (start = exclusive prefix sum of splits, recomputed in-kernel), so a long
  sequence may take more than max_splits splits; sum(splits) <= G always holds, slots past it exit at once.
* uniform (balanced=False): sequence n uses slots n * max_splits + s, splits of cdiv(kv_len_n, max_splits)
  rows rounded up to BLOCK_N (slots past the last non-empty split exit at once).

Each program runs a flash-attention loop over its split: the KV tile [BLOCK_N, Dl] is gathered through the page
table (int64 row offsets) and loaded once as a [BLOCK_N, BLOCK_DV] latent part and a [BLOCK_N, BLOCK_DR] rope
part (BLOCK_DV = next_pow2(v_dim), BLOCK_DR = next_pow2(Dl - v_dim), at least 16 for tl.dot, masked when
padded, so Dl = 576 costs 512 + 64 and not 1024 columns); S = q_v k_v^T + q_r k_r^T, and the PV product
reuses the latent part. Scores and the softmax statistics are fp32 (exp2 with the scale folded in); the dots
run in bf16 with fp32 accumulation for bf16 / fp8 caches (q cast to bf16), in fp32 (IEEE) for fp32 caches. An
fp8 tile is converted to bf16 (exact) and kv_scale is applied to the scores and to the output.

A sequence with a single split writes its output directly (no partials); otherwise each split writes its
normalised partial output [v_dim] fp32 and log-sum-exp (log2) per row into a workspace [G, Q*H, ...] and a
combine kernel merges the splits of every sequence with more than one (the weights exp2(lse_i - max)). Padding
rows are zeroed by the split kernel's programs (hb, 0, n) of that sequence. With max_splits == 1 there is no
combine launch. Default launch: BLOCK_N 32, 2 stages; BLOCK_H 32 with 8 warps when Q*H is a multiple of 32, else
16 with 4 warps (sm_90 offline compile: 177 / 196 registers, no spills, cp.async-pipelined KV loads).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton._utils import next_pow2

LOG2E = 1.4426950408889634
MIN_CHUNK = 64  # rows: shorter balanced splits cost more in partials (Q*H*v_dim*8 bytes) than they save


@triton.jit
def _plan_balanced(KV_LENS, N, G, BLOCK_SEQ: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK_: tl.constexpr):
    """(idx, lens, counts, starts, chunk) of the balanced split plan, as [BLOCK_SEQ] vectors + the chunk."""
    idx = tl.arange(0, BLOCK_SEQ)
    lens = tl.load(KV_LENS + idx, mask=idx < N, other=0).to(tl.int64)
    lens = tl.maximum(lens, 0)
    total = tl.sum(lens, axis=0)
    denom = tl.maximum(G - N, 1)
    chunk = tl.maximum((total + denom - 1) // denom, MIN_CHUNK_)
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    counts = (lens + chunk - 1) // chunk
    starts = tl.cumsum(counts, axis=0) - counts
    return idx, lens, counts, starts, chunk


@triton.jit
def _pick(idx, vec, n):
    """vec[n] as a scalar (vec a [BLOCK_SEQ] vector)."""
    return tl.sum(tl.where(idx == n, vec, 0), axis=0)


@triton.jit
def _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N: tl.constexpr):
    c = (tl.maximum(kv_len, 1) + MAX_SPLITS - 1) // MAX_SPLITS
    return (c + BLOCK_N - 1) // BLOCK_N * BLOCK_N


@triton.jit
def _mla_split_kernel(
    Qp, stride_qn, stride_qj, stride_qh,
    CACHE, stride_cp, stride_cr,
    PT, stride_pt,
    KV_LENS,
    O, PART, LSE,
    N, MAX_SPLITS, sm_scale_log2, kv_scale,
    QN: tl.constexpr,
    H: tl.constexpr,
    PAGE: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
    MIN_CHUNK_: tl.constexpr,
    BALANCED: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = tl.program_id(2).to(tl.int64)
    QH: tl.constexpr = QN * H
    OUT_TY = O.dtype.element_ty
    CT = tl.float32 if IEEE else tl.bfloat16

    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < QH
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    dv_ok = dv < DV
    dr_ok = dr < DR

    # Padding sequence: zeros, written once (slot 0 of its own row of the grid, whatever the plan).
    own_len = tl.load(KV_LENS + pid_n).to(tl.int64)
    if (pid_s == 0) & (own_len <= 0):
        zo = O + (pid_n * QH + rows[:, None]) * DV + dv[None, :]
        tl.store(zo, tl.zeros([BLOCK_H, BLOCK_DV], dtype=OUT_TY), mask=row_ok[:, None] & dv_ok[None, :])

    # Which (sequence, split) this slot serves.
    if BALANCED:
        p = pid_n * MAX_SPLITS + pid_s
        idx, lens, counts, starts, chunk = _plan_balanced(KV_LENS, N, N * MAX_SPLITS, BLOCK_SEQ, BLOCK_N,
                                                          MIN_CHUNK_)
        n = tl.sum((starts + counts <= p).to(tl.int64), axis=0)  # first sequence whose splits end after p
        n = tl.minimum(n, N - 1)
        kv_len = _pick(idx, lens, n)
        count = _pick(idx, counts, n)
        start = _pick(idx, starts, n)
        s = p - start
    else:
        n = pid_n
        kv_len = tl.maximum(own_len, 0)
        chunk = _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N)
        count = (kv_len + chunk - 1) // chunk
        start = n * MAX_SPLITS
        s = pid_s.to(tl.int64)
    if s >= count:  # past the plan's last split (or a padding sequence)
        return

    lo = (s * chunk).to(tl.int32)  # positions fit in int32 (page_table is int32-indexed anyway)
    hi = tl.minimum(lo + chunk, kv_len).to(tl.int32)
    j = rows // H
    h = rows % H
    lim = kv_len - QN + j  # last key position row r sees

    q_ptr = Qp + n * stride_qn + j.to(tl.int64) * stride_qj + h.to(tl.int64) * stride_qh
    q_v = tl.load(q_ptr[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0).to(CT)
    q_r = tl.load(q_ptr[:, None] + DV + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0).to(CT)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    pt_row = PT + n * stride_pt
    for k0 in range(lo, hi, BLOCK_N):
        pos = k0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        page = tl.load(pt_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        roff = page * stride_cp + (pos % PAGE) * stride_cr
        kv = tl.load(CACHE + roff[:, None] + dv[None, :], mask=pos_ok[:, None] & dv_ok[None, :], other=0.0)
        kr = tl.load(CACHE + roff[:, None] + DV + dr[None, :], mask=pos_ok[:, None] & dr_ok[None, :], other=0.0)
        kv = kv.to(CT)
        kr = kr.to(CT)
        if IEEE:
            qk = tl.dot(q_v, tl.trans(kv), input_precision="ieee")
            qk = tl.dot(q_r, tl.trans(kr), acc=qk, input_precision="ieee")
        else:
            qk = tl.dot(q_v, tl.trans(kv))
            qk = tl.dot(q_r, tl.trans(kr), acc=qk)
        qk = qk * sm_scale_log2
        vis = (pos[None, :] <= lim[:, None]) & pos_ok[None, :]
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
        m_i = m_new

    inv = tl.where(l_i > 0, kv_scale / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    omask = row_ok[:, None] & dv_ok[None, :]
    if count == 1:
        tl.store(O + (n * QH + rows[:, None]) * DV + dv[None, :], o.to(OUT_TY), mask=omask)
    else:
        slot = start + s
        tl.store(PART + (slot * QH + rows[:, None]) * DV + dv[None, :], o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE + slot * QH + rows, lse, mask=row_ok)


@triton.jit
def _mla_combine_kernel(
    KV_LENS, O, PART, LSE,
    N, MAX_SPLITS,
    QH: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_VC: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_CHUNK_: tl.constexpr,
    BALANCED: tl.constexpr,
):
    pid_v = tl.program_id(0)
    r = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    if BALANCED:
        idx, _, counts, starts, _ = _plan_balanced(KV_LENS, N, N * MAX_SPLITS, BLOCK_SEQ, BLOCK_N, MIN_CHUNK_)
        count = _pick(idx, counts, n)
        start = _pick(idx, starts, n)
    else:
        kv_len = tl.maximum(tl.load(KV_LENS + n).to(tl.int64), 0)
        chunk = _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N)
        count = (kv_len + chunk - 1) // chunk
        start = n * MAX_SPLITS
    if count <= 1:  # written by the split kernel (one split) or a padding row (zeroed there)
        return

    si = tl.arange(0, BLOCK_S)
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for c0 in range(0, count, BLOCK_S):
        ok = c0 + si < count
        m = tl.maximum(m, tl.load(LSE + (start + c0 + si) * QH + r, mask=ok, other=float("-inf")))
    mx = tl.max(m, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)

    dv = pid_v * BLOCK_VC + tl.arange(0, BLOCK_VC)
    dv_ok = dv < DV
    acc = tl.zeros([BLOCK_VC], dtype=tl.float32)
    wsum = tl.zeros([BLOCK_S], dtype=tl.float32)
    for c0 in range(0, count, BLOCK_S):
        ok = c0 + si < count
        slot = start + c0 + si
        w = tl.exp2(tl.load(LSE + slot * QH + r, mask=ok, other=float("-inf")) - mx)
        part = tl.load(PART + (slot[:, None] * QH + r) * DV + dv[None, :], mask=ok[:, None] & dv_ok[None, :],
                       other=0.0)
        wsum += w
        acc += tl.sum(part * w[:, None], axis=0)
    tot = tl.sum(wsum, axis=0)
    out = acc / tl.where(tot > 0, tot, 1.0)
    tl.store(O + (n * QH + r) * DV + dv, out.to(O.dtype.element_ty), mask=dv_ok)


def default_block_h(q_rows: int) -> int:
    """16 or 32 rows per program (tl.dot needs >= 16): the fewer padded rows, ties to 32 (fewer KV re-reads)."""
    waste = {b: triton.cdiv(q_rows, b) * b - q_rows for b in (32, 16)}
    return min(waste, key=lambda b: (waste[b], -b))


def default_max_splits(num_seqs: int, q_rows: int, num_sms: int = 132, *, block_h: int | None = None,
                       waves: float = 2.0) -> int:
    """Split slots per sequence so that the grid (HB x max_splits x N) holds about `waves` x num_sms programs."""
    hb = triton.cdiv(max(q_rows, 1), block_h or default_block_h(q_rows))
    return max(1, min(1024, math.ceil(waves * num_sms / (max(num_seqs, 1) * hb))))


def mla_decode(
    q: Tensor,
    cache: Tensor,
    page_table: Tensor,
    kv_lens: Tensor,
    scale: float,
    v_dim: int,
    kv_scale: float = 1.0,
    *,
    max_splits: int | None = None,
    balanced: bool = True,
    BLOCK_H: int | None = None,
    BLOCK_N: int = 32,
    num_warps: int | None = None,
    num_stages: int = 2,
    min_chunk: int = MIN_CHUNK,
    out: Tensor | None = None,
) -> Tensor:
    """Paged absorbed-MLA decode / verify (the contract of the module docstring). Returns [N, Q, H, v_dim].

    max_splits: split slots per sequence (default `default_max_splits`); balanced: the balanced plan (else
    uniform); BLOCK_H / BLOCK_N / num_warps / num_stages: launch configuration; min_chunk: the shortest balanced
    split (rows); out: a contiguous output."""
    if q.dim() != 4 or q.stride(-1) != 1:
        raise ValueError(f"q must be [N, Q, H, Dl] with unit last stride; got {tuple(q.shape)}")
    N, QN, H, Dl = q.shape
    if cache.dim() != 3 or cache.shape[-1] != Dl or cache.stride(-1) != 1:
        raise ValueError(f"cache must be [P, page_size, {Dl}] with unit last stride; got {tuple(cache.shape)}")
    if not 0 < v_dim < Dl:
        raise ValueError(f"v_dim must be in (0, {Dl}); got {v_dim}")
    if page_table.dim() != 2 or page_table.shape[0] != N:
        raise ValueError(f"page_table must be [{N}, W]; got {tuple(page_table.shape)}")
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    if kv_lens.shape != (N,):
        raise ValueError(f"kv_lens must be [{N}]; got {tuple(kv_lens.shape)}")
    kv_lens = kv_lens if kv_lens.is_contiguous() else kv_lens.contiguous()
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32 / bf16 / fp16; got {q.dtype}")
    if cache.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"cache must be fp32 / bf16 / fp8 e4m3; got {cache.dtype}")
    if out is None:
        out = torch.empty(N, QN, H, v_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (N, QN, H, v_dim) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{N}, {QN}, {H}, {v_dim}] tensor of q's dtype")
    if N == 0 or QN * H == 0:
        return out
    qh = QN * H
    bh = BLOCK_H or default_block_h(qh)
    if bh < 16 or bh & (bh - 1) or BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"BLOCK_H and BLOCK_N must be powers of two >= 16; got {bh}, {BLOCK_N}")
    ms = int(max_splits) if max_splits is not None else default_max_splits(N, qh, block_h=bh)
    if ms < 1:
        raise ValueError(f"max_splits must be >= 1; got {ms}")
    hb = triton.cdiv(qh, bh)
    if ms > 65535 or N > 65535:
        raise ValueError("grid too large: max_splits and N must be <= 65535")
    ieee = cache.dtype == torch.float32
    G = N * ms
    if ms > 1:
        part = torch.empty(G, qh, v_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(G, qh, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # never touched: one split per sequence
    block_seq = next_pow2(N) if balanced else 1  # the uniform plan reads only its own kv_len
    nw = num_warps or (4 if bh <= 16 else 8)
    _mla_split_kernel[(hb, ms, N)](
        q, q.stride(0), q.stride(1), q.stride(2),
        cache, cache.stride(0), cache.stride(1),
        page_table, page_table.stride(0),
        kv_lens,
        out, part, lse,
        N, ms, float(scale) * float(kv_scale) * LOG2E, float(kv_scale),
        QN=QN, H=H, PAGE=cache.shape[1], DV=v_dim, DR=Dl - v_dim,
        BLOCK_DV=max(16, next_pow2(v_dim)), BLOCK_DR=max(16, next_pow2(Dl - v_dim)), BLOCK_H=bh, BLOCK_N=BLOCK_N,
        BLOCK_SEQ=block_seq, MIN_CHUNK_=int(min_chunk), BALANCED=bool(balanced), IEEE=ieee,
        num_warps=nw, num_stages=num_stages,
    )
    if ms > 1:
        block_vc = min(next_pow2(v_dim), 128)
        _mla_combine_kernel[(triton.cdiv(v_dim, block_vc), qh, N)](
            kv_lens, out, part, lse,
            N, ms,
            QH=qh, DV=v_dim, BLOCK_VC=block_vc, BLOCK_S=16, BLOCK_SEQ=block_seq, BLOCK_N=BLOCK_N,
            MIN_CHUNK_=int(min_chunk), BALANCED=bool(balanced),
            num_warps=4,
        )
    return out


def plan_splits(kv_lens: list[int], max_splits: int, balanced: bool = True, block_n: int = 32,
                min_chunk: int = MIN_CHUNK) -> tuple[list[int], list[int]]:
    """Host mirror of the kernels' split plan (for tests and reports): (split length, number of splits) per
    sequence. The kernels compute the same on the device."""
    lens = [max(int(k), 0) for k in kv_lens]
    if balanced:
        denom = max(len(lens) * max_splits - len(lens), 1)
        chunk = _cdiv(max(_cdiv(sum(lens), denom), min_chunk), block_n) * block_n
        chunks = [chunk] * len(lens)
    else:
        chunks = [_cdiv(_cdiv(max(k, 1), max_splits), block_n) * block_n for k in lens]
    return chunks, [_cdiv(k, c) for k, c in zip(lens, chunks)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
