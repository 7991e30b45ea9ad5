"""A MoE layer's FFN junction fused into the next layer's first projection (decode sizes, M <= 4 rows).

The unfused chain at the end of a hidden-space MoE layer is down (the per-pair buffer) -> `combine_add_rms_norm`
(f = cast(sum_j w_j * buf_j), summed = cast(residual + f), normed = rms_norm(summed)) -> the next layer's input
projection y = normed @ W^T (KDA's merged in_proj, MLA's merged q / kv_a). At batch 1 the middle launch moves
~50 KB and costs ~3 us, most of it launch and dependency latency. `junction_gemv` folds it into the projection's
tensor-core GEMV (`gemv._gemv_dot_kernel`, same tiles, split-K and fused reduction as the routing table gives the
plain projection):

1. prologue, after the PDL wait: every program computes the junction for the whole rows, with the expressions,
   roundings and one-row tiles of `moe_combine._combine_norm_kernel` (so normed is that kernel's, bit for bit,
   where the reduction layout matches: the same BLOCK_D and warps), and writes normed into its own scratch rows
   (L2; ~5 KB a row); the program (0, 0) also stores summed, the new residual stream;
2. a CTA barrier, then the GEMV's K loop over its K range with x read from that scratch.

The prologue reads the buffer and the residual from L2 (the down launch just wrote them) once per program
instead of once per K step: the K loop is the plain GEMV's, and only the prologue's latency (the whole row's
loads, one reduction) sits before it. (A first form built each K step's x tile from the buffer inside the loop
and lost: ~0.8 us a step on every weight tile's critical path; benchmarks/README.md, 1d2e0ba.)

PDL (`tokenspeed.ops.triton.pdl`): the first weight tile is read before the wait ("regs"; weights are never
written by a kernel); the buffer, the routing weights and the residual only after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import gemv as _gemv
from tokenspeed.ops.triton.gemv import _epilogue, _load_k_step, _load_tile, _mma, _pre_wait, _tiles

MAX_M = 4
DOT_M = 16  # rows of x the MMA takes (the tensor-core GEMV's padding)


@triton.jit
def _junction_rows(Buf, TopkW, Res, NormW, S, X, M, K, eps, stride_buf, stride_res, store_rows,
                   TOP_K: tl.constexpr, BLOCK_MC: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows 0..M-1 of the junction, each as one [1, BLOCK_D] tile (BLOCK_D >= K), expression for expression
    `_combine_norm_kernel` without `add`: S[m] = cast(Res[m] + cast(sum_j w_j buf_j)) (rows < store_rows stored),
    X[m] = cast(norm_weight * cast(S[m] * inv)) (X: contiguous [M, K] rows, this program's scratch)."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    cmask = cols < K
    nw = tl.load(NormW + tl.arange(0, BLOCK_D), mask=tl.arange(0, BLOCK_D) < K, other=0.0).to(tl.float32)
    for m in tl.static_range(BLOCK_MC):
        r = tl.minimum(m, M - 1).to(tl.int64)
        res = tl.load(Res + r * stride_res + cols, mask=cmask, other=0.0)
        acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            wj = tl.load(TopkW + r * TOP_K + j)
            acc += wj * tl.load(Buf + (r * TOP_K + j) * stride_buf + cols, mask=cmask, other=0.0).to(tl.float32)
        f = acc.to(S.dtype.element_ty)  # the FFN output as the unfused combine rounds it
        x = (res.to(tl.float32) + f.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + r * K + cols, x, mask=cols < tl.where(m < store_rows, K, 0))
        x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)
        normed = (x * inv[:, None]).to(S.dtype.element_ty).to(tl.float32)
        tl.store(X + m * K + cols, (nw[None, :] * normed).to(X.dtype.element_ty), mask=cols < tl.where(m < M, K, 0))


@triton.jit(do_not_specialize_on_alignment=["M"])
def _gemv_junction_kernel(
    Buf, TopkW, Res, NormW, S, Xs, W, Out, Y, Sem,
    M, N, K, k_split, eps, stride_buf, stride_res, stride_wn, stride_os, stride_om,
    TOP_K: tl.constexpr,
    BLOCK_MC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    X = Xs + program.to(tl.int64) * M * K  # this program's scratch rows [M, K]
    pid_s, offs_m, offs_n, offs_k, k_lo, k_hi, w_ptrs, x_ptrs = _tiles(
        X, W, M, N, K, k_split, K, 1, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    w_first = _load_tile(w_ptrs, k_lo, offs_k, K, EVEN_K)  # the first W tile before the wait
    _pre_wait(W, offs_n, N, stride_wn, k_lo, k_hi, 0, "regs", PDL)
    store_rows = tl.where(program == 0, M, 0)  # one program stores summed
    _junction_rows(Buf, TopkW, Res, NormW, S, X, M, K, eps, stride_buf, stride_res, store_rows, TOP_K, BLOCK_MC,
                   BLOCK_D)
    tl.debug_barrier()  # the scratch rows are written (by this CTA) before any thread reads them
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x = _load_tile(x_ptrs, k_lo, offs_k, K, EVEN_K)
    acc = _mma(w_first, x, acc, IEEE)
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # the plain GEMV's loop, software-pipelined
        w, x = _load_k_step(w_ptrs, x_ptrs, k0, offs_k, K, EVEN_K)
        acc = _mma(w, x, acc, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _epilogue(acc, Out, Y, Sem, M, N, pid_s, offs_m, offs_n, stride_os, stride_om, True, REDUCE_SPLITS)


def unusable_reason(buf: Tensor, topk_weights: Tensor, top_k: int, residual: Tensor, norm_weight: Tensor,
                    weight: Tensor) -> str | None:
    """None when `junction_gemv` takes these tensors, else why not (host-only: shapes, dtypes, strides)."""
    T, D = residual.shape if residual.dim() == 2 else (0, 0)
    if residual.dim() != 2 or not 1 <= T <= MAX_M:
        return f"residual must be [T, D] with 1 <= T <= {MAX_M}"
    if buf.dim() != 2 or buf.shape != (T * top_k, D) or buf.stride(1) != 1 or residual.stride(1) != 1:
        return "buf must be [T * top_k, D] and residual [T, D], both with unit column stride"
    if weight.dim() != 2 or weight.shape[1] != D or weight.stride(1) != 1 or weight.shape[0] == 0:
        return "weight must be [N, D] row-major"
    if not (residual.dtype == buf.dtype == weight.dtype) or residual.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return "buf, residual and weight must share a bf16 / fp16 / fp32 dtype"
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous() or topk_weights.numel() != T * top_k:
        return "topk_weights must be T * top_k contiguous fp32 values"
    if norm_weight.shape != (D,) or not norm_weight.is_contiguous():
        return "norm_weight must be a contiguous [D]"
    if len({t.device for t in (buf, topk_weights, residual, norm_weight, weight)}) != 1:
        return "all tensors must be on one device"
    return None


def junction_config(M: int, N: int, K: int, route: dict | None, elt_size: int, device: torch.device
                    ) -> _gemv.GemvConfig | None:
    """The fused launch's GEMV configuration: the routing table's entry for the plain projection (route:
    `ops.dispatch.linear_route`'s dict) when it is the tensor-core kind, completed by `gemv.resolve_config`;
    None when the table takes another kind or torch for this shape (then the junction is not fused)."""
    if not route or route.get("kind") != "dot":
        return None
    fields = {k: route[k] for k in ("block_n", "block_k", "split_k", "num_warps", "num_stages", "reduce")
              if k in route}
    return _gemv.resolve_config(M, N, K, elt_size, device, kind="dot", prefetch="regs", **fields)


def junction_gemv(buf: Tensor, topk_weights: Tensor, top_k: int, residual: Tensor, norm_weight: Tensor, eps: float,
                  weight: Tensor, summed: Tensor, cfg: _gemv.GemvConfig | None = None) -> Tensor:
    """y [T, N] = rms_norm(summed, norm_weight, eps) @ weight^T with summed = cast(residual + cast(sum_j
    topk_weights[t * k + j] * buf[t * k + j])) written into `summed` ([T, D] contiguous, residual's dtype; bit for
    bit `combine_add_rms_norm`'s). buf [T * k, D] (the experts' per-pair buffer), topk_weights fp32 [T * k],
    residual [T, D], norm_weight [D], weight [N, D]; 1 <= T <= MAX_M. cfg: a tensor-core `GemvConfig` (default:
    `gemv.default_config`). y is a new contiguous tensor in weight's dtype: the plain GEMV of that cfg applied to
    the junction's normed rows (see the module docstring). Mutates `summed` only. ValueError where
    `unusable_reason` says why."""
    why = unusable_reason(buf, topk_weights, top_k, residual, norm_weight, weight)
    if why is not None:
        raise ValueError(f"junction_gemv: {why}")
    T, D = residual.shape
    if summed.shape != (T, D) or summed.dtype != residual.dtype or not summed.is_contiguous():
        raise ValueError(f"summed must be a contiguous [{T}, {D}] {residual.dtype} tensor")
    N, dev = weight.shape[0], weight.device
    cfg = cfg or _gemv.default_config(T, N, D, weight.element_size(), _gemv._num_sms(dev))
    if cfg.kind != "dot":
        raise ValueError(f"junction_gemv needs the tensor-core GEMV kind; got {cfg.kind!r}")
    y = torch.empty(T, N, dtype=weight.dtype, device=dev)
    split, k_split = _gemv.effective_split(D, cfg)
    n_tiles = triton.cdiv(N, cfg.block_n)
    sem = _gemv.semaphores(dev) if split > 1 and cfg.reduce == "fused" else None
    if sem is not None and n_tiles > sem.numel():
        sem = None
    stride_s = _gemv._split_stride(T, N) if split > 1 else 0
    dst = y if split == 1 else torch.empty(split, stride_s, dtype=torch.float32, device=dev)
    scratch = torch.empty(n_tiles * split, T, D, dtype=weight.dtype, device=dev)
    num_sms, pdl_on = _gemv._num_sms_pdl(dev)
    block_d = triton.next_power_of_2(D)
    _gemv_junction_kernel[(n_tiles, split)](
        buf, topk_weights, residual, norm_weight, summed, scratch, weight, dst, y, dst if sem is None else sem,
        T, N, D, k_split, float(eps), buf.stride(0), residual.stride(0), weight.stride(0), stride_s, N,
        TOP_K=top_k, BLOCK_MC=triton.next_power_of_2(T), BLOCK_D=block_d, BLOCK_M=max(DOT_M, triton.next_power_of_2(T)),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=D % cfg.block_k == 0, IEEE=weight.dtype == torch.float32,
        REDUCE_SPLITS=1 if sem is None else split, PDL=pdl_on, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl_on else {}))
    if split > 1 and sem is None:  # the two-launch reduction
        _gemv._splitk_reduce_kernel[(triton.cdiv(T * N, 1024),)](
            dst, y, T * N, stride_s, SPLIT_K=split, BLOCK=1024, PDL=pdl_on, num_warps=4,
            **({"launch_pdl": True} if pdl_on else {}))
    return y
