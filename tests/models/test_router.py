"""The MoE router's fp32 logits: CPU keeps the fp32 F.linear against the cached fp32 weight (whatever the ops
mode); on CUDA, decode-sized batches take the Triton GEMV with fp32 output and larger ones cuBLAS with fp32
output, both equal to the fp64 product to 1e-5."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.models.config import KimiConfig
from tokenspeed.models.kimi.moe import Router
from tokenspeed.ops import dispatch


def _router(device: str, hidden: int = 64, experts: int = 16) -> Router:
    cfg = KimiConfig(hidden_size=hidden, num_experts=experts, num_experts_per_token=2, moe_intermediate_size=32)
    r = Router(cfg, torch.bfloat16, device)
    with torch.no_grad():
        r.weight.copy_(torch.randn(experts, hidden, device=device) * 0.05)
    return r


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mode", ["auto", "triton", "reference"])
def test_router_cpu_is_fp32_linear(mode, monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    r = _router("cpu")
    for t in (1, 5, 40):
        x = torch.randn(t, 64).bfloat16()
        got = r(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, F.linear(x.float(), r.weight.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_cuda_small_batch_uses_fp32_gemv(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    r = _router("cuda", 2304, 256)
    mod = dispatch.kernels("gemv")
    calls = []
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda *a, **k: calls.append(k) or real(*a, **k))
    for t in (1, 4, 16, 17):
        x = torch.randn(t, 2304, device="cuda").bfloat16()
        got = r(x)
        want = x.double() @ r.weight.double().t()
        assert got.dtype == torch.float32 and _rel(got, want) < 1e-5
        assert _rel(got, torch.mm(x, r.weight.t(), out_dtype=torch.float32)) < 1e-5
    assert len(calls) == 3 and all(c["out_dtype"] == torch.float32 for c in calls)  # T = 17: cuBLAS
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    x = torch.randn(2, 2304, device="cuda").bfloat16()
    assert torch.equal(r(x), torch.mm(x, r.weight.t(), out_dtype=torch.float32)) and len(calls) == 3
