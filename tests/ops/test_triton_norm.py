"""Triton RMSNorm, gated RMSNorm, residual add + RMSNorm and AttnRes mix (+ fused RMSNorm) against the torch
reference.

CPU: the Triton interpreter (fp32, small shapes; it truncates fp32 -> bf16, so bf16 is checked on CUDA only; fp16
it rounds to nearest, so `add_rms_norm`'s two roundings are checked in fp16 there: the sum bit for bit, the norm
bit for bit against the unfused Triton `rms_norm` of that sum, and a norm of the unrounded sum fails).
CUDA (`-m gpu`): K3 TP8 per-rank shapes, the kimi-linear hidden 2304 at T = 1, 64, 8192, and odd ones, bf16 within
1e-2 and fp32 within 1e-5 relative; `add_rms_norm` bit for bit against torch's add followed by the Triton
`rms_norm` (the path it replaces). Every output starts poisoned (NaN) so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter
from tokenspeed.ops.reference import attn_res as ref_attn_res
from tokenspeed.ops.reference import norm as ref_norm


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def poison(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def kernels():
    from tokenspeed.ops.triton import attn_res, norm

    return norm, attn_res


def check_rms(shape, dtype, device):
    norm, _ = kernels()
    d = shape[-1]
    x = torch.randn(shape, device=device).to(dtype) * 3
    w = (1 + 0.5 * torch.randn(d, device=device)).to(dtype)
    out = poison(shape, dtype, device)
    y = norm.rms_norm(x, w, 1e-5, out=out)
    assert y is out
    assert rel_err(y, ref_norm.rms_norm(x, w, 1e-5)) < tol(dtype)


def check_add_rms(shape, dtype, device, *, strided=False, in_place=False):
    """add_rms_norm vs the reference: poisoned outputs, summed == residual + x exactly, normed within tol.
    Returns (normed, summed, x, residual) (x, residual as passed; residual cloned before an in-place call)."""
    norm, _ = kernels()
    d = shape[-1]
    g = torch.Generator(device="cpu").manual_seed(d + len(shape))
    if strided:  # rows of a wider buffer (row stride d + 16)
        x = (torch.randn(*shape[:-1], d + 16, generator=g) * 2).to(device=device, dtype=dtype)[..., 5:5 + d]
    else:
        x = (torch.randn(shape, generator=g) * 2).to(device=device, dtype=dtype)
    residual = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
    ref_normed, ref_summed = ref_norm.add_rms_norm(x, residual, w, 1e-5)
    out = poison(shape, dtype, device)
    if in_place:
        res_in = residual.clone()
        normed, summed = norm.add_rms_norm(x, res_in, w, 1e-5, out=out, summed=res_in)
        assert summed is res_in
    else:
        summed_buf = poison(shape, dtype, device)
        normed, summed = norm.add_rms_norm(x, residual, w, 1e-5, out=out, summed=summed_buf)
        assert summed is summed_buf
    assert normed is out
    assert not torch.isnan(summed).any()
    assert torch.equal(summed, ref_summed)  # one rounding of an exact fp32 sum, in both
    assert rel_err(normed, ref_normed) < tol(dtype)
    return normed, summed, x, residual, w


def check_gated(T, H, D, dtype, device, strided: bool):
    norm, _ = kernels()
    x = torch.randn(T, H, D, device=device).to(dtype)
    if strided:  # the output-gate slice of a wider projection, read in place
        gate = torch.randn(T, H * D + 24, device=device).to(dtype)[:, 8:8 + H * D].view(T, H, D)
    else:
        gate = torch.randn(T, H, D, device=device).to(dtype)
    w = 1 + 0.5 * torch.randn(D, device=device)  # fp32 o_norm weight
    out = poison((T, H, D), dtype, device)
    y = norm.gated_rms_norm(x, gate, w, 1e-5, out=out)
    assert rel_err(y, ref_norm.gated_rms_norm(x, gate, w, 1e-5)) < tol(dtype)


def check_attn_res(n, T, D, dtype, device, schedule, fused=True):
    _, attn_res = kernels()
    scratch = torch.randn(max(n, 1) + 2, T, D, device=device).to(dtype)  # the stream's scratch, sliced
    blocks = scratch[:n]
    partial = torch.randn(T, D, device=device).to(dtype)
    query = torch.randn(D, device=device) * 0.05
    nw = (1 + 0.5 * torch.randn(D, device=device)).to(dtype)
    out = poison((T, D), dtype, device)
    if fused:
        y = attn_res.attn_res_mix_rms_norm(blocks, partial, query, 1e-6, nw, 1e-5, schedule=schedule, out=out)
        ref = ref_attn_res.attn_res_mix_rms_norm(blocks, partial, query, 1e-6, nw, 1e-5)
    else:
        y = attn_res.attn_res_mix(blocks, partial, query, 1e-6, schedule=schedule, out=out)
        ref = ref_attn_res.attn_res_mix(blocks, partial, query, 1e-6)
    assert rel_err(y, ref) < tol(dtype)


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
@cpu_interp
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 130), (1, 1)])
def test_rms_norm_interp(shape):
    check_rms(shape, torch.float32, "cpu")


@cpu_interp
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 130), (1, 1), (37, 2304)])
def test_add_rms_norm_interp(shape, strided, in_place):
    check_add_rms(shape, torch.float32, "cpu", strided=strided, in_place=in_place)


@cpu_interp
def test_add_rms_norm_fp16_roundings_interp():
    """fp16: the norm reads the rounded sum. Bit for bit the unfused Triton pair (torch add, then `rms_norm`),
    within one ulp of the torch reference (rare flips: fp32 statistics summed in another order), and clearly not
    the norm of the unrounded fp32 sum (the fusion done wrong)."""
    norm, _ = kernels()
    normed, _, x, residual, w = check_add_rms((64, 200), torch.float16, "cpu")
    assert torch.equal(normed, norm.rms_norm(residual + x, w, 1e-5))
    ref = ref_norm.rms_norm(residual + x, w, 1e-5)
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp_min(2 ** -14)
    assert ((normed.float() - ref.float()).abs() <= ulp).all()
    assert (normed != ref).double().mean().item() < 0.01
    s32 = residual.float() + x.float()  # the sum left unrounded, the rest as rms_norm does it
    wrong = (w.float() * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-5)).half().float()).half()
    assert (wrong != ref).double().mean().item() > 0.05


@cpu_interp
def test_add_rms_norm_errors_and_empty_interp():
    norm, _ = kernels()
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="residual must match"):
        norm.add_rms_norm(x, torch.randn(3, 7), w, 1e-5)
    with pytest.raises(ValueError, match="residual must match"):
        norm.add_rms_norm(x, torch.randn(3, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="summed must be"):
        norm.add_rms_norm(x, x, w, 1e-5, summed=torch.empty(3, 8).t())
    normed, summed = norm.add_rms_norm(x[:0], x[:0], w, 1e-5)
    assert normed.shape == summed.shape == (0, 8)


@cpu_interp
@pytest.mark.parametrize("strided", [False, True])
def test_gated_rms_norm_interp(strided):
    check_gated(5, 3, 16, torch.float32, "cpu", strided)


@cpu_interp
@pytest.mark.parametrize("schedule", ["tile", "online"])
@pytest.mark.parametrize("n", [0, 3, 11])
def test_attn_res_interp(n, schedule):
    check_attn_res(n, 3, 100, torch.float32, "cpu", schedule)
    if n:
        check_attn_res(n, 2, 36, torch.float32, "cpu", schedule, fused=False)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 7168), (37, 7168), (64, 7168), (4099, 7168), (5, 1536), (3, 7, 512),
                                   (11, 3584), (2, 129)])
def test_rms_norm_gpu(shape, dtype):
    check_rms(shape, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2304), (64, 2304), (8192, 2304), (37, 7168), (3, 7, 512), (2, 129)])
def test_add_rms_norm_gpu(shape, dtype):
    """Bit for bit the path it replaces (torch add, then the Triton rms_norm), plus the reference tolerance."""
    norm, _ = kernels()
    normed, _, x, residual, w = check_add_rms(shape, dtype, "cuda", strided=shape[0] == 37)
    assert torch.equal(normed, norm.rms_norm(residual + x, w, 1e-5))
    check_add_rms(shape, dtype, "cuda", in_place=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 37, 256, 4096])
def test_gated_rms_norm_gpu(T, dtype, strided):
    check_gated(T, 12, 128, dtype, "cuda", strided)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", ["tile", "online", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,T", [(0, 4), (1, 1), (7, 4), (11, 1), (11, 17), (11, 37), (11, 300), (5, 2049)])
def test_attn_res_mix_rms_norm_gpu(n, T, dtype, schedule):
    if schedule == "split" and T * 7 > torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip("split needs every program resident")
    check_attn_res(n, T, 7168, dtype, "cuda", schedule)


@pytest.mark.gpu
@needs_cuda
def test_attn_res_split_repeated_gpu():
    """The split schedule's counters are left at zero: many launches in a row (and in a CUDA graph) stay right."""
    for _ in range(3):
        check_attn_res(11, 4, 7168, torch.bfloat16, "cuda", "split")
    _, attn_res = kernels()
    blocks = torch.randn(7, 2, 7168, device="cuda", dtype=torch.bfloat16)
    partial = torch.randn(2, 7168, device="cuda", dtype=torch.bfloat16)
    q, nw = torch.randn(7168, device="cuda") * 0.05, torch.randn(7168, device="cuda", dtype=torch.bfloat16)
    attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5, schedule="split")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5, schedule="split")
    for _ in range(2):
        blocks.copy_(torch.randn_like(blocks))
        out.fill_(float("nan"))
        graph.replay()
        ref = ref_attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5)
        assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", ["tile", "online", "split"])
