"""The fused MLA cache write (`mla_norm_store_latent`: kv_a_layernorm + [c_kv ; k_pe] + store, one launch) and
the absorbed query passed as two views (`mla_decode(..., q_rope=...)`), against their compositions.

Checked (interpreter): kv_c / k_pe read in place as strided column ranges of one kv_a projection; scattered slots
over pages (rows not in slot_mapping stay NaN); the written rows equal the composition through the Triton
`rms_norm` bit for bit (fp32, with and without kv_scale, and bf16) and the torch reference within one fp32
rounding; the public op routes to the kernel (TOKENSPEED_OPS=triton), to the reference (reference mode, or a
call outside the region) and both write the same rows; q / q_rope views give the same bits as the concatenated
query, through the kernel and through the reference. CUDA: bf16 and fp8 (kv_scale) caches against the
composition of the CUDA ops, and PDL on and off.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter

R, DR, PAGE, PAGES = 64, 16, 4, 6


def make(T: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: str = "cpu", seed: int = 0, r: int = R,
         dr: int = DR):
    """(kv_a [T, r + dr + 8] whose column ranges are kv_c and k_pe, weight [r], a NaN cache, slots [T])."""
    g = torch.Generator().manual_seed(seed)
    kv_a = (torch.randn(T, r + dr + 8, generator=g) * 3).to(dtype).to(device)
    w = (torch.rand(r, generator=g) + 0.5).to(dtype).to(device)
    cache = torch.full((PAGES, PAGE, r + dr), float("nan")).to(cache_dtype).to(device)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:T].to(device)
    return kv_a, w, cache, slots


def views(kv_a: torch.Tensor, r: int = R, dr: int = DR) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_a[:, :r], kv_a[:, r:r + dr]


def composition(kv_a, w, cache, slots, kv_scale, norm_fn, r: int = R, dr: int = DR) -> torch.Tensor:
    """What the model did before the fusion: norm, cat, `mla_store_latent`; returns the written cache."""
    from tokenspeed.ops.reference.mla import mla_store_latent

    out = cache.clone()
    kv_c, k_pe = views(kv_a, r, dr)
    mla_store_latent(torch.cat([norm_fn(kv_c, w, 1e-6), k_pe], dim=-1), out, slots, kv_scale)
    return out


def assert_rows(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, exact: bool, tol: float = 0.0) -> None:
    """The rows at `slots` equal (or are within tol of) `want`'s; every other row is still NaN."""
    gf, wf = got.float().view(-1, got.shape[-1]), want.float().view(-1, want.shape[-1])
    written = torch.zeros(gf.shape[0], dtype=torch.bool, device=gf.device)
    written[slots] = True
    assert torch.isnan(gf[~written]).all(), "a row outside slot_mapping was written"
    if exact:
        assert torch.equal(gf[written], wf[written])
    else:
        assert rel_err(gf[written], wf[written]) < tol


@cpu_interp
@pytest.mark.parametrize("kv_scale", [1.0, 0.37])
@pytest.mark.parametrize("T", [1, 5])
def test_interp_fp32_bitwise(T: int, kv_scale: float) -> None:
    from tokenspeed.ops.reference.norm import rms_norm as ref_norm
    from tokenspeed.ops.triton.mla_prep import mla_norm_store_latent
    from tokenspeed.ops.triton.norm import rms_norm as triton_norm

    kv_a, w, cache, slots = make(T, torch.float32, torch.float32, seed=T)
    got = cache.clone()
    mla_norm_store_latent(*views(kv_a), w, 1e-6, got, slots, kv_scale)
    assert_rows(got, composition(kv_a, w, cache, slots, kv_scale, triton_norm), slots, exact=True)
    assert_rows(got, composition(kv_a, w, cache, slots, kv_scale, ref_norm), slots, exact=False, tol=1e-6)


@cpu_interp
def test_interp_bf16_and_odd_widths() -> None:
    """bf16 activations and cache; widths that are not powers of two (masked columns)."""
    from tokenspeed.ops.triton.mla_prep import mla_norm_store_latent
    from tokenspeed.ops.triton.norm import rms_norm as triton_norm

    for dtype, r, dr in ((torch.bfloat16, R, DR), (torch.float32, 40, 6)):
        kv_a, w, cache, slots = make(3, dtype, dtype, seed=7, r=r, dr=dr)
        got = cache.clone()
        mla_norm_store_latent(*views(kv_a, r, dr), w, 1e-6, got, slots)
        assert_rows(got, composition(kv_a, w, cache, slots, 1.0, triton_norm, r, dr), slots, exact=True)


@cpu_interp
def test_public_op_dispatch(monkeypatch) -> None:
    """TOKENSPEED_OPS=triton runs the kernel, reference mode and out-of-region calls the reference; same rows."""
    from tokenspeed import ops
    from tokenspeed.ops.triton import mla_prep

    calls = []
    real = mla_prep.mla_norm_store_latent
    monkeypatch.setattr(mla_prep, "mla_norm_store_latent", lambda *a, **k: calls.append(1) or real(*a, **k))
    kv_a, w, cache, slots = make(4, torch.float32, torch.float32, seed=2)
    outs = {}
    for mode in ("triton", "reference"):
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
        outs[mode] = cache.clone()
        ops.mla_norm_store_latent(*views(kv_a), w, 1e-6, outs[mode], slots, 0.5)
    assert calls == [1]
    assert_rows(outs["triton"], outs["reference"], slots, exact=False, tol=1e-6)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    kv_c, k_pe = views(kv_a)
    mixed = cache.clone()
    ops.mla_norm_store_latent(kv_c, k_pe.double(), w, 1e-6, mixed, slots, 0.5)  # dtypes differ: reference
    assert calls == [1]
    assert_rows(mixed, outs["reference"], slots, exact=False, tol=1e-6)


