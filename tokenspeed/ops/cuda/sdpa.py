"""Causal attention over a varlen batch through PyTorch's fused scaled_dot_product_attention (CUDA).

Same contract as `tokenspeed.ops.mla_attention_expanded` (bottom-right aligned causal mask, q_len <= k_len);
runs in q.dtype with the fused kernels' fp32 softmax. One SDPA call per sequence (prefill chunks are few and long).

A chunk of L new tokens behind a cached history of P = k_len - L rows needs a bottom-right causal mask. Built as an
explicit [L, k_len] boolean mask it takes SDPA off its fast path: one layer of Kimi-Linear's MLA (32 heads,
192 / 128) for 1300 new tokens on a 64K history ran at 308 TFLOP/s. So the chunk runs as two unmasked calls
through cuDNN (`split_worth`), the history (no mask) and the chunk's own square (is_causal), each returning its
log-sum-exp, merged in fp32 (`merge_partials`): 513 TFLOP/s on the same shape, 583 for an 8K chunk on a 40K
history (`benchmarks/results/mla_expanded_h200_*.json`).

cuDNN plans. PyTorch's cuDNN attention builds a plan for each exact (query length, key length) pair it meets: 45 ms
(masked) to 90 ms (split) of host time on an H200 at every new pair (`benchmarks/results/sdpa_first_call_h200_*`),
and every turn of a multi-turn session brings new pairs. With TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 in the environment
before the process's first cuDNN attention call, PyTorch keys the calls whose q, k, v and output are [B, S, H, D] in
memory by lengths rounded up to powers of two (cuDNN's padding mask and ragged offsets carry the true lengths): one
plan per length bucket, which `warm_plans` can build at start-up. Importing this module sets that variable unless it
is already set (0 keeps one plan per exact shape); with it on, every chunk with a history runs split (the masked form
has a mask tensor, which keeps exact-shape plans), and queries, keys and values are passed [S, H, D]-major.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

# With exact-shape plans (bucketed plans off), split a chunk with a history when L * P is at least this (query rows x
# history rows): below it the extra launch and the merge cost more than the mask (H200: 300 new tokens on 3.8K rows
# 0.64 ms split vs 0.43 ms masked; 256 on 64K 2.58 vs 4.12 ms; 1300 on 16K 1.30 vs 2.05 ms, each with its
# expansion). With bucketed plans every chunk with a history splits.
SPLIT_MIN_WORK = 1 << 22

# (q, k, v [1, H, *, D]; causal) -> (o [1, H, L, Dv] in q.dtype, lse [1, H, L] fp32, natural log)
Attend = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]


# The PyTorch variable that keys cuDNN attention plans by power-of-two length buckets (module docstring). Read by
# PyTorch once, at the process's first cuDNN attention call: set here, at import, before any call of ours.
BUCKETED_PLANS_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
os.environ.setdefault(BUCKETED_PLANS_ENV, "1")
# Rows past a sequence's last query / key that a bucketed cuDNN call may touch (its tiles span at most 128 rows):
# callers allocate them (`padded_rows`) so that no read leaves the allocation.
ROW_SLACK = 128

_log = logging.getLogger(__name__)
# Set False (with a warning) the first time cuDNN refuses a call with log-sum-exp: every later chunk then takes one
# SDPA call (masked where it has a history).
_split_ok = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available()


def bucketed_plans() -> bool:
    """Whether cuDNN attention plans are keyed by power-of-two length buckets (BUCKETED_PLANS_ENV on)."""
    return os.environ.get(BUCKETED_PLANS_ENV, "").strip().lower() in ("1", "true", "on", "yes")


def split_worth(q_len: int, history: int) -> bool:
    """Whether a chunk of q_len new tokens on `history` cached rows runs split: always with bucketed plans (the
    masked call would build a plan per shape), else where the work reaches `SPLIT_MIN_WORK`."""
    return _split_ok and history > 0 and (bucketed_plans() or q_len * history >= SPLIT_MIN_WORK)


def padded_rows(rows: int, *shape: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """An uninitialised [rows, *shape] tensor whose storage has ROW_SLACK more rows (the bucketed cuDNN calls')."""
    return torch.empty(rows + ROW_SLACK, *shape, dtype=dtype, device=device)[:rows]


def cudnn_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """cuDNN's fused attention with its log-sum-exp (the op behind SDPA's cuDNN backend; is_causal is top-left,
    so callers pass causal only for square calls)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2])


def merge_partials(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Softmax-weighted merge of two attentions of the same queries over disjoint key sets: o [..., L, Dv] with
    lse [..., L] (natural log). Returns o1's dtype, merged in fp32."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    o = o1.float() * w1.unsqueeze(-1) + o2.float() * w2.unsqueeze(-1)
    return (o / (w1 + w2).unsqueeze(-1)).to(o1.dtype)


def attend_split(qn: Tensor, kn: Tensor, vn: Tensor, scale: float, attend: Attend | None = None) -> Tensor:
    """Bottom-right causal attention of qn [1, H, L, D] over kn / vn [1, H, S, D] (S > L) as the history part
    (keys 0..S-L-1, every query sees all of them) and the square part (is_causal), merged. Returns [1, H, L, Dv].
    `attend` defaults to `cudnn_attend`."""
    attend = attend or cudnn_attend
    L, S = qn.shape[2], kn.shape[2]
    o_hist, lse_hist = attend(qn, kn[:, :, : S - L], vn[:, :, : S - L], False, scale)
    o_tail, lse_tail = attend(qn, kn[:, :, S - L:], vn[:, :, S - L:], True, scale)
    return merge_partials(o_hist, lse_hist, o_tail, lse_tail)


def attention_expanded(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: list[int], cu_seqlens_k: list[int],
                       scale: float) -> Tensor:
    """Causal attention of q [T, H, D] over k [S, H, D] / v [S, H, Dv] per sequence (bottom-right aligned), one
    call per sequence (two where it runs split). Returns [T, H, Dv] in q.dtype. With bucketed plans, q is copied
    into rows with ROW_SLACK spare (T rows are few), and k / v are too unless their storage already has the slack
    (the MLA layer's expansion allocates it: `padded_rows`)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if bucketed_plans() and q.is_cuda:
        q = _with_slack(q, q.shape[0])
        k, v = _with_slack(k, cu_seqlens_k[-1]), _with_slack(v, cu_seqlens_k[-1])
    for n in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[n], cu_seqlens_q[n + 1], cu_seqlens_k[n], cu_seqlens_k[n + 1]
        if qe == qs:
            continue
        # [1, H, L, D]: the fused (flash / memory-efficient) kernels take 4-D inputs only
        qn, kn, vn = (t.transpose(0, 1).unsqueeze(0).to(q.dtype) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        ql, kl = qe - qs, ke - ks
        if ql == kl:
            o = _attend_square(qn, kn, vn, scale)
        else:
            o = _attend_with_history(qn, kn, vn, scale)
        out[qs:qe] = o.squeeze(0).transpose(0, 1)
    return out


def _with_slack(t: Tensor, rows: int) -> Tensor:
    """t [N, ...] itself when it is contiguous and its storage holds ROW_SLACK rows past row `rows`; else a copy of
    it in `padded_rows` (contiguous)."""
    row_bytes = t.stride(0) * t.element_size()
    end = t.storage_offset() * t.element_size() + (rows + ROW_SLACK) * row_bytes
    if t.is_contiguous() and t.untyped_storage().nbytes() >= end:
        return t
    padded = padded_rows(t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
    return padded.copy_(t)


def _attend_square(qn: Tensor, kn: Tensor, vn: Tensor, scale: float) -> Tensor:
    """Causal attention of a chunk with no history: with bucketed plans the cuDNN call `warm_plans` builds a plan
    for, else SDPA's choice of fused kernel."""
    if bucketed_plans() and _split_ok:
        try:
            return cudnn_attend(qn, kn, vn, True, scale)[0]
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _refused(e)
    return F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, scale=scale)


def _refused(e: RuntimeError) -> None:
    """cuDNN refused a call with log-sum-exp: every later call takes SDPA's own choice (logged once)."""
    global _split_ok
    _split_ok = False
    _log.warning("cuDNN attention with log-sum-exp refused (%s); chunks now use one SDPA call each (a masked one "
                 "where they have a history)", e)


def _attend_with_history(qn: Tensor, kn: Tensor, vn: Tensor, scale: float) -> Tensor:
    """Bottom-right causal attention of qn [1, H, L, D] over kn / vn [1, H, S, D], S > L: split where it pays,
    else one SDPA call with an explicit mask."""
    ql, kl = qn.shape[2], kn.shape[2]
    if split_worth(ql, kl - ql):
        try:
            return attend_split(qn if bucketed_plans() else qn.contiguous(), kn, vn, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a cuDNN build or GPU without this fused attention: fall back, once, loudly
            _refused(e)
    pos = torch.arange(ql, device=qn.device)[:, None] + (kl - ql)
    mask = torch.arange(kl, device=qn.device)[None, :] <= pos
    return F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, scale=scale)


def length_buckets(limit: int) -> list[int]:
    """The power-of-two length buckets 1, 2, 4, ... up to the one holding `limit`."""
    return [1 << b for b in range(max(limit - 1, 0).bit_length() + 1)]


def warm_plans(heads: int, d_qk: int, d_v: int, max_q: int, max_kv: int, dtype: torch.dtype,
               device: torch.device | str) -> int:
    """Build the bucketed cuDNN plans a chunk of up to max_q new tokens on up to max_kv keys can meet: each query
    bucket's causal square, then its history part at each key bucket (key buckets ascending), each run once on the
    smallest lengths of its buckets. Returns the number of calls made (0 without bucketed plans or cuDNN). Scratch:
    random [rows, heads, d] tensors, up to max_kv rows; out of memory stops the warm-up with a warning (the larger
    buckets then build their plans at first use) and frees the scratch. Changes nothing else."""
    if not (bucketed_plans() and _split_ok):
        return 0
    max_q = min(max_q, max_kv)
    q_rows = [b // 2 + 1 for b in length_buckets(max_q)]  # the smallest length in each bucket
    kv_rows = [min(b // 2 + 1, max_kv) for b in length_buckets(max_kv)]
    calls = 0
    try:
        with torch.no_grad():
            q = padded_rows(max(q_rows), heads, d_qk, dtype=dtype, device=device).normal_()
            for i, kl in enumerate([max(q_rows), *kv_rows]):  # the squares' keys, then one per key bucket
                k = padded_rows(kl, heads, d_qk, dtype=dtype, device=device).normal_()
                v = padded_rows(kl, heads, d_v, dtype=dtype, device=device).normal_()
                for ql in q_rows:
                    square = i == 0
                    cudnn_attend(_heads(q, ql), _heads(k, ql if square else kl), _heads(v, ql if square else kl),
                                 square, 1.0)
                    calls += 1
                del k, v
    except torch.OutOfMemoryError:
        _log.warning("out of memory building cuDNN attention plans after %d calls (keys up to %d rows asked); the "
                     "larger length buckets build theirs at first use", calls, max_kv)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return calls
    if max_q >= 4 and max_kv >= 6 and not plans_reused(heads, d_qk, d_v, dtype, device):
        _log.warning("cuDNN attention plans are not reused across lengths in one bucket: PyTorch read %s before "
                     "tokenspeed set it (a cuDNN attention call ran earlier in this process), so every new "
                     "(new tokens, keys) length pair builds a plan, tens of ms each; set %s=1 in the environment "
                     "before starting Python", BUCKETED_PLANS_ENV, BUCKETED_PLANS_ENV)
    return calls


# A call at new lengths inside a built bucket that takes longer than this built a plan of its own (an H200 builds one
# in 37-90 ms and runs such a small call in about 0.1 ms).
PLAN_BUILT_S = 0.01


def plans_reused(heads: int, d_qk: int, d_v: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a history call at lengths new to this process but inside buckets `warm_plans` built (4 new tokens on
    6 keys: buckets 4 and 8) runs without building a plan: PyTorch keys plans by bucket only when it read
    BUCKETED_PLANS_ENV as on at its first cuDNN attention call. Wall time of one small call; changes nothing."""
    q = padded_rows(4, heads, d_qk, dtype=dtype, device=device).normal_()
    k = padded_rows(6, heads, d_qk, dtype=dtype, device=device).normal_()
    v = padded_rows(6, heads, d_v, dtype=dtype, device=device).normal_()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        cudnn_attend(_heads(q, 4), _heads(k, 6), _heads(v, 6), False, 1.0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start < PLAN_BUILT_S


def _heads(t: Tensor, n: int) -> Tensor:
    """[1, H, n, d] view of the first n rows of t [S, H, d] (memory stays [S, H, d]-major)."""
    return t[:n].transpose(0, 1).unsqueeze(0)
