"""Triton paged absorbed-MLA decode / verify (split-KV, balanced per request) against `mla_attention_paged`.

Checked: Q = 1 (decode) and Q > 1 (verify, causal bottom-right aligned, Q folded into the rows of the tile),
mixed history lengths, page sizes that do not divide the lengths, random non-contiguous page tables (unused
pages poisoned with NaN), padding sequences (kv_len 0: zeros, nothing read), the balanced and the uniform split
plans with several max_splits (1: no combine; large: a long sequence takes more splits than max_splits in the
balanced plan), a strided q, head counts that do not fill a row tile, the host mirror of the plan, and (CUDA)
bf16 / fp8 caches at the real shapes (Dl 576 = 512 + 64) and CUDA-graph capture / replay on new inputs.
Tolerances: fp32 within 1e-5 relative (interpreter), bf16 within 1e-2, fp8 cache within 2e-2 of the reference
on the same fp8 cache. Outputs start poisoned with NaN.
"""

from __future__ import annotations


import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # noqa: E402,F401 - sets up Triton first




def make(kv_lens, Q, H, Dl, page_size, q_dtype, cache_dtype, device, kv_scale=1.0, seed=0, spare_pages=3):
    # A live sequence always holds its Q new tokens (kv_len >= Q); shorter ones would give queries no keys at all.
    kv_lens = [max(k, Q) if k > 0 else k for k in kv_lens]
    """Random queries, a cache whose pages are handed out in random order (unused rows NaN), a page table."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = len(kv_lens)
    pages = [-(-max(k, 0) // page_size) for k in kv_lens]
    W = max(max(pages), 1) + 1
    P = sum(pages) + spare_pages
    perm = torch.randperm(P, generator=g).tolist()
    table = torch.randint(0, P, (N, W), generator=g, dtype=torch.int32)  # junk past each sequence's pages
    it = iter(perm)
    for n, np_ in enumerate(pages):
        for i in range(np_):
            table[n, i] = next(it)
    cache = torch.full((P, page_size, Dl), float("nan"))
    flat = cache.view(-1, Dl)
    for n, k in enumerate(kv_lens):
        if k > 0:
            pos = torch.arange(k)
            rows = table[n, pos // page_size].long() * page_size + pos % page_size
            flat[rows] = torch.randn(k, Dl, generator=g) / kv_scale
    if cache_dtype == torch.float8_e4m3fn:
        cache = cache.nan_to_num(0.0)  # fp8 e4m3fn has NaN, but keep the unused rows finite and harmless
    q = torch.randn(N, Q, H, Dl, generator=g)
    return {
        "q": q.to(q_dtype).to(device), "cache": cache.to(cache_dtype).to(device), "page_table": table.to(device),
        "kv_lens": torch.tensor(kv_lens, dtype=torch.int64, device=device),
    }


def reference(inp, scale, v_dim, kv_scale=1.0):
    """mla_attention_paged per live sequence (its padded batch path would read the NaN-poisoned rows past the
    shorter sequences' ends); padding rows are zeros."""
    from tokenspeed.ops.reference.mla import mla_attention_paged

    q = inp["q"]
    N, Q, H, _ = q.shape
    out = torch.zeros(N, Q, H, v_dim, dtype=q.dtype, device=q.device)
    for n, k in enumerate(inp["kv_lens"].tolist()):
        if k > 0:
            out[n] = mla_attention_paged(q[n], inp["cache"], inp["page_table"][n:n + 1], [0, Q], [k], scale, v_dim,
                                         kv_scale)
    return out


def run(inp, scale, v_dim, kv_scale=1.0, **kw):
    from tokenspeed.ops.triton.mla_decode import mla_decode

    N, Q, H, _ = inp["q"].shape
    out = torch.full((N, Q, H, v_dim), float("nan"), dtype=inp["q"].dtype, device=inp["q"].device)
    y = mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], scale, v_dim, kv_scale, out=out, **kw)
    assert y is out
    return y