def test_validation() -> None:
    from tokenspeed.ops.triton.mla_prep import mla_norm_store_latent

    kv_a, w, cache, slots = make(2, torch.float32, torch.float32)
    kv_c, k_pe = views(kv_a)
    with pytest.raises(ValueError, match="weight"):
        mla_norm_store_latent(kv_c, k_pe, w[:-1], 1e-6, cache, slots)
    with pytest.raises(ValueError, match="cache"):
        mla_norm_store_latent(kv_c, k_pe[:, :-1], w, 1e-6, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_norm_store_latent(kv_c, k_pe, w, 1e-6, cache, slots[:1])


# ----------------------------------------------------------------------------- mla_decode with q_rope
def _decode_case(seed: int = 0):
    from tests.ops.test_triton_mla_decode import make as make_decode

    return make_decode([9, 40, 0], 2, 4, 40, 4, torch.float32, torch.float32, "cpu", seed=seed)


@cpu_interp
@pytest.mark.parametrize("max_splits", [1, 4])
def test_interp_q_rope_views_equal_concatenated(max_splits: int) -> None:
    """q [.., v_dim] and q_rope [.., Dl - v_dim] as strided views of wider buffers: the same bits as the full q."""
    from tokenspeed.ops.triton.mla_decode import mla_decode

    inp = _decode_case(1)
    q = inp["q"]
    args = (inp["cache"], inp["page_table"], inp["kv_lens"], 0.3, 32)
    full = mla_decode(q, *args, max_splits=max_splits, BLOCK_N=16, min_chunk=16)
    lat = torch.randn(4, 2, 3, 36).transpose(0, 2)  # [3, 2, 4, 36]: non-contiguous leading dims
    lat[..., :32] = q[..., :32]
    rope = torch.randn(3, 2, 4, 20)
    rope[..., 4:12] = q[..., 32:]
    split = mla_decode(lat[..., :32], *args, q_rope=rope[..., 4:12], max_splits=max_splits, BLOCK_N=16,
                       min_chunk=16)
    assert torch.equal(split, full)


@cpu_interp
def test_public_mla_decode_q_rope(monkeypatch) -> None:
    """ops.mla_decode with q_rope: the reference (concatenation inside) and the kernel agree with the full q."""
    from tokenspeed import ops

    inp = _decode_case(2)
    q = inp["q"]
    args = (inp["cache"], inp["page_table"], inp["kv_lens"], 0.3, 32)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    ref_full = ops.mla_decode(q, *args)
    assert torch.equal(ops.mla_decode(q[..., :32], *args, q_rope=q[..., 32:]), ref_full)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    assert ops.dispatch.mla_decode_supported(q[..., :32], inp["cache"], 32, q_rope=q[..., 32:])
    assert not ops.dispatch.mla_decode_supported(q[..., :32], inp["cache"], 32, q_rope=q[..., 33:])
    assert rel_err(ops.mla_decode(q[..., :32], *args, q_rope=q[..., 32:]), ref_full) < 1e-5


def test_q_rope_validation() -> None:
    from tokenspeed.ops.triton.mla_decode import mla_decode

    inp = _decode_case()
    q = inp["q"]
    args = (inp["cache"], inp["page_table"], inp["kv_lens"], 0.3, 32)
    with pytest.raises(ValueError, match="latent part only"):
        mla_decode(q, *args, q_rope=q[..., 32:])
    with pytest.raises(ValueError, match="q_rope"):
        mla_decode(q[..., :32], *args, q_rope=q[:1, ..., 32:])
    with pytest.raises(ValueError, match="cache"):
        mla_decode(q[..., :32], *args, q_rope=q[..., 34:])


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pdl_on", ["1", "0"])
@pytest.mark.parametrize("cache_dtype,kv_scale,tol", [(torch.bfloat16, 1.0, 1e-2), (torch.float8_e4m3fn, 0.25, 7e-2)])
def test_cuda_real_shapes(monkeypatch, pdl_on: str, cache_dtype, kv_scale: float, tol: float) -> None:
    """Kimi's widths (512 + 64), bf16 kv_a; against the CUDA ops' composition (Triton rms_norm, cat, index_put)."""
    from tokenspeed import ops
    from tokenspeed.ops.triton.mla_prep import mla_norm_store_latent

    monkeypatch.setenv("TOKENSPEED_PDL", pdl_on)
    for T in (1, 7):
        kv_a, w, cache, slots = make(T, torch.bfloat16, cache_dtype, "cuda", seed=T, r=512, dr=64)
        got = cache.clone()
        mla_norm_store_latent(*views(kv_a, 512, 64), w, 1e-6, got, slots, kv_scale)
        want = composition(kv_a, w, cache, slots, kv_scale, ops.rms_norm, 512, 64)
        assert_rows(got, want, slots, exact=False, tol=tol)
