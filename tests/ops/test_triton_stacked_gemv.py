"""`ops.stacked_linear` (G projections of G adjacent column groups of one input, KDA's f / g gate up-projections):
the Triton kernel against torch.bmm, and when the op takes it.

Interpreter (fp32): the model's grouping (G 2, K 128) and odd shapes (N not a multiple of the tile, K under and
over one K tile), 1..MAX_ROWS rows, x a strided view of a wider projection output, outputs from NaN-poisoned
memory; within 1e-5 relative. Routing: bmm unless TOKENSPEED_STACKED_GEMV=1, and bmm past MAX_ROWS rows or for
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
@pytest.mark.parametrize("t", [1, 2, 5, 8])
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
def test_op_takes_the_kernel_only_when_switched_on_and_small(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = []
    kernel = _kernel()
    real = kernel.stacked_linear
    monkeypatch.setattr(kernel, "stacked_linear", lambda *a: calls.append(a) or real(*a))
    w = torch.randn(2, 64, 128)
    x = _strided_input(1, 2, 128)
    monkeypatch.delenv(ops.STACKED_GEMV_ENV, raising=False)
    off = ops.stacked_linear(x, w)  # default: torch.bmm
    assert not calls
    monkeypatch.setenv(ops.STACKED_GEMV_ENV, "1")
    on = ops.stacked_linear(x, w)
    assert len(calls) == 1
    assert rel_err(on, off) < 1e-5
    big = _strided_input(kernel.MAX_ROWS + 1, 2, 128)
    assert rel_err(ops.stacked_linear(big, w), _reference(big, w)) < 1e-5
    assert len(calls) == 1  # more rows than MAX_ROWS: bmm
    assert not kernel.supported(x.contiguous().view(1, 2, 128), w)  # not 2-D
    assert not kernel.supported(x, w.transpose(1, 2).contiguous().transpose(1, 2))  # weight not contiguous
    assert dispatch.mode() == "triton"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 8])
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