def check(kv_lens, Q, H, Dl, v_dim, page_size, q_dtype, cache_dtype, device, tol, kv_scale=1.0, seed=0, **kw):
    inp = make(kv_lens, Q, H, Dl, page_size, q_dtype, cache_dtype, device, kv_scale=kv_scale, seed=seed)
    scale = Dl ** -0.5
    o = run(inp, scale, v_dim, kv_scale, **kw)
    ref = reference(inp, scale, v_dim, kv_scale)
    err = rel_err(o, ref)
    assert err < tol, err
    for n, k in enumerate(kv_lens):
        if k <= 0:
            assert torch.equal(o[n], torch.zeros_like(o[n]))
    return err


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
SMALL = {"H": 4, "Dl": 40, "v_dim": 32}  # Dl = 32 + 8


@cpu_interp
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("balanced,max_splits", [(True, 1), (True, 3), (True, 8), (False, 3)])
def test_interp(page_size, Q, balanced, max_splits):
    lens = [max(k, Q) if k else 0 for k in [1, 7, 100, 0, 33]]  # kv_len >= Q: the new rows are in the cache
    check(lens, Q, **SMALL, page_size=page_size, q_dtype=torch.float32, cache_dtype=torch.float32,
          device="cpu", tol=1e-5, balanced=balanced, max_splits=max_splits, BLOCK_N=16, min_chunk=16)


@cpu_interp
def test_interp_odd_widths_and_heads():
    """Dl - v_dim and v_dim not powers of two (masked tiles), 3 heads x Q 2 = 6 rows in a 16-row tile."""
    check([5, 50, 19], 2, 3, 30 + 5, 30, 8, torch.float32, torch.float32, "cpu", 1e-5, max_splits=4,
          BLOCK_N=16, min_chunk=16)


@cpu_interp
def test_interp_rows_over_tiles_and_strided_q():
    """Q * H = 20 rows over two 16-row programs; q a strided view; kv_scale folded in."""
    inp = make([40, 9], 5, 4, 40, 4, torch.float32, torch.float32, "cpu", kv_scale=0.5, seed=3)
    big = torch.randn(2, 5, 4, 48)
    big[..., :40] = inp["q"]
    inp["q"] = big[..., :40]
    o = run(inp, 0.2, 32, 0.5, max_splits=2, BLOCK_N=16, min_chunk=16, BLOCK_H=16)
    assert rel_err(o, reference(inp, 0.2, 32, 0.5)) < 1e-5


@cpu_interp
@pytest.mark.parametrize("balanced", [True, False])
def test_interp_all_padding_and_defaults(balanced):
    check([0, 0], 1, **SMALL, page_size=4, q_dtype=torch.float32, cache_dtype=torch.float32, device="cpu",
          tol=1e-5, balanced=balanced, max_splits=2)
    check([3, 0, 70], 2, **SMALL, page_size=16, q_dtype=torch.float32, cache_dtype=torch.float32, device="cpu",
          tol=1e-5, balanced=balanced)


@cpu_interp
def test_interp_long_sequence_takes_more_than_max_splits():
    """Balanced plan: one long history among short ones gets more splits than max_splits (flat work list)."""
    from tokenspeed.ops.triton.mla_decode import plan_splits

    lens = [200, 3, 5, 2]
    chunks, counts = plan_splits(lens, 3, True, block_n=16, min_chunk=16)
    assert counts[0] > 3 and sum(counts) <= 3 * len(lens) and len(set(chunks)) == 1
    check(lens, 1, **SMALL, page_size=4, q_dtype=torch.float32, cache_dtype=torch.float32, device="cpu",
          tol=1e-5, max_splits=3, BLOCK_N=16, min_chunk=16)


