"""Triton paged absorbed-MLA decode / verify (split-KV, balanced per request) against `mla_attention_paged`.

Checked: Q = 1 (decode) and Q > 1 (verify, causal bottom-right aligned, Q folded into the rows of the tile),
mixed history lengths, page sizes that do not divide the lengths, random non-contiguous page tables (unused
pages poisoned with NaN), padding sequences (kv_len 0: zeros, nothing read), the balanced and the uniform split
plans with several max_splits (1: no combine; large: a long sequence takes more splits than max_splits in the
balanced plan), a strided q, head counts that do not fill a row tile, the host mirror of the plan, the split
policy's module constants (MIN_CHUNK, DEFAULT_WAVES: read at call time, in the kernel's plan too), and (CUDA)
bf16 / fp8 caches at the real shapes (Dl 576 = 512 + 64) and CUDA-graph capture / replay on new inputs, with PDL
on and off. (q / q_rope views: tests/ops/test_triton_mla_prep.py.)
Tolerances: fp32 within 1e-5 relative (interpreter), bf16 within 1e-2, fp8 cache within 2e-2 of the reference
on the same fp8 cache. Outputs start poisoned with NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter


def make(kv_lens, Q, H, Dl, page_size, q_dtype, cache_dtype, device, kv_scale=1.0, seed=0, spare_pages=3):
    """Random queries, a cache whose pages are handed out in random order (unused rows NaN), a page table."""
    # A live sequence always holds its Q new tokens (kv_len >= Q); shorter ones would give queries no keys at all.
    kv_lens = [max(k, Q) if k > 0 else k for k in kv_lens]
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
@pytest.mark.parametrize("page_size,Q,max_splits", [(4, 1, 1), (16, 3, 8), (4, 3, 3)])
def test_interp_keys_major_loop(page_size, Q, max_splits):
    """The keys-major dots ([keys, rows] scores, [v_dim, rows] output) == the reference, including splits shorter
    than one tile and rows past the causal limit."""
    lens = [max(k, Q) if k else 0 for k in [1, 7, 100, 0, 33]]
    check(lens, Q, **SMALL, page_size=page_size, q_dtype=torch.float32, cache_dtype=torch.float32,
          device="cpu", tol=1e-5, max_splits=max_splits, BLOCK_N=16, min_chunk=16, keys_major=True)


def test_orientation_defaults(monkeypatch):
    """Keys-major by default for a bf16 cache only (64-key tiles); rows-major (32-key tiles) for fp8 / fp32;
    the keyword beats KEYS_MAJOR, which beats the dtype default; an explicit BLOCK_N is kept."""
    import tokenspeed.ops.triton.mla_decode as mod

    assert mod.uses_keys_major(torch.bfloat16) and mod.launch_block_n(torch.bfloat16) == 64
    assert not mod.uses_keys_major(torch.float8_e4m3fn) and mod.launch_block_n(torch.float8_e4m3fn) == 32
    assert not mod.uses_keys_major(torch.float32)
    assert mod.uses_keys_major(torch.float8_e4m3fn, keys_major=True)
    assert mod.launch_block_n(torch.bfloat16, block_n=32) == 32
    monkeypatch.setattr(mod, "KEYS_MAJOR", False)
    assert not mod.uses_keys_major(torch.bfloat16) and mod.uses_keys_major(torch.bfloat16, keys_major=True)
    monkeypatch.setattr(mod, "KEYS_MAJOR", True)
    assert mod.uses_keys_major(torch.float32)


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
@pytest.mark.parametrize("max_splits", [40, 132])
def test_interp_combine_many_splits_one_tile(max_splits, monkeypatch):
    """A sequence split into more slots than the former 16-slot combine block (batch 1 over a long history): the
    one-tile combine (`combine_tiles`: BLOCK_S 64 / 256, narrower columns) against the reference, and against
    the 16-slot tiling (COMBINE_MAX_BLOCK_S = 16) within fp32 rounding."""
    from tokenspeed.ops.triton import mla_combine as mod

    kw = {"max_splits": max_splits, "BLOCK_N": 16, "min_chunk": 16}
    check([16 * max_splits - 5], 1, 4, 40, 32, 16, torch.float32, torch.float32, "cpu", 1e-5, **kw)
    inp = make([16 * max_splits - 5], 1, 4, 40, 16, torch.float32, torch.float32, "cpu", seed=3)
    one_tile = run(inp, 0.2, 32, **kw)
    monkeypatch.setattr(mod, "COMBINE_MAX_BLOCK_S", 16)
    assert mod.combine_tiles(max_splits, 32) == (16, 32)
    assert rel_err(one_tile, run(inp, 0.2, 32, **kw)) < 1e-6


def test_combine_tiles():
    from tokenspeed.ops.triton.mla_decode import COMBINE_TILE_ELEMS, combine_tiles

    assert combine_tiles(2, 512) == (16, 128)  # up to 16 slots: the former tiling
    assert combine_tiles(16, 512) == (16, 128)
    assert combine_tiles(33, 512) == (64, 64)
    assert combine_tiles(128, 512) == (128, 32)
    assert combine_tiles(132, 512) == (256, 16)  # batch 1 at one wave of 132 programs
    assert combine_tiles(1024, 512) == (256, 16)  # capped: a loop of 256-slot tiles
    assert combine_tiles(64, 24) == (64, 32)  # never wider than the value width's power of two
    for ms in (3, 17, 100, 300):
        bs, bv = combine_tiles(ms, 512)
        assert bs * bv <= max(COMBINE_TILE_ELEMS, 16 * 128) and bs >= min(ms, 256)


def test_combine_tiles_env(monkeypatch):
    from tokenspeed.ops.triton.mla_decode import combine_tiles

    monkeypatch.setenv("TOKENSPEED_MLA_COMBINE_MAX_S", "16")
    assert combine_tiles(132, 512) == (16, 128)
    for bad in ("12", "8", "x"):
        monkeypatch.setenv("TOKENSPEED_MLA_COMBINE_MAX_S", bad)
        with pytest.raises(ValueError, match="TOKENSPEED_MLA_COMBINE_MAX_S"):
            combine_tiles(132, 512)


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
    _, counts = plan_splits(mixed, default_max_splits(16, 32, waves=2.0), True)  # two waves of slots
    assert counts[:4] == [48, 12, 3, 1]
    assert default_max_splits(16, 32, waves=2.0) * 16 >= 2 * 132
    assert default_max_splits(16, 32) * 16 >= 132  # the default: one wave


def test_policy_constants_read_at_call_time(monkeypatch):
    """MIN_CHUNK and DEFAULT_WAVES are the defaults of every call made after they change (the lead sets them)."""
    from tokenspeed.ops.triton import mla_decode as mod

    assert mod.plan_splits([4096], 264) == mod.plan_splits([4096], 264, min_chunk=mod.MIN_CHUNK)
    monkeypatch.setattr(mod, "MIN_CHUNK", 512)
    assert mod.plan_splits([4096], 264) == ([512], [8])
    assert mod.default_max_splits(1, 32) == math.ceil(mod.DEFAULT_WAVES * 132)
    monkeypatch.setattr(mod, "DEFAULT_WAVES", 0.5)
    assert mod.default_max_splits(1, 32) == 66 and mod.default_max_splits(1, 32, waves=1.0) == 132


@cpu_interp
def test_interp_min_chunk_default_reaches_the_kernel(monkeypatch):
    """The split kernel's plan follows MIN_CHUNK (a runtime argument). With the combine stubbed out, a sequence
    the host plan gives one split is written by the split kernel itself (== reference), and one it gives several
    splits is not written at all (its output stays NaN): so the kernel planned as the host mirror says."""
    from tokenspeed.ops.triton import mla_decode as mod

    inp = make([90, 0, 7], 1, **{k: SMALL[k] for k in ("H", "Dl")}, page_size=4, q_dtype=torch.float32,
               cache_dtype=torch.float32, device="cpu")
    ref = reference(inp, 0.25, SMALL["v_dim"])
    monkeypatch.setattr(mod, "_mla_combine_kernel", type("Stub", (), {"__getitem__": lambda self, g: (
        lambda *a, **k: None)})())
    for mc in (16, 128):
        monkeypatch.setattr(mod, "MIN_CHUNK", mc)
        out = torch.full((3, 1, SMALL["H"], SMALL["v_dim"]), float("nan"))
        mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], 0.25, SMALL["v_dim"],
                       max_splits=4, BLOCK_N=16, out=out)
        _, counts = mod.plan_splits(inp["kv_lens"].tolist(), 4, True, 16)
        assert counts[0] == (6 if mc == 16 else 1)
        for n, c in enumerate(counts):
            if c > 1:
                assert torch.isnan(out[n]).all()
            else:
                assert rel_err(out[n], ref[n]) < 1e-5


# ----------------------------------------------------------------------------- CUDA
REAL = {"Dl": 576, "v_dim": 512}
MIXED = [65536, 16384, 4096, 1024]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("H", [32, 16, 12])
@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("kv_lens", [MIXED, [4096] * 4, [1, 0, 777, 3000, 65]])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("keys_major", [False, True])
def test_bf16_gpu(H, Q, kv_lens, balanced, keys_major):
    check(kv_lens, Q, H, **REAL, page_size=64, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, device="cuda",
          tol=1e-2, balanced=balanced, keys_major=keys_major)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("cfg", [{}, {"BLOCK_H": 16, "BLOCK_N": 64}, {"BLOCK_H": 32, "BLOCK_N": 16, "num_warps": 4}])
def test_bf16_configs_gpu(max_splits, cfg):
    check([16384, 1024, 0, 50], 2, 16, **REAL, page_size=64, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
          device="cuda", tol=1e-2, max_splits=max_splits, **cfg)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("balanced", [True, False])
def test_uniform_plan_bitwise_equal_gpu(monkeypatch, balanced):
    """UNIFORM_PLAN only re-reads the plan's scalars from lane 0 (they are the same in every thread): outputs are
    bit-identical with it on and off, uniform-batch and ragged, with and without the W_UV combine."""
    import tokenspeed.ops.triton.mla_decode as mod

    inp = make(MIXED + [0, 300], 2, 32, REAL["Dl"], page_size=64, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
               device="cuda", seed=5)
    rag = make_ragged([1, 33, 1, 0], [8192, 1024, 300, 0], 32, 576, 64, q_dtype=torch.bfloat16,
                      cache_dtype=torch.bfloat16, device="cuda")
    w_uv = torch.randn(32, 128, 512, dtype=torch.bfloat16, device="cuda") / 16

    def calls():
        uv = mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], 0.05, 512, balanced=balanced,
                            w_uv=w_uv)
        uv_rag = mod.mla_decode(rag["q"], rag["cache"], rag["page_table"], rag["kv_lens"], 0.05, 512,
                                cu_seqlens_q=rag["cu"], max_q=33, w_uv=w_uv)
        return run(inp, 0.05, 512, balanced=balanced), uv, run_ragged(rag, 0.05, 512), uv_rag

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(mod, "UNIFORM_PLAN", on)
        outs[on] = calls()
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    assert rel_err(outs[True][0], reference(inp, 0.05, 512)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("Q", [1, 3])
def test_fp32_gpu(Q):
    check([1, 7, 1000, 0, 333], Q, 4, 40, 32, 16, torch.float32, torch.float32, "cuda", 1e-5, max_splits=4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("keys_major", [False, True])
def test_fp8_cache_gpu(Q, keys_major):
    check([8192, 1024, 0, 300], Q, 16, **REAL, page_size=64, q_dtype=torch.bfloat16,
          cache_dtype=torch.float8_e4m3fn, device="cuda", tol=2e-2, kv_scale=0.25, keys_major=keys_major)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pdl_on", ["1", "0"])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("keys_major", [False, True])
def test_cuda_graph_replay_gpu(monkeypatch, balanced, pdl_on, keys_major):
    """Captured once (PDL launches or plain ones); new kv_lens / page table / q copied into the static tensors;
    replay == reference."""
    from tokenspeed.ops.triton.mla_decode import mla_decode

    monkeypatch.setenv("TOKENSPEED_PDL", pdl_on)

    Q, H = 2, 16
    scale = 576 ** -0.5
    first = make([3000, 100, 0, 13000], Q, H, 576, page_size=64, q_dtype=torch.bfloat16,
                 cache_dtype=torch.bfloat16, device="cuda", seed=1, spare_pages=200)
    static = {k: v.clone() for k, v in first.items()}
    kw = {"max_splits": 8, "balanced": balanced, "keys_major": keys_major}
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


# ----------------------------------------------------------------------------- ragged (cu_seqlens_q)
def make_ragged(q_lens, kv_lens, H, Dl, page_size, q_dtype=torch.float32, cache_dtype=torch.float32, device="cpu",
                kv_scale=1.0, seed=0):
    """A ragged batch: `make`'s scattered cache and page table for kv_lens, flat queries q [T, H, Dl] and
    cu_seqlens [N+1] int32. A live sequence needs kv_len >= q_len (its new rows are in the cache)."""
    inp = make(kv_lens, 1, H, Dl, page_size, q_dtype, cache_dtype, device, kv_scale=kv_scale, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 100)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    inp["q"] = torch.randn(cu[-1], H, Dl, generator=g).to(q_dtype).to(device)
    inp["cu"] = torch.tensor(cu, dtype=torch.int32, device=device)
    inp["q_lens"] = list(q_lens)
    return inp


def reference_ragged(inp, scale, v_dim, kv_scale=1.0):
    """`mla_attention_paged` per live sequence (kv_len > 0, some tokens); zeros elsewhere."""
    from tokenspeed.ops.reference.mla import mla_attention_paged

    q, cu = inp["q"], inp["cu"].tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=q.dtype, device=q.device)
    for n, k in enumerate(inp["kv_lens"].tolist()):
        if k > 0 and cu[n + 1] > cu[n]:
            out[cu[n]:cu[n + 1]] = mla_attention_paged(q[cu[n]:cu[n + 1]], inp["cache"], inp["page_table"][n:n + 1],
                                                       [0, cu[n + 1] - cu[n]], [k], scale, v_dim, kv_scale)
    return out


def run_ragged(inp, scale, v_dim, max_q=None, kv_scale=1.0, q_rope=None, q=None, **kw):
    from tokenspeed.ops.triton.mla_decode import mla_decode

    T, H = inp["q"].shape[:2]
    out = torch.full((T, H, v_dim), float("nan"), dtype=inp["q"].dtype, device=inp["q"].device)
    max_q = max(inp["q_lens"]) if max_q is None else max_q
    y = mla_decode(inp["q"] if q is None else q, inp["cache"], inp["page_table"], inp["kv_lens"], scale, v_dim,
                   kv_scale, q_rope=q_rope, cu_seqlens_q=inp["cu"], max_q=max_q, out=out, **kw)
    assert y is out
    return y


def check_ragged(inp, v_dim, tol, kv_scale=1.0, **kw):
    scale = inp["q"].shape[-1] ** -0.5
    o = run_ragged(inp, scale, v_dim, kv_scale=kv_scale, **kw)
    ref = reference_ragged(inp, scale, v_dim, kv_scale)
    assert rel_err(o, ref) < tol
    cu = inp["cu"].tolist()
    for n, k in enumerate(inp["kv_lens"].tolist()):
        if k <= 0:  # padding: its rows are zeros
            assert torch.equal(o[cu[n]:cu[n + 1]], torch.zeros_like(o[cu[n]:cu[n + 1]]))
    return o


# decodes, a 37-token tail, a padding sequence with a token, a 16-token tail, a sequence without new tokens
RAGGED_Q = [1, 1, 37, 1, 16, 0]
RAGGED_KV = [5, 1, 160, 0, 40, 7]


@cpu_interp
@pytest.mark.parametrize("max_splits,max_q,page_size", [(1, 37, 4), (3, 37, 16), (8, 100, 4), (None, 64, 16)])
def test_interp_ragged(poison_empty, max_splits, max_q, page_size):
    """Mixed query lengths against the reference; the workspace starts NaN (poison_empty), so a partial read
    before it is written, or a row the combine misses, fails; max_q larger than needed (a larger grid)."""
    from tokenspeed.ops.triton.mla_decode import plan_ragged

    inp = make_ragged(RAGGED_Q, RAGGED_KV, SMALL["H"], SMALL["Dl"], page_size, seed=page_size)
    kw = {"max_splits": max_splits, "BLOCK_N": 16, "min_chunk": 16}
    if max_splits is not None:
        plan = plan_ragged(RAGGED_Q, RAGGED_KV, SMALL["H"], max_splits, 16, 16, 16, max_q)
        assert (plan["splits"][2] > 1) == (max_splits > 1)  # the 160-row tail is split unless max_splits == 1
    check_ragged(inp, SMALL["v_dim"], 1e-5, max_q=max_q, **kw)


@cpu_interp
@pytest.mark.parametrize("unroll", ["2", "4", "8"])
def test_interp_ragged_merge_unroll_same_bits(monkeypatch, unroll):
    """The ragged combine's merge with the loads of `unroll` split slots issued together gives the bits of the
    one-slot loop (TOKENSPEED_MLA_MERGE_UNROLL=1), at split counts that are not multiples of it (max_splits 7)."""
    inp = make_ragged(RAGGED_Q, RAGGED_KV, SMALL["H"], SMALL["Dl"], 4, seed=5)
    kw = {"max_splits": 7, "BLOCK_N": 16, "min_chunk": 16}
    monkeypatch.setenv("TOKENSPEED_MLA_MERGE_UNROLL", "1")
    one = run_ragged(inp, 0.2, SMALL["v_dim"], **kw)
    monkeypatch.setenv("TOKENSPEED_MLA_MERGE_UNROLL", unroll)
    assert torch.equal(run_ragged(inp, 0.2, SMALL["v_dim"], **kw), one)
    assert rel_err(one, reference_ragged(inp, 0.2, SMALL["v_dim"])) < 1e-5


def test_merge_unroll_env(monkeypatch):
    from tokenspeed.ops.triton.mla_combine import MERGE_UNROLL, merge_unroll

    monkeypatch.delenv("TOKENSPEED_MLA_MERGE_UNROLL", raising=False)
    assert merge_unroll() == MERGE_UNROLL
    monkeypatch.setenv("TOKENSPEED_MLA_MERGE_UNROLL", "2")
    assert merge_unroll() == 2
    for bad in ("3", "0", "x", "16"):
        monkeypatch.setenv("TOKENSPEED_MLA_MERGE_UNROLL", bad)
        with pytest.raises(ValueError, match="TOKENSPEED_MLA_MERGE_UNROLL"):
            merge_unroll()


@cpu_interp
def test_interp_ragged_views_and_strides_bits():
    """q / q_rope as the model passes them (q a transposed [H, T, r] bmm output seen as [T, H, r], q_rope a column
    range of a wider tensor): the same bits as the concatenated query; kv_scale folded in; 3 heads x 5 tokens
    over 16-row tiles (rows of one token straddle tiles)."""
    inp = make_ragged([5, 1, 2], [30, 9, 2], 3, 40, 4, kv_scale=0.5, seed=7)
    q = inp["q"]
    q_lat = q[..., :32].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, 32], strides (32, T * 32, 1)
    wide = torch.randn(q.shape[0], 3, 20)
    wide[..., 4:12] = q[..., 32:]
    kw = {"max_splits": 4, "BLOCK_N": 16, "min_chunk": 16}
    full = run_ragged(inp, 0.2, 32, kv_scale=0.5, **kw)
    views = run_ragged(inp, 0.2, 32, kv_scale=0.5, q=q_lat, q_rope=wide[..., 4:12], **kw)
    assert torch.equal(full, views)
    assert rel_err(full, reference_ragged(inp, 0.2, 32, 0.5)) < 1e-5


@cpu_interp
def test_interp_ragged_bf16_queries():
    """bf16 queries and output (fp32 cache: the interpreter's dots are fp32); padding and empty sequences."""
    inp = make_ragged(RAGGED_Q, RAGGED_KV, SMALL["H"], SMALL["Dl"], 4, q_dtype=torch.bfloat16, seed=3)
    check_ragged(inp, SMALL["v_dim"], 1e-2, max_splits=3, BLOCK_N=16, min_chunk=16)


@cpu_interp
def test_interp_ragged_all_padding_and_uniform():
    """Every sequence padding (zeros, nothing read); a uniform batch through the ragged form."""
    check_ragged(make_ragged([2, 1], [0, -1], SMALL["H"], SMALL["Dl"], 4), SMALL["v_dim"], 1e-5, max_splits=3,
                 BLOCK_N=16)
    check_ragged(make_ragged([3, 3], [20, 3], SMALL["H"], SMALL["Dl"], 4, seed=1), SMALL["v_dim"], 1e-5,
                 max_splits=2, BLOCK_N=16, min_chunk=16)


@cpu_interp
def test_interp_ragged_plan_reaches_the_kernel(monkeypatch):
    """With the combine stubbed out, the kernel writes exactly the sequences the host mirror gives one split (==
    reference) and leaves those with several NaN, so the device plan is the host plan."""
    from tokenspeed.ops.triton import mla_decode as mod

    inp = make_ragged(RAGGED_Q, RAGGED_KV, SMALL["H"], SMALL["Dl"], 4, seed=2)
    ref = reference_ragged(inp, 0.25, SMALL["v_dim"])
    monkeypatch.setattr(mod, "_mla_combine_kernel", type("Stub", (), {"__getitem__": lambda self, g: (
        lambda *a, **k: None)})())
    out = run_ragged(inp, 0.25, SMALL["v_dim"], max_splits=5, BLOCK_N=16, min_chunk=16)
    plan = mod.plan_ragged(RAGGED_Q, RAGGED_KV, SMALL["H"], 5, 16, 16, 16)
    assert sorted(set(plan["splits"])) == [0, 1, 3]
    cu = inp["cu"].tolist()
    for n, c in enumerate(plan["splits"]):
        rows = slice(cu[n], cu[n + 1])
        if c > 1:
            assert torch.isnan(out[rows]).all()
        elif c == 1:
            assert rel_err(out[rows], ref[rows]) < 1e-5


def test_ragged_plan_bounds():
    """Host mirror: the items fit the split grid, the partial items the workspace and the split row blocks the
    combine grid, for random mixes; at Kimi-Linear's shape the default workspace stays under 64 MB for N <= 64
    and max_q <= 1024."""
    from tokenspeed.ops.triton.mla_decode import default_max_splits, plan_ragged, ragged_grid

    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        N = int(torch.randint(1, 70, (1,), generator=g))
        H, bh = [(32, 32), (4, 16), (16, 16), (3, 16)][int(torch.randint(0, 4, (1,), generator=g))]
        ms = int(torch.randint(1, 40, (1,), generator=g))
        q_lens = [int(v) for v in torch.randint(0, 3, (N,), generator=g)]
        long = torch.randint(0, N, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        for n in long:
            q_lens[n] = int(torch.randint(1, 1100, (1,), generator=g))
        kv = [q + int(torch.randint(-1, 70000, (1,), generator=g)) if q else int(torch.randint(0, 99, (1,),
                                                                                               generator=g))
              for q in q_lens]
        max_q = max(q_lens) + int(torch.randint(0, 50, (1,), generator=g))
        plan = plan_ragged(q_lens, kv, H, ms, bh, 32, 64, max_q)
        programs, comb, parts = ragged_grid(sum(q_lens), N, H, max_q, ms, bh)
        assert plan["items"] <= programs and plan["partial_items"] <= parts and plan["combine_blocks"] <= comb
        assert ms > 1 or plan["partial_items"] == 0
    for N in (1, 2, 16, 64):
        ms = default_max_splits(N, 32, 132, block_h=32)
        for max_q in (16, 1024):
            _, _, parts = ragged_grid(N * max_q, N, 32, max_q, ms, 32)
            assert parts * 32 * 512 * 4 <= 64 << 20


def test_ragged_launches_and_uniform_unchanged(monkeypatch):
    """The launches each form makes (kernels stubbed): uniform, the 3-D grid of the uniform plan (RAGGED off);
    ragged, a 1-D split grid of `ragged_grid` programs and the combine over its row blocks (RAGGED on)."""
    from tokenspeed.ops.triton import mla_decode as mod

    calls = []
    for name in ("_mla_split_kernel", "_mla_combine_kernel"):
        monkeypatch.setattr(mod, name, type("Stub", (), {"__getitem__": lambda self, g, _n=name: (
            lambda *a, **k: calls.append((_n, g, k.get("RAGGED", False))))})())
    inp = make([9, 30], 2, 4, 40, 4, torch.float32, torch.float32, "cpu")
    mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], 0.3, 32, max_splits=3)
    assert calls == [("_mla_split_kernel", (1, 3, 2), False), ("_mla_combine_kernel", (1, 8, 2), False)]
    calls.clear()
    r = make_ragged([2, 17], [9, 30], 4, 40, 4)
    mod.mla_decode(r["q"], r["cache"], r["page_table"], r["kv_lens"], 0.3, 32, cu_seqlens_q=r["cu"], max_q=17,
                   max_splits=3, BLOCK_H=16)
    programs, comb, _ = mod.ragged_grid(19, 2, 4, 17, 3, 16)
    assert (programs, comb) == (6 + 6, 6)  # RB = min(2 * cdiv(32 * 4, 16), cdiv(19 * 4, 16) + 1) = 6
    assert calls == [("_mla_split_kernel", (programs, 1, 1), True), ("_mla_combine_kernel", (1, comb, 1), True)]


