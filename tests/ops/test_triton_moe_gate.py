"""`moe_gate`: residual add + RMSNorm, the fp32 router GEMV and the routing in one Triton launch.

Contract: `tokenspeed.ops.reference.moe_gate.moe_gate` = add_rms_norm, then fp32 logits of x, then moe_route.
CPU (Triton interpreter, fp32): with every output poisoned first (NaN, ids -7), at T = 1, 3, 16, E = 64 (and
odd E / K: masked rows and columns), k = 4, with / without the correction bias and the shared-expert column:
summed equals the reference bit for bit; x within 1e-6 of it and bit for bit the Triton `add_rms_norm`; the
logits within 1e-5 of x @ W^T; the weights / ids bit for bit the Triton `moe_route` on the kernel's own logits
(and the ids the reference route's); the counter is back to zero after each launch and a second launch gives the
same bits (a counter left at 1 would make no program the last one: the routing would stay poisoned). Launch
configurations (experts per program, rows per step) give the same bits; the unfused fallback (a first call inside
a graph capture) the same routing; unsupported calls and bad outputs are rejected; `ops.moe_gate` dispatches.
CUDA (`-m gpu`): bf16 at Kimi-Linear's shapes (E 256, k 8 + shared, K 2304; T = 1, 4, 16): the routing bit for
bit `moe_route` of the kernel's logits, x / summed bit for bit the Triton `add_rms_norm`, logits close to the GEMV's;
PDL on and off the same bits, eager and over CUDA-graph replays.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # before anything imports Triton
from tokenspeed.ops.reference.moe import moe_route as ref_route
from tokenspeed.ops.reference.moe_gate import moe_gate as ref_gate

EPS = 1e-6
SCALE = 2.446


def inputs(T: int, K: int, E: int, dtype=torch.float32, device="cpu", bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, r = (torch.randn(T, K, generator=g) for _ in range(2))
    nw = torch.rand(K, generator=g) + 0.5
    w = torch.randn(E, K, generator=g) / K ** 0.5
    b = torch.randn(E, generator=g) * 0.1 if bias else None
    to = lambda t: t.to(device=device, dtype=dtype)
    return to(a), to(r), to(nw), to(w), None if b is None else b.to(device)


def poisoned(T: int, K: int, E: int, n: int, dtype, device):
    """(x, summed, weights, ids) and the logits, every element poisoned (NaN / -7)."""
    nan = float("nan")
    return ((torch.full((T, K), nan, dtype=dtype, device=device), torch.full((T, K), nan, dtype=dtype, device=device),
             torch.full((T, n), nan, device=device), torch.full((T, n), -7, dtype=torch.int64, device=device)),
            torch.full((T, E), nan, device=device))


def run(args, k: int, shared: int | None, **kw):
    from tokenspeed.ops.triton.moe_gate import moe_gate

    a, r, nw, w, b = args
    T, K = a.shape
    E = w.shape[0]
    out, logits = poisoned(T, K, E, k + (shared is not None), a.dtype, a.device)
    got = moe_gate(a, r, nw, EPS, w, b, k, routed_scaling_factor=SCALE, shared_expert_id=shared, out=out,
                   logits=logits, **kw)
    assert all(g is o for g, o in zip(got, out, strict=True))
    return (*out, logits)


def check_against_composition(args, k: int, shared: int | None, got) -> None:
    from tokenspeed.ops.triton import moe_route, norm

    a, r, nw, w, b = args
    x, summed, weights, ids, logits = got
    X, S, _, ref_ids = ref_gate(a, r, nw, EPS, w, b, k, routed_scaling_factor=SCALE, shared_expert_id=shared)
    assert torch.equal(summed, S)
    assert rel_err(x, X) < 1e-6
    tx, ts = norm.add_rms_norm(a, r, nw, EPS)
    assert torch.equal(x, tx) and torch.equal(summed, ts)
    assert rel_err(logits, torch.nn.functional.linear(x.float(), w.float())) < 1e-5
    rw, rid = moe_route.moe_route(logits, b, k, routed_scaling_factor=SCALE, shared_expert_id=shared)
    assert torch.equal(ids, rid) and torch.equal(weights, rw)  # the routing of these logits, bit for bit
    ow, oid = ref_route(logits, b, k, routed_scaling_factor=SCALE, shared_expert_id=shared)
    assert torch.equal(ids, oid) and rel_err(weights, ow) < 1e-6
    if torch.equal(logits, torch.nn.functional.linear(X.float(), w.float())):
        assert torch.equal(ids, ref_ids)


@cpu_interp
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("bias,shared", [(True, True), (False, False), (True, False)])
def test_gate_interp(T: int, bias: bool, shared: bool):
    from tokenspeed.ops.triton.moe_gate import counter

    E, K, k = 64, 96, 4
    args = inputs(T, K, E, bias=bias, seed=T)
    sid = E if shared else None
    first = run(args, k, sid)
    check_against_composition(args, k, sid, first)
    assert counter(args[0].device).item() == 0  # reset for the next launch
    second = run(args, k, sid)  # back to back: the counter reset lets the second launch route too
    assert all(torch.equal(p, q) for p, q in zip(first, second, strict=True))
    assert counter(args[0].device).item() == 0


@cpu_interp
@pytest.mark.parametrize("T,E,K", [(2, 37, 100), (5, 64, 2304)])
def test_gate_odd_shapes_interp(T: int, E: int, K: int):
    """E not a multiple of the experts per program (clamped rows, masked stores), K not a power of two, and the
    Kimi width."""
    args = inputs(T, K, E, seed=E)
    check_against_composition(args, 5, E, run(args, 5, E))


@cpu_interp
def test_gate_configs_same_bits_interp():
    from tokenspeed.ops.triton.moe_gate import GateConfig

    args = inputs(7, 96, 64, seed=3)
    want = run(args, 4, 64)
    for cfg in (GateConfig(block_n=1, block_t=1, num_warps=4), GateConfig(block_n=4, block_t=4),
                GateConfig(block_n=64, block_t=8)):
        got = run(args, 4, 64, config=cfg)
        # the per-row fp32 dot is the same reduction whatever the tiling in the interpreter
        assert all(torch.equal(p, q) for p, q in zip(got, want, strict=True)), cfg


@cpu_interp
def test_gate_counter_stuck_is_detected_interp():
    """The test can fail: a counter left non-zero (no reset) means no program routes, the poison stays."""
    from tokenspeed.ops.triton.moe_gate import counter

    args = inputs(2, 96, 64)
    cnt = counter(args[0].device)
    cnt.fill_(1 << 20)  # as if earlier launches had never reset it
    try:
        got = run(args, 4, 64)
        assert torch.isnan(got[2]).all() and (got[3] == -7).all()
    finally:
        cnt.zero_()


@cpu_interp
def test_gate_unfused_fallback_interp(monkeypatch):
    """A first call inside a graph capture (no counter yet) runs the three unfused launches: the same contract."""
    from tokenspeed.ops.triton import moe_gate as mg

    args = inputs(3, 96, 64, seed=9)
    monkeypatch.setattr(mg, "counter", lambda device: None)
    got = run(args, 4, 64)
    check_against_composition(args, 4, 64, got)


@cpu_interp
def test_gate_rejects_interp():
    from tokenspeed.ops.triton.moe_gate import moe_gate

    a, r, nw, w, b = inputs(2, 96, 64)
    with pytest.raises(ValueError):
        moe_gate(a, r, nw, EPS, w, b, 4, scoring="softmax")
    with pytest.raises(ValueError):
        moe_gate(torch.zeros(17, 96), torch.zeros(17, 96), nw, EPS, w, b, 4)
    with pytest.raises(ValueError):
        moe_gate(a, r, nw, EPS, w, b, 4, shared_expert_id=3)  # a routed expert's id
    with pytest.raises(ValueError):
        moe_gate(a, r, nw, EPS, w, b, 4, shared_expert_id=64, out=poisoned(2, 96, 64, 4, a.dtype, "cpu")[0])


@cpu_interp
def test_ops_dispatch_interp(monkeypatch):
    from tokenspeed import ops

    args = inputs(3, 96, 64, seed=4)
    a, r, nw, w, b = args
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    assert not ops.moe_gate_kernel_usable(a, r, nw, w, b, 4)  # CPU tensors: the reference
    got = ops.moe_gate(a, r, nw, EPS, w, b, 4, routed_scaling_factor=SCALE, shared_expert_id=64)
    want = ref_gate(a, r, nw, EPS, w, b, 4, routed_scaling_factor=SCALE, shared_expert_id=64)
    assert all(torch.equal(p, q) for p, q in zip(got, want, strict=True))
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    assert ops.moe_gate_kernel_usable(a, r, nw, w, b, 4)
    assert not ops.moe_gate_kernel_usable(a, r, nw, w, b, 4, "softmax")
    assert not ops.moe_gate_kernel_usable(torch.zeros(17, 96), torch.zeros(17, 96), nw, w, b, 4)
    got = ops.moe_gate(a, r, nw, EPS, w, b, 4, routed_scaling_factor=SCALE, shared_expert_id=64)
    assert torch.equal(got[1], want[1]) and rel_err(got[0], want[0]) < 1e-6 and rel_err(got[2], want[2]) < 1e-5


def _kimi(T: int, seed: int):
    return inputs(T, 2304, 256, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_gate_kimi_gpu(T: int):
    from tokenspeed import ops
    from tokenspeed.ops.triton import moe_route, norm

    args = _kimi(T, seed=T)
    a, r, nw, w, b = args
    x, summed, weights, ids, logits = run(args, 8, 256)
    tx, ts = norm.add_rms_norm(a, r, nw, EPS)
    assert torch.equal(summed, ts) and torch.equal(x, tx)
    rw, rid = moe_route.moe_route(logits, b, 8, routed_scaling_factor=SCALE, shared_expert_id=256)
    assert torch.equal(ids, rid) and torch.equal(weights, rw)
    assert rel_err(logits, ops.linear(x, w, out_dtype=torch.float32)) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_gate_pdl_graph_gpu(T: int, monkeypatch):
    """PDL on and off the same bits, eager and over CUDA-graph replays (with a producer kernel before the gate and
    a consumer after it, so a missing wait or a stale counter would show)."""
    from tokenspeed.ops.triton.moe_gate import moe_gate

    a0, r, nw, w, b = _kimi(T, seed=T)

    def step():
        a = a0 * 1.5  # a producer right before the gate
        x, s, wt, i = moe_gate(a, r, nw, EPS, w, b, 8, routed_scaling_factor=SCALE, shared_expert_id=256)
        return x, s, wt, i, wt.sum(1)  # and a consumer

    monkeypatch.setenv("TOKENSPEED_PDL", "0")
    want = step()
    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    assert all(torch.equal(p, q) for p, q in zip(step(), want, strict=True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(20):
        for o in outs:
            o.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(outs, want, strict=True))
