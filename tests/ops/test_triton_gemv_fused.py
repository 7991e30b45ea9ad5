"""The GEMV's one-launch split-K reduction (per-n-tile semaphores) and its fp32-output (widening) mode.

Interpreter (CPU): the fused reduction gives the same bits as the two-launch one (`reduce="launch"`, the previous
scheme) for both kernel kinds, odd N, N not a multiple of BLOCK_N, K not a multiple of BLOCK_K, whatever order the
programs run in (the interpreter's grid walk is permuted), leaves every semaphore at zero, and fills outputs that
start as NaN; fp32 output of bf16 inputs matches an fp64 reference to 1e-5. Routing of widening `ops.linear` calls
is host-only. GPU: bit-identity of the two reductions in bf16 and inside a CUDA graph replayed several times.
"""

from __future__ import annotations

import random

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
# (M, N, K, block_n, block_k, split_k): odd N, N % block_n != 0, K % block_k != 0, split capped by the K steps
SHAPES = [
    (1, 100, 72, 32, 16, 3),
    (5, 257, 130, 64, 16, 4),
    (3, 17, 8, 16, 16, 2),  # one K step: capped to 1 split
    (8, 64, 256, 16, 32, 8),
    (13, 33, 100, 16, 32, 16),  # 4 K steps: 4 splits
    (2, 7, 96, 16, 32, 2),
]


def _gemv():
    from tokenspeed.ops.triton import gemv

    return gemv


def _sem_clean() -> bool:
    sem = _gemv()._semaphores.get(torch.device("cpu"))
    return sem is None or not sem.any().item()