def test_ragged_argument_errors():
    from tokenspeed.ops.triton.mla_decode import mla_decode

    r = make_ragged([2, 1], [9, 3], 4, 40, 4)
    with pytest.raises(ValueError, match="max_q"):
        mla_decode(r["q"], r["cache"], r["page_table"], r["kv_lens"], 0.3, 32, cu_seqlens_q=r["cu"])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        mla_decode(r["q"], r["cache"], r["page_table"], r["kv_lens"], 0.3, 32, cu_seqlens_q=r["cu"][:2], max_q=2)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        mla_decode(r["q"][None], r["cache"], r["page_table"], r["kv_lens"], 0.3, 32, cu_seqlens_q=r["cu"], max_q=2)


# decodes at 4K beside a tail on a longer history, a padding sequence, a short tail (Kimi-Linear's shape)
RAGGED_GPU = [([1] * 15 + [200], [4096] * 15 + [16384]), ([1, 64, 0, 1, 9], [3000, 700, 0, 1, 65]),
              ([1000], [5000])]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", RAGGED_GPU)
@pytest.mark.parametrize("max_splits", [None, 1, 4])
@pytest.mark.parametrize("keys_major", [False, True])
def test_ragged_bf16_gpu(case, max_splits, keys_major):
    q_lens, kv = case
    inp = make_ragged(q_lens, [max(k, q) if k > 0 else k for q, k in zip(q_lens, kv)], 32, 576, 64,
                      q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, device="cuda")
    check_ragged(inp, 512, 1e-2, max_splits=max_splits, keys_major=keys_major)


