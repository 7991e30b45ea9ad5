"""Triton GEMV (`ops.linear`'s small-M kernel) against F.linear, and the routing of `ops.linear`.

Interpreter (fp32, small shapes): both kernel kinds, split-K 1 / several / more than the K steps, odd N and K,
M = 1..8 and 13, strided x rows and columns, outputs that start from poisoned memory; within 1e-5 relative.
Routing: host-only decisions from a routing table (no GPU needed), and `ops.linear` end to end on the CPU.
Weight prefetch: "regs" (the peeled first K step) gives the same bits as "none" in the interpreter for both kinds,
split-K, uneven K and one-step splits; the host's prefetch plan ("l2" only for PDL launches of 16-byte aligned
rows, its per-row byte cap) is checked without a GPU. The "l2" variant itself (inline asm) only compiles for
sm_90: benchmarks/pdl_compile_sm90.py checks its PTX.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.triton_env import (  # first: sets up Triton
    cpu_interp,
    needs_cuda,
    rel_err,
)
from tokenspeed import ops
from tokenspeed.ops import dispatch

TOL = 1e-5


def _gemv():
    from tokenspeed.ops.triton import gemv

    return gemv


def _poison_allocator(monkeypatch):
    """For this test, every torch.empty (the output, the split-K workspace) starts as NaN, so an element the
    kernels fail to write fails the check."""
    real_empty = torch.empty

    def empty(*shape, **kw):
        return real_empty(*shape, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", empty)


def check(M: int, N: int, K: int, monkeypatch, x: torch.Tensor | None = None, **cfg) -> None:
    x = torch.randn(M, K) if x is None else x
    w = torch.randn(N, K)
    ref = F.linear(x, w)
    _poison_allocator(monkeypatch)
    y = _gemv().gemv(x, w, **cfg)
    assert y.shape == (M, N) and y.dtype == x.dtype and y.is_contiguous()
    assert rel_err(y, ref) < TOL
    out = torch.full((M, N), float("nan"))
    assert _gemv().gemv(x, w, out=out, **cfg) is out
    assert rel_err(out, ref) < TOL


@cpu_interp
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 13])
def test_gemv_fma_all_m(M, monkeypatch):
    check(M, 100, 72, monkeypatch, kind="fma", block_n=32, block_k=32, split_k=1)


@cpu_interp
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_gemv_dot_all_m(M, monkeypatch):
    check(M, 100, 72, monkeypatch, kind="dot", block_n=32, block_k=32, split_k=1)


@cpu_interp
@pytest.mark.parametrize("kind", ["fma", "dot"])
@pytest.mark.parametrize("split_k", [2, 3, 16])  # 16 > the 9 BLOCK_K steps: capped, no empty splits
def test_gemv_split_k(kind, split_k, monkeypatch):
    check(5, 257, 130, monkeypatch, kind=kind, block_n=64, block_k=16, split_k=split_k)


@cpu_interp
@pytest.mark.parametrize("N,K", [(257, 130), (17, 8), (64, 256)])
def test_gemv_odd_and_even_shapes_default_config(N, K, monkeypatch):
    check(2, N, K, monkeypatch)


@cpu_interp
@pytest.mark.parametrize("kind", ["fma", "dot"])
def test_gemv_strided_x(kind, monkeypatch):
    base = torch.randn(6, 3 * 72)
    rows = base[::2, 8:80]  # row stride 432, unit column stride
    assert rows.stride() == (432, 1)
    check(3, 40, 72, monkeypatch, x=rows, kind=kind, block_n=16, block_k=32, split_k=2)
    cols = torch.randn(72, 4).t()  # [4, 72], strides (1, 4)
    assert cols.stride(1) == 4
    check(4, 40, 72, monkeypatch, x=cols, kind=kind, block_n=16, block_k=32)


@cpu_interp
def test_gemv_k_zero_and_bad_inputs():
    gemv = _gemv()
    assert torch.equal(gemv.gemv(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="M must be"):
        gemv.gemv(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="share a dtype"):
        gemv.gemv(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit column stride"):
        gemv.gemv(torch.randn(2, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="kind"):
        gemv.gemv(torch.randn(2, 8), torch.randn(4, 8), kind="wgmma")
    with pytest.raises(ValueError, match="out must be"):
        gemv.gemv(torch.randn(2, 8), torch.randn(4, 8), out=torch.empty(4, 2))


def test_default_config_fills_the_grid():
    gemv = _gemv()
    small = gemv.default_config(1, 448, 7168, 2, 132)
    assert small.kind == "dot" and small.split_k > 1 and 448 // small.block_n * small.split_k >= 32
    big = gemv.default_config(8, 163840, 7168, 2, 132)
    assert big.split_k == 1
    assert gemv.default_config(4, 4096, 128, 4, 132).kind == "fma"


# ---- weight prefetch before the PDL wait ----

PREFETCH_CASES = [  # (M, N, K, block_n, block_k, split_k): 1 step per split, uneven K, many steps, fused split-K
    (1, 100, 72, 32, 32, 3),
    (5, 257, 130, 64, 16, 4),
    (3, 40, 256, 16, 32, 1),
    (2, 17, 8, 16, 16, 1),
]


@cpu_interp
@pytest.mark.parametrize("kind", ["fma", "dot"])
@pytest.mark.parametrize("case", PREFETCH_CASES, ids=lambda c: "x".join(map(str, c)))
def test_prefetch_modes_same_bits(kind, case, monkeypatch):
    """"regs" peels the first K step (its W tile loaded before the wait): the same sums in the same order as
    "none", so the same bits; "l2" without PDL compiles to "none"."""
    M, N, K, bn, bk, split = case
    g = torch.Generator().manual_seed(N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    cfg = {"kind": kind, "block_n": bn, "block_k": bk, "split_k": split}
    want = _gemv().gemv(x, w, prefetch="none", **cfg)
    assert rel_err(want, F.linear(x.double(), w.double()).float()) < TOL
    _poison_allocator(monkeypatch)
    for mode in ("regs", "l2"):
        assert torch.equal(_gemv().gemv(x, w, prefetch=mode, **cfg), want), mode
    assert torch.equal(_gemv().gemv(x, w, prefetch="regs", reduce="launch", **cfg), want)


def test_prefetch_plan_host():
    gemv = _gemv()
    assert gemv.GemvConfig().prefetch == "regs"  # the default (measured best in the H200 chain benchmark)
    cfg = gemv.GemvConfig("dot", block_n=64, block_k=128, split_k=4, num_stages=4, prefetch="l2")
    w = torch.empty(2304, 4096, dtype=torch.bfloat16)
    mode, row_bytes = gemv.prefetch_plan(cfg, w, 36, 4, True, 132)  # o_proj: 144 programs, all resident
    assert mode == "l2" and row_bytes == gemv.PREFETCH_L2_BYTES // (144 * 64) // 16 * 16 >= 2048  # whole split
    mode, row_bytes = gemv.prefetch_plan(cfg, w, 1000, 1, True, 132)  # many programs: spread over resident ones
    assert mode == "l2" and row_bytes == gemv.PREFETCH_L2_BYTES // (264 * 64) // 16 * 16
    assert gemv.prefetch_plan(cfg, w, 36, 4, False, 132) == ("none", 0)  # no PDL: no wait to overlap
    odd_rows = torch.empty(100, 4097, dtype=torch.bfloat16)[:, :4096]  # row stride 8194 B: not 16-byte aligned
    assert gemv.prefetch_plan(cfg, odd_rows, 36, 4, True, 132) == ("none", 0)
    shifted = torch.empty(100, 4096 + 8, dtype=torch.bfloat16)[:, 1:4097]  # rows start 2 B past alignment
    assert gemv.prefetch_plan(cfg, shifted, 36, 4, True, 132) == ("none", 0)
    tiny_k = gemv.GemvConfig("fma", block_n=16, block_k=4, prefetch="l2")  # 8-byte K steps: split starts not 16-byte aligned
    assert gemv.prefetch_plan(tiny_k, w, 36, 4, True, 132) == ("none", 0)
    regs = gemv.GemvConfig(prefetch="regs")
    assert gemv.prefetch_plan(regs, w, 36, 4, True, 132) == gemv.prefetch_plan(regs, w, 36, 4, False, 132) \
        == ("regs", 0)
    with pytest.raises(ValueError, match="prefetch"):
        gemv.GemvConfig(prefetch="smem").validate()


# ---- routing (host only) ----

TABLE = {
    "dtypes": ["bfloat16", "float16", "float32"],
    "entries": {
        "100,72": {
            "1": {"kernel": "triton", "kind": "fma", "block_n": 32, "block_k": 32, "split_k": 1, "num_warps": 4,
                  "num_stages": 1, "us": 1.0, "torch_us": 2.0},
            "4": {"kernel": "torch", "us": 3.0, "torch_us": 2.0},
            "8": {"kernel": "triton", "kind": "dot", "block_n": 32, "block_k": 32, "split_k": 2, "num_warps": 4,
                  "num_stages": 1},
        },
    },
}


@pytest.fixture
def table():
    dispatch.set_linear_table(TABLE)
    yield dispatch.linear_table()
    dispatch.set_linear_table(None)


def test_route_buckets(table):
    route = dispatch.linear_route
    assert route(1, 100, 72, torch.bfloat16, table)["kind"] == "fma"
    assert route(2, 100, 72, torch.bfloat16, table) is None  # bucket 4 says torch
    assert route(4, 100, 72, torch.float16, table) is None
    cfg = route(5, 100, 72, torch.float32, table)  # bucket 8
    assert cfg == {"kind": "dot", "block_n": 32, "block_k": 32, "split_k": 2, "num_warps": 4, "num_stages": 1}
    assert route(9, 100, 72, torch.bfloat16, table) is None  # past the largest bucket
    assert route(1, 100, 73, torch.bfloat16, table) is None  # no entry
    assert route(1, 100, 72, torch.float64, table) is None  # dtype not measured
    assert table.max_m == 8
    empty = dispatch.parse_linear_table({})
    assert dispatch.linear_route(1, 100, 72, torch.bfloat16, empty) is None


def test_table_rejects_unknown_kernel():
    with pytest.raises(ValueError, match="kernel"):
        dispatch.parse_linear_table({"entries": {"4,4": {"1": {"kernel": "cutlass"}}}})


def test_linear_config_cuda_like_conditions(table, monkeypatch):
    """On CUDA (simulated: use_triton says yes) a table hit picks triton; misses and odd inputs take torch."""
    monkeypatch.setattr(dispatch, "use_triton", lambda *t: True)
    w = torch.randn(100, 72)
    assert dispatch.linear_config(torch.randn(1, 72), w)["kind"] == "fma"
    assert dispatch.linear_config(torch.randn(2, 3, 72), w)["kind"] == "dot"  # M = 6 -> bucket 8
    assert dispatch.linear_config(torch.randn(3, 72), w) is None  # bucket 4: torch
    assert dispatch.linear_config(torch.randn(1, 72), torch.randn(101, 72)) is None  # missing entry
    assert dispatch.linear_config(torch.randn(72), w) is None  # 1-D x
    assert dispatch.linear_config(torch.randn(0, 72), w) is None  # M = 0
    assert dispatch.linear_config(torch.randn(1, 72), torch.randn(72, 100).t()) is None  # not row-major
    assert dispatch.linear_config(torch.randn(1, 72, dtype=torch.float64), w.double()) is None
    monkeypatch.setattr(dispatch, "use_triton", lambda *t: False)
    assert dispatch.linear_config(torch.randn(1, 72), w) is None


def test_packaged_table_parses():
    dispatch.set_linear_table(None)
    try:
        t = dispatch.linear_table()
        assert t.max_m <= dispatch.LINEAR_MAX_M
        assert torch.float32 not in t.dtypes or not t.routes  # measured in bf16
    finally:
        dispatch.set_linear_table(None)


def test_linear_cpu_is_f_linear(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    x, w = torch.randn(2, 3, 72), torch.randn(100, 72)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
    assert "linear" in ops.__all__


@cpu_interp
def test_linear_forced_triton_uses_table(table, monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = []
    mod = dispatch.kernels("gemv")
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda *a, **k: calls.append(k) or real(*a, **k))
    w = torch.randn(100, 72)
    for shape in [(1, 72), (2, 4, 72), (3, 72)]:
        x = torch.randn(*shape)
        y = ops.linear(x, w)
        assert y.shape == (*shape[:-1], 100)
        assert rel_err(y, F.linear(x, w)) < TOL
    assert [c["kind"] for c in calls] == ["fma", "dot"]  # (3, 72) is routed to torch by bucket 4


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("kind", ["fma", "dot"])
def test_gemv_bf16_gpu(M, kind):
    x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(448, 7168, device="cuda", dtype=torch.bfloat16)
    for split in (1, 4):
        y = _gemv().gemv(x, w, kind=kind, split_k=split, block_n=64 if kind == "dot" else 8, block_k=128)
        assert rel_err(y, F.linear(x.float(), w.float())) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_linear_routed_inside_cuda_graph(table, monkeypatch):
    """A routed ops.linear call (split-K, PDL launches) captures in a CUDA graph and replays on new inputs."""
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    dispatch.set_linear_table({"entries": {"448,7168": {"8": {"kernel": "triton", "kind": "dot", "block_n": 64,
                                                              "block_k": 128, "split_k": 8, "num_warps": 4,
                                                              "num_stages": 4}}}})
    w = torch.randn(448, 7168, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(5, 7168, device="cuda", dtype=torch.bfloat16)
    assert dispatch.linear_config(x, w) is not None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.linear(x, w)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops.linear(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, F.linear(x.float(), w.float())) < 1e-2
