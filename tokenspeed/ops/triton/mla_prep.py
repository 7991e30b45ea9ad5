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
    t = tl.program_id(0).to(tl.int64)
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