@pytest.mark.gpu
@needs_cuda
def test_ragged_fp8_and_views_gpu():
    inp = make_ragged([1, 33, 1], [8192, 1024, 300], 32, 576, 64, q_dtype=torch.bfloat16,
                      cache_dtype=torch.float8_e4m3fn, device="cuda", kv_scale=0.25)
    check_ragged(inp, 512, 2e-2, kv_scale=0.25)
    q = inp["q"]
    full = run_ragged(inp, 0.05, 512, kv_scale=0.25)
    assert torch.equal(full, run_ragged(inp, 0.05, 512, kv_scale=0.25, q=q[..., :512], q_rope=q[..., 512:]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pdl_on", ["1", "0"])
def test_ragged_cuda_graph_replay_gpu(monkeypatch, pdl_on):
    """Captured once for (T 35, N 16, max_q bucket 32); replayed on other query-length mixes of the same shape."""
    from tokenspeed.ops.triton.mla_decode import mla_decode

    monkeypatch.setenv("TOKENSPEED_PDL", pdl_on)
    scale = 576 ** -0.5
    mixes = [([1] * 15 + [20], [4096] * 15 + [9000]), ([2] * 10 + [1] * 5 + [10], [300] * 15 + [12000]),
             ([0] * 14 + [3, 32], [0] * 14 + [40, 7000])]
    first = make_ragged(*mixes[0], 32, 576, 64, torch.bfloat16, torch.bfloat16, "cuda", seed=1)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.items()}
    pool = torch.zeros(4000, 64, 576, dtype=torch.bfloat16, device="cuda")

    def call():
        return mla_decode(static["q"], pool, static["page_table"], static["kv_lens"], scale, 512,
                          cu_seqlens_q=static["cu"], max_q=32)

    table = torch.zeros(16, 300, dtype=torch.int32, device="cuda")
    static["page_table"] = table
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed, (q_lens, kv) in enumerate(mixes, start=2):
        new = make_ragged(q_lens, kv, 32, 576, 64, torch.bfloat16, torch.bfloat16, "cuda", seed=seed)
        pool[:new["cache"].shape[0]].copy_(new["cache"])
        table.zero_()
        table[:, :new["page_table"].shape[1]].copy_(new["page_table"])
        for k in ("q", "kv_lens", "cu"):
            static[k].copy_(new[k])
        out.fill_(float("nan"))
        graph.replay()
        ref = reference_ragged({**new, "cache": pool, "page_table": table}, scale, 512)
        assert rel_err(out, ref) < 1e-2