@pytest.mark.parametrize("n,T,D", [(3, 5, 7168), (11, 3, 1000)])
def test_attn_res_mix_gpu(n, T, D, schedule):
    check_attn_res(n, T, D, torch.bfloat16, "cuda", schedule, fused=False)



def check_l2(shape, dtype, device, strided: bool) -> None:
    """`l2_normalize` against the reference (fp32) rounded once to the io dtype; strided: rows of a wider buffer (a
    view of a merged projection). Every element is compared, so an unwritten one (torch.empty) fails."""
    norm, _ = kernels()
    from tokenspeed.ops.reference.kda import l2_normalize as ref_l2

    x = torch.randn(shape, device=device).to(dtype) * 3
    if strided:
        x = torch.randn((*shape[:-1], 3, shape[-1]), device=device).to(dtype)[..., 1, :] * 3
    y = norm.l2_normalize(x)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    if x.numel() == 0:
        return
    ref = ref_l2(x).to(dtype)
    assert rel_err(y, ref) < tol(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@cpu_interp
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", [(5, 3, 128), (17, 96), (1, 1, 64), (0, 128)])
def test_l2_normalize_interp(shape, strided):
    check_l2(shape, torch.float32, "cpu", strided)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32, 128), (8192, 32, 128), (4483, 12, 128), (37, 96)])
def test_l2_normalize_gpu(shape, dtype):
    """The GPU form, also against fla's `l2norm_fwd` (the kernel it replaces before `chunk_kda`) in bf16."""
    check_l2(shape, dtype, "cuda", strided=shape[0] == 37)
    if dtype == torch.bfloat16:
        fla_l2 = pytest.importorskip("fla.modules.norm.l2norm")
        norm, _ = kernels()
        x = torch.randn(shape, device="cuda").to(dtype)
        y_fla = fla_l2.l2norm_fwd(x)[0]
        assert (norm.l2_normalize(x).float() - y_fla.float()).abs().max().item() <= 2 ** -7  # <= 1 bf16 ulp at 1
