"""`ops.stacked_linear` (G projections of G adjacent column groups of one input, KDA's f / g gate up-projections):
and MLA's per-head absorptions): the Triton kernel against torch.bmm, and when the op takes it.

Interpreter (fp32): the model's grouping (G 2, K 128) and odd shapes (N not a multiple of the tile, K under and
over one K tile), 1..MAX_ROWS rows, x a strided view of a wider projection output; MLA's W_UK read transposed and
W_UV written through a transposed output; outputs from NaN-poisoned memory; within 1e-5 relative. Routing: the kernel by default, bmm when TOKENSPEED_STACKED_GEMV=0, and bmm past MAX_ROWS rows or for
shapes the kernel does not take. On a GPU: bf16 within 1e-2 of bmm, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up Triton
from tokenspeed import ops
from tokenspeed.ops import dispatch


def _kernel():
    from tokenspeed.ops.triton import stacked_gemv

    return stacked_gemv


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    g, _, k = w.shape
    return torch.bmm(x.view(x.shape[0], g, k).transpose(0, 1).double(), w.transpose(1, 2).double())


def _strided_input(t: int, g: int, k: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """x [t, g * k] as a column view of a wider merged output (row stride > width, unit column stride)."""
    wide = torch.randn(t, g * k + 40, dtype=dtype, device=device)
    return wide[:, 24 : 24 + g * k]


@cpu_interp
@pytest.mark.parametrize("t", [1, 2, 5, 8, 16])
@pytest.mark.parametrize(("g", "n", "k"), [(2, 256, 128), (2, 100, 48), (3, 70, 200), (1, 32, 128)])
def test_kernel_matches_bmm(t, g, n, k, monkeypatch):
    x = _strided_input(t, g, k)
    w = torch.randn(g, n, k)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *s, **kw: real_empty(*s, **kw).fill_(float("nan")))
    assert _kernel().supported(x, w)
    y = _kernel().stacked_linear(x, w)
    assert y.shape == (g, t, n) and y.is_contiguous() and y.dtype == x.dtype
    assert rel_err(y, _reference(x, w)) < 1e-5


@cpu_interp
@pytest.mark.parametrize("t", [1, 3])
def test_mla_head_products_with_strided_operands(t, monkeypatch):
    """MLA's absorptions over H heads: q_nope @ W_UK[h] (x a column slice of q [T, H, nope + rope], W_UK read
    transposed out of kv_b [H, nope + v, r]) and o_lat @ W_UV[h]^T written through the [H, T, v] transpose of a
    [T, H, v] buffer. Poisoned outputs, against bmm."""
    h, nope, rope, v, r = 4, 32, 16, 32, 64
    q = torch.randn(t, h, nope + rope)
    kv_b = torch.randn(h, nope + v, r)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *s, **kw: real_empty(*s, **kw).fill_(float("nan")))
    x, w_uk = q[..., :nope], kv_b[:, :nope].transpose(1, 2)  # [T, H, nope]; [H, r, nope] with unit stride on r
    assert _kernel().supported(x, w_uk)
    q_lat = _kernel().stacked_linear(x, w_uk)
    ref = torch.bmm(x.transpose(0, 1).double(), kv_b[:, :nope].double())
    assert q_lat.shape == (h, t, r) and rel_err(q_lat, ref) < 1e-5
    o_lat, w_uv = torch.randn(t, h, r), kv_b[:, nope:]  # [H, v, r], rows of stride r
    o = torch.full((t, h, v), float("nan"))
    assert _kernel().stacked_linear(o_lat, w_uv, o.transpose(0, 1)) is not None
    ref = torch.bmm(o_lat.transpose(0, 1).double(), w_uv.transpose(1, 2).double()).transpose(0, 1)
    assert rel_err(o, ref) < 1e-5


@cpu_interp
def test_op_takes_the_kernel_only_when_switched_on_and_small(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = []
    kernel = _kernel()
    real = kernel.stacked_linear
    monkeypatch.setattr(kernel, "stacked_linear", lambda *a: calls.append(a) or real(*a))
    w = torch.randn(2, 64, 128)
    x = _strided_input(1, 2, 128)
    monkeypatch.setenv(ops.STACKED_GEMV_ENV, "0")
    off = ops.stacked_linear(x, w)  # switched off: torch.bmm
    assert not calls
    monkeypatch.delenv(ops.STACKED_GEMV_ENV, raising=False)
    on = ops.stacked_linear(x, w)  # default: the kernel
    assert len(calls) == 1
    assert rel_err(on, off) < 1e-5
    big = _strided_input(kernel.MAX_ROWS + 1, 2, 128)
    assert rel_err(ops.stacked_linear(big, w), _reference(big, w)) < 1e-5
    assert len(calls) == 1  # more rows than MAX_ROWS: bmm
    assert not kernel.supported(x.contiguous().view(1, 2, 64, 2), w)  # not [T, G * K] or [T, G, K]
    assert not kernel.supported(x, torch.randn(2, 64, 256)[:, :, ::2])  # no unit stride along N or K
    assert dispatch.mode() == "triton"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 8, 16])
def test_bf16_on_the_gpu_eager_and_in_a_graph(t, monkeypatch):
    monkeypatch.setenv(ops.STACKED_GEMV_ENV, "1")
    g, n, k = 2, 4096, 128  # kimi-linear-48b-a3b's fg_b_proj
    x = _strided_input(t, g, k, torch.bfloat16, "cuda")
    w = (torch.randn(g, n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    ref = _reference(x, w)
    assert rel_err(ops.stacked_linear(x, w).float(), ref) < 1e-2
    ops.stacked_linear(x, w)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.stacked_linear(x, w)
    x.copy_(_strided_input(t, g, k, torch.bfloat16, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y.float(), _reference(x, w)) < 1e-2


@needs_cuda
@pytest.mark.gpu
def test_mla_head_products_bf16_on_the_gpu(monkeypatch):
    """kimi-linear's MLA at batch 1: W_UK read transposed out of kv_b, W_UV into a transposed output."""
    monkeypatch.setenv(ops.STACKED_GEMV_ENV, "1")
    h, nope, rope, v, r = 32, 128, 64, 128, 512
    q = torch.randn(1, h, nope + rope, device="cuda", dtype=torch.bfloat16)
    kv_b = (torch.randn(h, nope + v, r, device="cuda") / r ** 0.5).to(torch.bfloat16)
    q_lat = ops.stacked_linear(q[..., :nope], kv_b[:, :nope].transpose(1, 2))
    assert rel_err(q_lat.float(), torch.bmm(q[..., :nope].transpose(0, 1).double(), kv_b[:, :nope].double())) < 1e-2
    o_lat = torch.randn(1, h, r, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(1, h, v, device="cuda", dtype=torch.bfloat16)
    ops.stacked_linear(o_lat, kv_b[:, nope:], out=o.transpose(0, 1))
    ref = torch.bmm(o_lat.transpose(0, 1).double(), kv_b[:, nope:].transpose(1, 2).double()).transpose(0, 1)
    assert rel_err(o.float(), ref) < 1e-2