def _pair(M, N, K, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


@cpu_interp
@pytest.mark.parametrize("kind", ["fma", "dot"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_equals_two_launch_bits(kind, shape, poison_empty):
    M, N, K, bn, bk, split = shape
    x, w = _pair(M, N, K)
    cfg = {"kind": kind, "block_n": bn, "block_k": bk, "split_k": split}
    fused = _gemv().gemv(x, w, **cfg)
    launch = _gemv().gemv(x, w, reduce="launch", **cfg)
    assert torch.equal(fused, launch)
    assert rel_err(fused, F.linear(x.double(), w.double())) < TOL
    assert _sem_clean()
    again = _gemv().gemv(x, w, **cfg)  # the counters were reset: the second call reduces the same way
    assert torch.equal(again, fused) and _sem_clean()


@cpu_interp
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_fused_equals_two_launch_bits_bf16(out_dtype, poison_empty):
    """bf16 inputs (the CUDA-core kernel; the interpreter's tl.dot does not take bf16): one rounding of the same
    fp32 sum, so bf16 outputs are bit-identical too."""
    x, w = _pair(5, 257, 130, torch.bfloat16)
    cfg = {"kind": "fma", "block_n": 64, "block_k": 16, "split_k": 4, "out_dtype": out_dtype}
    fused = _gemv().gemv(x, w, **cfg)
    assert torch.equal(fused, _gemv().gemv(x, w, reduce="launch", **cfg)) and _sem_clean()
    assert fused.dtype == (out_dtype or torch.bfloat16)


def _permute_grid(monkeypatch, seed: int | None) -> None:
    """Run the interpreter's programs in a shuffled order (seed None: reversed), so the splits of a tile arrive
    at the semaphore in another order than s = 0, 1, ..."""
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    real = b.set_grid_idx
    state = {}

    def set_grid_idx(x, y, z):
        nx, ny, nz = b.grid_dim
        if state.get("dim") != (nx, ny, nz):
            order = list(range(nx * ny * nz))[::-1]
            if seed is not None:
                random.Random(seed).shuffle(order)
            state.update(dim=(nx, ny, nz), order=order)
        k = state["order"][(x * ny + y) * nz + z]
        real(k // (ny * nz), k // nz % ny, k % nz)

    monkeypatch.setattr(b, "set_grid_idx", set_grid_idx)


@cpu_interp
@pytest.mark.parametrize("seed", [None, 1, 2])
@pytest.mark.parametrize("kind", ["fma", "dot"])
def test_arrival_order_does_not_change_bits(kind, seed, monkeypatch):
    x, w = _pair(6, 150, 200, seed=3)
    cfg = {"kind": kind, "block_n": 32, "block_k": 32, "split_k": 7}
    want = _gemv().gemv(x, w, reduce="launch", **cfg)
    _permute_grid(monkeypatch, seed)
    got = _gemv().gemv(x, w, **cfg)
    assert torch.equal(got, want) and _sem_clean()


@cpu_interp
def test_out_argument_and_more_tiles_than_counters(monkeypatch):
    """`out` receives the fused result; a grid with more n-tiles than counters takes the two-launch reduction."""
    gemv = _gemv()
    x, w = _pair(4, 100, 72)
    want = gemv.gemv(x, w, kind="dot", block_n=16, block_k=16, split_k=3, reduce="launch")
    out = torch.full((4, 100), float("nan"))
    assert gemv.gemv(x, w, kind="dot", block_n=16, block_k=16, split_k=3, out=out) is out
    assert torch.equal(out, want)
    launches = []

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    real = gemv._splitk_reduce_kernel
    monkeypatch.setattr(gemv, "_splitk_reduce_kernel", Counting())
    assert torch.equal(gemv.gemv(x, w, kind="dot", block_n=16, block_k=16, split_k=3), want)
    assert not launches  # fused
    monkeypatch.setitem(gemv._semaphores, torch.device("cpu"), torch.zeros(4, dtype=torch.int32))  # 7 tiles > 4
    assert torch.equal(gemv.gemv(x, w, kind="dot", block_n=16, block_k=16, split_k=3), want)
    assert len(launches) == 1


@cpu_interp
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("reduce", ["fused", "launch"])
def test_fp32_output_of_bf16_inputs(split_k, reduce, poison_empty):
    """out_dtype=fp32: the fp32 accumulation of exact bf16 products, never rounded to bf16."""
    gemv = _gemv()
    x, w = _pair(3, 96, 160, torch.bfloat16, seed=5)
    ref = F.linear(x.double(), w.double())
    y = gemv.gemv(x, w, kind="fma", block_n=16, block_k=32, split_k=split_k, reduce=reduce, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (3, 96) and rel_err(y, ref) < TOL
    out = torch.full((3, 96), float("nan"))
    assert gemv.gemv(x, w, kind="fma", split_k=split_k, out_dtype=torch.float32, out=out) is out
    assert rel_err(out, ref) < TOL
    xf, wf = x.float(), w.float()  # fp32 inputs: out_dtype fp32 is the plain path
    assert rel_err(gemv.gemv(xf, wf, kind="dot", block_n=16, block_k=32, split_k=split_k, reduce=reduce,
                             out_dtype=torch.float32), ref) < TOL


def test_bad_out_dtype_and_reduce():
    gemv = _gemv()
    with pytest.raises(ValueError, match="out_dtype"):
        gemv.gemv(torch.randn(2, 8), torch.randn(4, 8), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        gemv.gemv(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), out_dtype=torch.float32,
                  out=torch.empty(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="reduce"):
        gemv.gemv(torch.randn(2, 8), torch.randn(4, 8), reduce="atomic")
    with pytest.raises(ValueError, match="out_dtype"):
        ops.linear(torch.randn(2, 8), torch.randn(4, 8), out_dtype=torch.float16)


# ---- widening ops.linear: routing (host only) and the CPU paths ----

TABLE = {
    "dtypes": ["bfloat16", "float16"],
    "entries": {
        "100,72": {
            "1": {"kernel": "triton", "kind": "fma", "block_n": 32, "block_k": 32, "split_k": 2, "num_warps": 4,
                  "num_stages": 1, "reduce": "launch"},
            "4": {"kernel": "torch"},
        },
    },
}


@pytest.fixture
def table():
    dispatch.set_linear_table(TABLE)
    yield dispatch.linear_table()
    dispatch.set_linear_table(None)


def test_widening_routes(table, monkeypatch):
    """Widening calls take the table's config where it has the (M bucket, N, K), else the default config ({});
    an explicit torch entry, M > 16 and non-16-bit inputs stay on torch."""
    monkeypatch.setattr(dispatch, "use_triton", lambda *t: True)
    bf, f32 = torch.bfloat16, torch.float32
    w = torch.randn(100, 72, dtype=bf)
    cfg = dispatch.linear_config(torch.randn(1, 72, dtype=bf), w, f32)
    assert cfg["kind"] == "fma" and cfg["reduce"] == "launch"
    assert dispatch.linear_config(torch.randn(3, 72, dtype=bf), w, f32) is None  # bucket 4: torch
    assert dispatch.linear_config(torch.randn(9, 72, dtype=bf), w, f32) == {}  # past the buckets
    assert dispatch.linear_config(torch.randn(1, 72, dtype=bf), torch.randn(256, 72, dtype=bf), f32) == {}
    assert dispatch.linear_config(torch.randn(17, 72, dtype=bf), w, f32) is None  # M > 16
    assert dispatch.linear_config(torch.randn(1, 72, dtype=bf), w, bf)["kind"] == "fma"  # same dtype: table
    assert dispatch.linear_config(torch.randn(1, 72, dtype=bf), torch.randn(256, 72, dtype=bf), bf) is None
    assert dispatch.linear_config(torch.randn(1, 72), torch.randn(100, 72), f32) is None  # fp32: not measured
    assert dispatch.linear_config(torch.randn(1, 72, dtype=torch.float64), w.double(), f32) is None


def test_linear_widening_cpu_is_fp32_product(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    x, w = torch.randn(2, 3, 72).bfloat16(), torch.randn(100, 72).bfloat16()
    y = ops.linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x.float(), w.float()))
    assert torch.equal(ops.linear(x, w, out_dtype=torch.bfloat16), F.linear(x, w))


@cpu_interp
def test_linear_widening_forced_triton(table, monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = []
    mod = dispatch.kernels("gemv")
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda *a, **k: calls.append(k) or real(*a, **k))
    x, w = torch.randn(1, 1, 72).bfloat16(), torch.randn(100, 72).bfloat16()
    y = ops.linear(x, w, out_dtype=torch.float32)
    assert y.shape == (1, 1, 100) and y.dtype == torch.float32
    assert rel_err(y, F.linear(x.double(), w.double())) < TOL
    assert calls and calls[0]["out_dtype"] == torch.float32 and calls[0]["reduce"] == "launch"


# ---- GPU ----

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["fma", "dot"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_fused_bits_bf16_gpu(kind, out_dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K, split in [(1, 256, 2304, 4), (3, 448, 7168, 16), (8, 129, 1000, 5)]:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
        cfg = {"kind": kind, "block_n": 64 if kind == "dot" else 8, "block_k": 128, "split_k": split,
               "out_dtype": out_dtype}
        launch = _gemv().gemv(x, w, reduce="launch", **cfg)
        for _ in range(3):
            assert torch.equal(_gemv().gemv(x, w, **cfg), launch)
        tol = 1e-5 if out_dtype == torch.float32 else 1e-2
        assert rel_err(launch, F.linear(x.double(), w.double())) < tol
    assert not _gemv()._semaphores[x.device].any().item()


@pytest.mark.gpu
@needs_cuda
def test_fused_in_cuda_graph_replays():
    """Back-to-back fused split-K GEMVs (PDL dependents of each other) in a graph, replayed: the counters are
    reset by every call, so each replay gives the eager bits."""
    x = torch.randn(2, 7168, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, 7168, device="cuda", dtype=torch.bfloat16) for n in (448, 448, 256)]
    cfg = {"kind": "dot", "block_n": 64, "block_k": 128, "split_k": 8}
    want = [_gemv().gemv(x, w, **cfg) for w in ws]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = [_gemv().gemv(x, w, **cfg) for w in ws]
    for _ in range(5):
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(y, v) for y, v in zip(ys, want))
    assert not _gemv()._semaphores[x.device].any().item()