def test_plan_balanced_properties():
    """Host mirror: the balanced plan never needs more slots than the grid has; uniform uses <= max_splits."""
    from tokenspeed.ops.triton.mla_decode import default_max_splits, plan_splits

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        N = int(torch.randint(1, 40, (1,), generator=g))
        ms = int(torch.randint(1, 20, (1,), generator=g))
        lens = torch.randint(-1, 70000, (N,), generator=g).tolist()
        _, counts = plan_splits(lens, ms, True)
        assert sum(counts) <= N * ms
        assert all(c >= 1 for c, k in zip(counts, lens) if k > 0) and all(c == 0 for c, k in zip(counts, lens)
                                                                         if k <= 0)
        _, ucounts = plan_splits(lens, ms, False)
        assert all(c <= ms for c in ucounts)
    mixed = [65536, 16384, 4096, 1024] * 4
    _, counts = plan_splits(mixed, default_max_splits(16, 32), True)
    assert counts[:4] == [48, 12, 3, 1]
    assert default_max_splits(16, 32) * 16 >= 2 * 132


# ----------------------------------------------------------------------------- CUDA
REAL = {"Dl": 576, "v_dim": 512}
MIXED = [65536, 16384, 4096, 1024]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("H", [32, 16, 12])
@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("kv_lens", [MIXED, [4096] * 4, [1, 0, 777, 3000, 65]])
@pytest.mark.parametrize("balanced", [True, False])
def test_bf16_gpu(H, Q, kv_lens, balanced):
    check(kv_lens, Q, H, **REAL, page_size=64, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, device="cuda",
          tol=1e-2, balanced=balanced)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("cfg", [{}, {"BLOCK_H": 16, "BLOCK_N": 64}, {"BLOCK_H": 32, "BLOCK_N": 16, "num_warps": 4}])
def test_bf16_configs_gpu(max_splits, cfg):
    check([16384, 1024, 0, 50], 2, 16, **REAL, page_size=64, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
          device="cuda", tol=1e-2, max_splits=max_splits, **cfg)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("Q", [1, 3])
def test_fp32_gpu(Q):
    check([1, 7, 1000, 0, 333], Q, 4, 40, 32, 16, torch.float32, torch.float32, "cuda", 1e-5, max_splits=4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("Q", [1, 4])
def test_fp8_cache_gpu(Q):
    check([8192, 1024, 0, 300], Q, 16, **REAL, page_size=64, q_dtype=torch.bfloat16,
          cache_dtype=torch.float8_e4m3fn, device="cuda", tol=2e-2, kv_scale=0.25)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("balanced", [True, False])
def test_cuda_graph_replay_gpu(balanced):
    """Captured once; new kv_lens / page table / q copied into the static tensors; replay == reference."""
    from tokenspeed.ops.triton.mla_decode import mla_decode

    Q, H = 2, 16
    scale = 576 ** -0.5
    first = make([3000, 100, 0, 13000], Q, H, 576, page_size=64, q_dtype=torch.bfloat16,
                 cache_dtype=torch.bfloat16, device="cuda", seed=1, spare_pages=200)
    static = {k: v.clone() for k, v in first.items()}
    kw = {"max_splits": 8, "balanced": balanced}
    mla_decode(static["q"], static["cache"], static["page_table"], static["kv_lens"], scale, 512, **kw)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(static["q"], static["cache"], static["page_table"], static["kv_lens"], scale, 512, **kw)
    for seed, lens in ((2, [3100, 5, 700, 9001]), (3, [1, 0, 12000, 64])):
        new = make(lens, Q, H, 576, 64, torch.bfloat16, torch.bfloat16, "cuda", seed=seed, spare_pages=3)
        P = new["cache"].shape[0]
        static["cache"][:P].copy_(new["cache"])  # the static pool is larger; the new tables index its front
        static["page_table"].zero_()
        static["page_table"][:, :new["page_table"].shape[1]].copy_(new["page_table"])
        static["q"].copy_(new["q"])
        static["kv_lens"].copy_(new["kv_lens"])
        out.fill_(float("nan"))
        graph.replay()
        ref = reference(static, scale, 512)
        assert rel_err(out, ref) < 1e-2
