"""The MLA latent-cache write of new tokens in one launch: kv_a_layernorm + [c_kv ; k_pe] + the store.

    mla_norm_store_latent(kv_c, k_pe, weight, eps, cache, slot_mapping, kv_scale)
    == mla_store_latent(cat([rms_norm(kv_c, weight, eps), k_pe], -1), cache, slot_mapping, kv_scale)

(`tokenspeed.ops.reference.mla.mla_norm_store_latent`), which is three launches and two temporaries in torch (the
norm, the concatenation, the index_put) and one here: a program per token loads its kv_c row and its k_pe row
(strided views of the kv_a projection, read in place), normalises kv_c, and writes the latent row
[c_kv ; k_pe] of the cache at slot_mapping[t].

Rounding is that of the composition: the norm rounds like `ops.rms_norm` (normed = cast(x * rsqrt(mean(x^2) +
eps), x.dtype), then cast(w * normed, x.dtype)), so c_kv is the activation-dtype tensor the reference
concatenates; with kv_scale != 1 both parts are then divided by kv_scale in fp32 (IEEE division) and rounded once
to the cache dtype, else rounded directly. For an fp8 e4m3 cache the rounding is to nearest even, as torch's;
torch turns values beyond the fp8 range into NaN where the Triton conversion saturates to +-448 (the store is
meant to be scaled so that this never happens).

PDL (`tokenspeed.ops.triton.pdl`): the norm weight (no kernel writes it) is loaded before `gdc_wait`; kv_c / k_pe
(the projection just before) and slot_mapping (a host-to-device copy of this step) after it.

`mla_norm_store_absorb` adds the W_UK absorption of the decode queries to the same launch (the model's bmm
q_lat = q_nope @ W_UK[h] otherwise costs a launch of its own): programs 0..T-1 store the latent rows as above,
the others each compute a [16 tokens, 128 latent columns] block of one head's q_lat with tl.dot (fp32
accumulation, IEEE in fp32, rounded once to q_nope's dtype, as the bmm), their W_UK block (kv_b_proj's weight)
loaded before the PDL wait and q_nope after it. The two parts write disjoint memory (cache rows, q_lat), so their
order inside the launch does not matter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@triton.jit
def _norm_store_row(t, C, stride_c, PE, stride_pe, W, CACHE, stride_cp, stride_cr, SLOTS, D, eps, kv_scale,
                    DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                    SCALED: tl.constexpr, PDL: tl.constexpr):
    """Token t's latent row: norm of kv_c, [c_kv ; k_pe], the store at slot_mapping[t] (executes the PDL wait)."""
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)  # a weight: safe to read before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(C + t * stride_c + cols, mask=cmask, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)  # rounded to the activation dtype before the gain (rms_norm)
    y = (w * normed).to(x.dtype)
    rc = tl.arange(0, BLOCK_R)
    rmask = rc < DR
    pe = tl.load(PE + t * stride_pe + rc, mask=rmask, other=0.0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    row = CACHE + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_cr
    OUT = CACHE.dtype.element_ty
    if SCALED:  # the reference divides the fp32 values by kv_scale, then rounds once
        y_out = tl.div_rn(y.to(tl.float32), kv_scale).to(OUT)
        pe_out = tl.div_rn(pe.to(tl.float32), kv_scale).to(OUT)
    else:  # through fp32 (exact from 16 bits): one rounding to the cache dtype, fp8 included
        y_out = y.to(tl.float32).to(OUT)
        pe_out = pe.to(tl.float32).to(OUT)
    tl.store(row + cols, y_out, mask=cmask)
    tl.store(row + D + rc, pe_out, mask=rmask)


@triton.jit
def _norm_store_kernel(
    C, stride_c, PE, stride_pe, W, CACHE, stride_cp, stride_cr, SLOTS,
    D, eps, kv_scale,
    DR: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    _norm_store_row(tl.program_id(0).to(tl.int64), C, stride_c, PE, stride_pe, W, CACHE, stride_cp, stride_cr,
                    SLOTS, D, eps, kv_scale, DR, PAGE, BLOCK_D, BLOCK_R, SCALED, PDL)


@triton.jit
def _absorb_block(a, T, QN, stride_qt, stride_qh, WUK, stride_wh, stride_wn, QL,
                  H: tl.constexpr, NOPE: tl.constexpr, RANK: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """Absorption block a = (token block tb, latent block lb, head h), h fastest: q_lat[t, h, l] =
    sum_k q_nope[t, h, k] W_UK[h, k, l] for BLOCK_T tokens and BLOCK_L latent columns, one tl.dot with fp32
    accumulation (IEEE for fp32), rounded once to q_lat's dtype (what the bmm does). Executes the PDL wait."""
    CT = QL.dtype.element_ty
    LB: tl.constexpr = (RANK + BLOCK_L - 1) // BLOCK_L
    h = a % H
    lb = (a // H) % LB
    tb = a // (H * LB)
    k = tl.arange(0, BLOCK_K)
    cols = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    kmask = k < NOPE
    lmask = cols < RANK
    w = tl.load(WUK + h.to(tl.int64) * stride_wh + k[:, None] * stride_wn + cols[None, :],
                mask=kmask[:, None] & lmask[None, :], other=0.0).to(CT)  # kv_b_proj's weight: before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    toks = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = toks < T
    q = tl.load(QN + toks[:, None] * stride_qt + h * stride_qh + k[None, :], mask=tmask[:, None] & kmask[None, :],
                other=0.0).to(CT)
    if CT == tl.float32:
        acc = tl.dot(q, w, input_precision="ieee")
    else:
        acc = tl.dot(q, w)
    tl.store(QL + (toks[:, None] * H + h) * RANK + cols[None, :], acc.to(CT), mask=tmask[:, None] & lmask[None, :])


@triton.jit(do_not_specialize=["T"])  # per-step counts: no recompile per value
def _norm_store_absorb_kernel(
    C, stride_c, PE, stride_pe, W, CACHE, stride_cp, stride_cr, SLOTS,
    eps, kv_scale,
    T, QN, stride_qt, stride_qh, WUK, stride_wh, stride_wn, QL,
    RANK: tl.constexpr,
    DR: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALED: tl.constexpr,
    H: tl.constexpr,
    NOPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PDL: tl.constexpr,
):
    """Programs 0..T-1: the latent-row store of token p (`_norm_store_row`); the rest: absorption blocks."""
    p = tl.program_id(0)
    if p < T:
        _norm_store_row(p.to(tl.int64), C, stride_c, PE, stride_pe, W, CACHE, stride_cp, stride_cr, SLOTS, RANK,
                        eps, kv_scale, DR, PAGE, BLOCK_D, BLOCK_R, SCALED, PDL)
    else:
        _absorb_block(p - T, T, QN, stride_qt, stride_qh, WUK, stride_wh, stride_wn, QL, H, NOPE, RANK, BLOCK_T,
                      BLOCK_K, BLOCK_L, PDL)


def _check(kv_c: Tensor, k_pe: Tensor, weight: Tensor, cache: Tensor, slot_mapping: Tensor) -> None:
    if kv_c.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(f"kv_c [T, R] and k_pe [T, DR] expected; got {tuple(kv_c.shape)}, {tuple(k_pe.shape)}")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or kv_c.dtype != k_pe.dtype or not kv_c.is_floating_point():
        raise ValueError("kv_c and k_pe must be float tensors of one dtype with unit last stride")
    r, dr = kv_c.shape[1], k_pe.shape[1]
    if weight.shape != (r,):
        raise ValueError(f"weight must be [{r}]; got {tuple(weight.shape)}")
    if cache.dim() != 3 or cache.shape[-1] != r + dr or cache.stride(-1) != 1 or cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"cache must be [P, page_size, {r + dr}] with unit last stride, dtype in {CACHE_DTYPES}; "
                         f"got {tuple(cache.shape)} {cache.dtype}")
    if slot_mapping.shape != (kv_c.shape[0],):
        raise ValueError(f"slot_mapping must be [{kv_c.shape[0]}]; got {tuple(slot_mapping.shape)}")


def mla_norm_store_latent(kv_c: Tensor, k_pe: Tensor, weight: Tensor, eps: float, cache: Tensor,
                          slot_mapping: Tensor, kv_scale: float = 1.0) -> None:
    """Triton `ops.mla_norm_store_latent` (the contract of the module docstring).

    kv_c [T, R], k_pe [T, DR]: float, one dtype, unit last stride (e.g. the two column ranges of the kv_a
    projection); weight [R]; cache [P, page_size, R + DR] fp32 / bf16 / fp16 / fp8 e4m3, unit last stride;
    slot_mapping [T] int, valid flat rows (page * page_size + offset). Mutates only cache rows slot_mapping[t]."""
    _check(kv_c, k_pe, weight, cache, slot_mapping)
    T, r = kv_c.shape
    if T == 0:
        return
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    block_d = next_pow2(r)
    _norm_store_kernel[(T,)](
        kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), weight, cache, cache.stride(0), cache.stride(1), slots,
        r, float(eps), float(kv_scale),
        DR=k_pe.shape[1], PAGE=cache.shape[1], BLOCK_D=block_d, BLOCK_R=next_pow2(k_pe.shape[1]),
        SCALED=float(kv_scale) != 1.0, PDL=pdl.enabled(kv_c.device, "mla"),
        num_warps=4 if block_d >= 512 else (2 if block_d >= 128 else 1), **pdl.launch_kwargs(kv_c.device, "mla"),
    )


# The absorption's tiles: BLOCK_T tokens (tl.dot needs 16 rows; decode pads) x ABSORB_BLOCK_L latent columns of one
# head. At Kimi-Linear's H 32, r 512 and batch <= 16 that is 32 x 4 = 128 programs (one wave of an H200's 132 SMs),
# each streaming a 32 KB [128, 128] bf16 block of W_UK (4 MB in all) before its PDL wait.
ABSORB_BLOCK_T = 16
ABSORB_BLOCK_L = 128


def _check_absorb(q_nope: Tensor, w_uk: Tensor, r: int, out: Tensor | None) -> tuple[int, int]:
    """Validates the absorption operands; returns (H, nope)."""
    if q_nope.dim() != 3 or q_nope.stride(-1) != 1 or q_nope.dtype not in (torch.float32, torch.bfloat16,
                                                                            torch.float16):
        raise ValueError(f"q_nope must be a float [T, H, nope] tensor with unit last stride; got "
                         f"{tuple(q_nope.shape)} {q_nope.dtype}")
    T, H, nope = q_nope.shape
    if w_uk.shape != (H, nope, r) or w_uk.stride(-1) != 1 or not w_uk.is_floating_point():
        raise ValueError(f"w_uk must be a float [{H}, {nope}, {r}] view with unit last stride; got {tuple(w_uk.shape)}")
    if out is not None and (out.shape != (T, H, r) or out.dtype != q_nope.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{T}, {H}, {r}] tensor of q_nope's dtype")
    return H, nope


def mla_norm_store_absorb(kv_c: Tensor, k_pe: Tensor, weight: Tensor, eps: float, cache: Tensor,
                          slot_mapping: Tensor, kv_scale: float, q_nope: Tensor, w_uk: Tensor,
                          out: Tensor | None = None) -> Tensor:
    """`mla_norm_store_latent` and the W_UK absorption of the queries in one launch:

        mla_norm_store_latent(kv_c, k_pe, weight, eps, cache, slot_mapping, kv_scale)
        q_lat = bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)     # [T, H, r]

    q_nope [T, H, nope] float, any token / head strides (e.g. the nope columns of the q projection, read in
    place); w_uk [H, nope, r] (the W_UK view of kv_b_proj's weight, cast to q_nope's dtype in the kernel). The
    product is accumulated in fp32 (IEEE for fp32) and rounded once to q_nope's dtype. Returns q_lat [T, H, r]
    contiguous (or writes `out`); mutates only `out` and the cache rows slot_mapping[t]. The two parts touch
    disjoint memory, so programs 0..T-1 store the latent rows and the others each absorb a [16, 128] block."""
    _check(kv_c, k_pe, weight, cache, slot_mapping)
    T, r = kv_c.shape
    H, nope = _check_absorb(q_nope, w_uk, r, out)
    if q_nope.shape[0] != T:
        raise ValueError(f"q_nope must have kv_c's {T} tokens; got {q_nope.shape[0]}")
    if out is None:
        out = torch.empty(T, H, r, dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return out
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    block_d, block_l = next_pow2(r), min(ABSORB_BLOCK_L, next_pow2(r))
    absorb = triton.cdiv(T, ABSORB_BLOCK_T) * triton.cdiv(r, block_l) * H
    _norm_store_absorb_kernel[(T + absorb,)](
        kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), weight, cache, cache.stride(0), cache.stride(1), slots,
        float(eps), float(kv_scale),
        T, q_nope, q_nope.stride(0), q_nope.stride(1), w_uk, w_uk.stride(0), w_uk.stride(1), out,
        RANK=r, DR=k_pe.shape[1], PAGE=cache.shape[1], BLOCK_D=block_d, BLOCK_R=next_pow2(k_pe.shape[1]),
        SCALED=float(kv_scale) != 1.0, H=H, NOPE=nope, BLOCK_T=ABSORB_BLOCK_T, BLOCK_K=max(16, next_pow2(nope)),
        BLOCK_L=block_l, **pdl.kernel_kwargs(kv_c.device, "mla"),
        num_warps=4,
    )
    return out
