"""The MoE FFN junction fused into the next projection (`gemv_junction.junction_gemv`) and `ops.PendingNorm`.

Contract: y = rms_norm(summed, norm_weight, eps) @ W^T and summed = cast(residual + cast(sum_j w_j * buf_j)), the
summed bit for bit `combine_add_rms_norm`'s, y equal to the unfused projection up to rounding.
CPU (Triton interpreter, fp32): T = 1..4, K even and uneven in the tile, odd N, top_k 1 / 3 / 9, both LOOKAHEAD
settings, a strided residual; summed bit for bit, y within 1e-5 of normed @ W^T, outputs from NaN-poisoned memory,
nothing given mutated; the fusion done wrong (the norm's inv left out) fails. `PendingNorm`: resolve() is the
unfused junction (and computed once), project() fuses only while unresolved and not switched off, and falls back
to ops.linear of the normed tensor bit for bit; the kernel's region (`unusable_reason`) and its tiles from the
routing table (`junction_config`); `moe_experts_pending` against `moe_experts(..., residual=)`.
CUDA (`-m gpu`): bf16 at the kimi-linear shapes (in_proj 12576 x 2304, q / kv_a 6720 x 2304; T = 1, 2, 4; the
experts' real buffer): summed bit for bit, y within 1e-2 of the unfused GEMV; PDL on and off and CUDA-graph
replays give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.moe_inputs import KIMI, make_weights  # torch only
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # before anything imports Triton
from tokenspeed.ops.reference.activation import Activation

EPS = 1e-6
SILU = Activation("silu")


def _case(T: int, D: int, N: int, k: int, dtype=torch.float32, device="cpu", seed: int = 0, res_pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(T * k, D, generator=g)
    tw = torch.rand(T * k, generator=g) + 0.1
    res = torch.randn(T, D + res_pad, generator=g)[:, :D] * 3
    nw = torch.rand(D, generator=g) + 0.5
    w = torch.randn(N, D, generator=g) * D ** -0.5
    return (buf.to(device, dtype), tw.to(device), res.to(device, dtype), nw.to(device, dtype), w.to(device, dtype))


def _unfused(buf, tw, k, res, nw, w):
    from tokenspeed.ops.triton.moe_combine import combine_add_rms_norm

    normed, summed = combine_add_rms_norm(buf, tw, k, res, nw, EPS)
    return normed, summed, normed.float() @ w.float().t()


@cpu_interp
@pytest.mark.parametrize("T,D,N,k,block_k", [(1, 256, 100, 9, 64), (2, 200, 70, 3, 64), (3, 384, 33, 1, 128),
                                               (4, 96, 64, 9, 64)])
@pytest.mark.parametrize("lookahead", [0, 1])
def test_junction_gemv_interp(T, D, N, k, block_k, lookahead, poison_empty):
    from tokenspeed.ops.triton.gemv_junction import junction_gemv

    buf, tw, res, nw, w = _case(T, D, N, k, seed=T + N, res_pad=5 if T == 2 else 0)
    before = [t.clone() for t in (buf, tw, res, nw, w)]
    _, want_summed, want_y = _unfused(buf, tw, k, res, nw, w)
    summed = torch.full((T, D), float("nan"))
    y = junction_gemv(buf, tw, k, res, nw, EPS, w, summed, block_n=32, block_k=block_k, lookahead=lookahead)
    assert y.shape == (T, N) and y.dtype == w.dtype and y.is_contiguous()
    assert torch.equal(summed, want_summed)
    assert rel_err(y, want_y) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip((buf, tw, res, nw, w), before, strict=True))
    # The row scale matters: without it the result is far off (so the check above can fail).
    assert rel_err(summed * nw @ w.t(), want_y) > 1e-2


@cpu_interp
def test_unusable_reason_and_errors():
    from tokenspeed.ops.triton.gemv_junction import MAX_M, junction_gemv, unusable_reason

    buf, tw, res, nw, w = _case(2, 64, 40, 3)
    assert unusable_reason(buf, tw, 3, res, nw, w) is None
    big = _case(MAX_M + 1, 64, 40, 3)
    assert "T <= " in unusable_reason(*big[:2], 3, *big[2:])
    assert "dtype" in unusable_reason(buf, tw, 3, res, nw, w.double())
    assert "topk_weights" in unusable_reason(buf, tw.double(), 3, res, nw, w)
    assert "weight" in unusable_reason(buf, tw, 3, res, nw, w[:, :32])
    assert "buf" in unusable_reason(buf[:5], tw, 3, res, nw, w)
    with pytest.raises(ValueError, match="summed"):
        junction_gemv(buf, tw, 3, res, nw, EPS, w, torch.empty(2, 65))
    with pytest.raises(ValueError, match="junction_gemv"):
        junction_gemv(buf, tw, 3, res, nw, EPS, w.t().contiguous().t(), torch.empty(2, 64))


def test_junction_config_folds_split_k():
    from tokenspeed.ops.triton.gemv_junction import junction_config

    route = {"kind": "dot", "block_n": 128, "block_k": 128, "split_k": 2, "num_warps": 8, "num_stages": 4}
    assert junction_config(1, 6720, 2304, route) == {"block_n": 64, "block_k": 128, "num_warps": 8, "num_stages": 4}
    assert junction_config(1, 12576, 2304, dict(route, split_k=1))["block_n"] == 128
    for other in (None, {}, {"kind": "fma", "block_n": 4, "block_k": 512}, {"kind": "smem", "block_n": 8}):
        assert junction_config(1, 100, 64, other) == {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}


@cpu_interp
def test_pending_norm_resolve_and_project(monkeypatch):
    from tokenspeed import ops
    from tokenspeed.ops import junction
    from tokenspeed.ops.triton import gemv_junction

    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    buf, tw, res, nw, w = _case(3, 128, 48, 9, seed=7)
    want_normed, want_summed, want_y = _unfused(buf, tw, 9, res, nw, w)
    calls = []
    real = gemv_junction.junction_gemv
    monkeypatch.setattr(gemv_junction, "junction_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    p = ops.PendingNorm(buf, tw, 9, res, nw, EPS)
    assert p.shape == res.shape and p.dtype == res.dtype and p.device == res.device and not p.is_cuda
    assert p.fusable(w)
    y = p.project(w)
    assert len(calls) == 1 and torch.equal(p.summed, want_summed) and rel_err(y, want_y) < 1e-5
    normed = p.resolve()
    assert torch.equal(normed, want_normed) and p.resolve() is normed and torch.equal(p.summed, want_summed)
    assert not p.fusable(w)  # resolved: a second projection reads the normed tensor
    assert torch.equal(p.project(w), ops.linear(normed, w)) and len(calls) == 1
    monkeypatch.setenv(junction.JUNCTION_GEMV_ENV, "0")
    q = ops.PendingNorm(buf, tw, 9, res, nw, EPS)
    assert not q.fusable(w)
    assert torch.equal(q.project(w), ops.linear(want_normed, w)) and torch.equal(q.summed, want_summed)
    assert len(calls) == 1


@cpu_interp
def test_moe_experts_pending_matches_fused_junction(monkeypatch):
    from tokenspeed import ops

    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    E, D, DI, T, k = 6, 64, 32, 2, 3
    w1, w3, w2 = make_weights(E, D, DI, torch.float32, "cpu", seed=1)
    g = torch.Generator().manual_seed(2)
    x, res = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    tw, nw = torch.rand(T, k, generator=g), torch.rand(D, generator=g) + 0.5
    assert ops.moe_junction_deferrable(x, w1, SILU, res)
    want_normed, want_summed = ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, residual=res, norm_weight=nw,
                                               norm_eps=EPS)
    p = ops.moe_experts_pending(x, w1, w3, w2, tw, ids, SILU, res, nw, EPS)
    assert torch.equal(p.resolve(), want_normed) and torch.equal(p.summed, want_summed)
    big = torch.randn(5, D)
    assert not ops.moe_junction_deferrable(big, w1, SILU, big)
    monkeypatch.setenv("TOKENSPEED_MOE_JUNCTION_GEMV", "0")
    assert not ops.moe_junction_deferrable(x, w1, SILU, res)
    with pytest.raises(ValueError, match="deferrable"):
        ops.moe_experts_pending(x, w1, w3, w2, tw, ids, SILU, res, nw, EPS)


def _kimi_inputs(T: int, seed: int):
    """`moe_experts_pending`'s arguments at the Kimi-Linear shapes (bf16, CUDA; 8 routed + the shared id)."""
    E, k, D, DI = KIMI["E"] + 1, KIMI["k"] + 1, KIMI["D"], KIMI["I"]
    w1, w3, w2 = make_weights(E, D, DI, torch.bfloat16, "cuda", seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to("cuda", torch.bfloat16)
    res = (torch.randn(T, D, generator=g) * 3).to("cuda", torch.bfloat16)
    ids = torch.rand(T, E - 1, generator=g).argsort(-1)[:, :k].to("cuda")
    tw = (torch.rand(T, k, generator=g) + 0.1).to("cuda")
    ids[:, -1], tw[:, -1] = E - 1, 1.0
    nw = (torch.rand(D, generator=g) + 0.5).to("cuda", torch.bfloat16)
    return x, w1, w3, w2, tw, ids, res, nw


def _pending(inputs):
    from tokenspeed import ops

    x, w1, w3, w2, tw, ids, res, nw = inputs
    return ops.moe_experts_pending(x, w1, w3, w2, tw, ids, SILU, res, nw, EPS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("N", [12576, 6720])
def test_junction_kimi_gpu(T, N, monkeypatch):
    from tokenspeed import ops

    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    inputs = _kimi_inputs(T, seed=T)
    x, w1, w3, w2, tw, ids, res, nw = inputs
    pending = _pending(inputs)
    w = (torch.randn(N, KIMI["D"], generator=torch.Generator().manual_seed(N)) * KIMI["D"] ** -0.5).to(
        "cuda", torch.bfloat16)
    normed, summed = ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, residual=res, norm_weight=nw, norm_eps=EPS)
    want = ops.linear(normed, w)
    assert pending.fusable(w)
    y = pending.project(w)
    torch.cuda.synchronize()
    assert torch.equal(pending.summed, summed)
    assert rel_err(y, want) < 1e-2
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("TOKENSPEED_PDL", pdl)
        for la in ("0", "1"):
            monkeypatch.setenv("TOKENSPEED_JUNCTION_LOOKAHEAD", la)
            p = _pending(inputs)
            outs[pdl, la] = (p.project(w), p.summed)
    for la in ("0", "1"):
        assert torch.equal(outs["0", la][0], outs["1", la][0]) and torch.equal(outs["0", la][1], summed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4])
def test_junction_graph_replays_gpu(T, monkeypatch):
    """The experts and the fused projection captured in one CUDA graph: replays give the eager bits (a missing
    PDL wait would read a stale buffer)."""
    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    w = (torch.randn(12576, KIMI["D"], generator=torch.Generator().manual_seed(3)) * 0.02).to("cuda", torch.bfloat16)
    inputs = _kimi_inputs(T, seed=10 + T)
    pending = _pending(inputs)
    want = (pending.project(w), pending.summed.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p = _pending(inputs)
        outs = (p.project(w), p.summed)
    for _ in range(10):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
