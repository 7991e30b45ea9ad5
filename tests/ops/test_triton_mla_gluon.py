"""`mla_decode`'s Gluon split kernel (tokenspeed/ops/triton/mla_gluon.py, Hopper) against its Triton split kernel
and the torch reference.

Checked on an sm_90 GPU with the Triton of `mla_gluon.TRITON_VERSIONS`: that the Gluon kernel is the one launched
where `usable` allows; outputs bit-identical to the Triton keys-major kernel (the same plan, row tiles, tile order
and roundings) and within bf16 tolerance of `mla_attention_paged`, over decode and verify (causal), 12 / 16 / 32 /
64 / 96 heads (masked row tiles; 64-row tiles of two warpgroups from 16 sequences on), mixed histories, padding
sequences, lengths that end mid-tile (the cache rows past them are NaN: masked copies must zero-fill), one and many
splits, kv_scale, the W_UV combine (every split writes partials), caches with pages smaller than the key tile
(SMALL_PAGES), fp8 caches (FP8_CACHE) and CUDA-graph replay on new inputs with PDL on and off.
On the CPU: the switch and the conditions under which mla_decode keeps its Triton kernel.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_mla_decode import MIXED, REAL, check, make, reference
from tests.ops.triton_env import needs_cuda, rel_err
from tokenspeed.ops.triton import mla_decode as mod
from tokenspeed.ops.triton import mla_gluon


@pytest.fixture(autouse=True)
def _per_tile_sums(monkeypatch):
    """The per-tile softmax sum (LAZY_SUM off), whose arithmetic is the Triton kernel's, for the bit-for-bit
    comparisons; `test_lazy_sum_matches_per_tile_sum_gpu` sets it itself."""
    monkeypatch.setattr(mla_gluon, "LAZY_SUM", False)
    monkeypatch.delenv(mla_gluon.LAZY_SUM_ENV, raising=False)


needs_hopper_gluon = pytest.mark.skipif(not (torch.cuda.is_available() and mla_gluon._hopper(torch.device("cuda"))),
                                        reason="needs an sm_90 GPU and Gluon of TRITON_VERSIONS")


@pytest.mark.parametrize("switch, env, default", [("enabled", "ENV", "ENABLED"), ("ws_fp8", "WS_ENV", "WS_FP8"),
                                                  ("lazy_sums", "LAZY_SUM_ENV", "LAZY_SUM"),
                                                  ("fp8_dots", "FP8_DOTS_ENV", "FP8_DOTS")])
def test_switch_env_and_errors(monkeypatch, switch, env, default):
    """The Gluon kernel (ENABLED / TOKENSPEED_MLA_GLUON), its warp-specialized fp8 form (WS_FP8 /
    TOKENSPEED_MLA_GLUON_WS), its per-lane softmax sum (LAZY_SUM / TOKENSPEED_MLA_GLUON_LAZY_SUM) and its fp8 dots
    (FP8_DOTS / TOKENSPEED_MLA_GLUON_FP8_DOTS): the module flag unless the variable says 0 or 1; anything else is an
    error."""
    fn, name = getattr(mla_gluon, switch), getattr(mla_gluon, env)
    monkeypatch.delenv(name, raising=False)
    assert fn() is getattr(mla_gluon, default)
    monkeypatch.setenv(name, "0")
    assert not fn()
    monkeypatch.setenv(name, "1")
    assert fn()
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
        fn()


def test_warp_specialized_only_for_fp8_row_tiles_of_one_warpgroup(monkeypatch):
    """The warp-specialized kernel serves fp8 caches with 16- / 32-row tiles in batches of WS_MIN_SEQS sequences
    or more (1 since it won or tied at every batch on the H200), never a bf16 cache or 64-row tiles, never an empty
    batch; TOKENSPEED_MLA_GLUON_WS=0 keeps the one-warpgroup kernel everywhere."""
    monkeypatch.delenv(mla_gluon.WS_ENV, raising=False)
    fp8, n = torch.float8_e4m3fn, mla_gluon.WS_MIN_SEQS
    assert mla_gluon.warp_specialized(fp8, 32, n) and mla_gluon.warp_specialized(fp8, 16, 4 * n)
    assert not mla_gluon.warp_specialized(fp8, 32, n - 1)
    assert not mla_gluon.warp_specialized(fp8, 64, 4 * n)
    assert not mla_gluon.warp_specialized(torch.bfloat16, 32, 4 * n)
    monkeypatch.setenv(mla_gluon.WS_ENV, "0")
    assert not mla_gluon.warp_specialized(fp8, 32, 4 * n)


def test_not_usable_off_cuda():
    """CPU tensors (the interpreter's) never take the Gluon kernel, whatever the shapes."""
    inp = make([300, 64], 1, 32, 576, 64, torch.bfloat16, torch.bfloat16, "cpu")
    q = inp["q"]
    assert not mla_gluon.usable(q, q[..., 512:], inp["cache"], 512, 64, True)


def test_default_row_tiles(monkeypatch):
    """A sequence's Q * H query rows: 16 / 32-row tiles when they fit, else 64 (two warpgroups) from WIDE_MIN_SEQS
    sequences on, 32 below that or with WIDE_ROWS off."""
    n = mla_gluon.WIDE_MIN_SEQS
    assert [mla_gluon.default_block_h(r, n) for r in (1, 12, 16, 17, 24, 32, 33, 64, 96, 128)] == [
        16, 16, 16, 32, 32, 32, 64, 64, 64, 64]
    assert [mla_gluon.default_block_h(r, n - 1) for r in (12, 32, 96, 128)] == [16, 32, 32, 32]
    monkeypatch.setattr(mla_gluon, "WIDE_ROWS", False)
    assert [mla_gluon.default_block_h(r, 4 * n) for r in (12, 32, 96)] == [16, 32, 32]


class _Spy:
    """Counts `mla_gluon.launch` calls (and forwards them)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = mla_gluon.launch

        def launch(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(mla_gluon, "launch", launch)


def _outputs_under(monkeypatch, attr, values, inp, scale, kv_scale, max_splits, **kw) -> list[torch.Tensor]:
    """`mla_decode` of `inp` (`make`'s case; v_dim 512) once with `mla_gluon.<attr>` set to each of `values` in
    turn, each call one Gluon launch (`launch` counted)."""
    outs = []
    for value in values:
        monkeypatch.setattr(mla_gluon, attr, value)
        spy = _Spy(monkeypatch)
        outs.append(mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, kv_scale,
                                   max_splits=max_splits, **kw))
        assert spy.calls == 1
    return outs


def _both(monkeypatch, fn):
    """fn() with the Gluon kernel off, then on (asserting it launched): (triton_out, gluon_out)."""
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(mla_gluon, "ENABLED", False)
    want = fn()
    assert spy.calls == 0
    monkeypatch.setattr(mla_gluon, "ENABLED", True)
    got = fn()
    assert spy.calls > 0, "mla_decode did not take the Gluon kernel"
    return want, got


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("Q, H", [(1, 32), (1, 16), (1, 12), (1, 96), (1, 64), (4, 32), (2, 12)])
@pytest.mark.parametrize("kv_lens", [MIXED * 4, [4096] * 64, [1, 0, 777, 3000, 65, 4097, 0], [65536]])
@pytest.mark.parametrize("max_splits", [None, 1, 7])
def test_equals_triton_kernel_gpu(monkeypatch, Q, H, kv_lens, max_splits):
    """Decode (Q 1) and verify (Q > 1, causal), Kimi-Linear's 32 heads, 16, and K3's 12 (a TP8 rank: a 16-row
    tile with 4 masked rows) and 96 (from 16 sequences, two 64-row tiles of two warpgroups, the second half masked;
    else three of 32); Q 2 x H 12 = 24 rows: a masked 32-row tile; 4 x 32 and 64: 64-row tiles from 16 sequences.
    Both kernels get the same split count (the Gluon kernel's default row tile can be wider, which changes the
    default), so the same plan: outputs bit-equal."""
    inp = make(kv_lens, Q, H, REAL["Dl"], 64, torch.bfloat16, torch.bfloat16, "cuda", seed=len(kv_lens) + H)
    scale = 576 ** -0.5
    n = len(kv_lens)
    ms = max_splits or mod.default_max_splits(n, Q * H, block_h=mla_gluon.default_block_h(Q * H, n))

    def run():
        out = torch.full((len(kv_lens), Q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        return mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, out=out,
                              max_splits=ms)

    want, got = _both(monkeypatch, run)
    assert rel_err(got, reference(inp, scale, 512)) < 1e-2
    assert torch.equal(got, want)
    for n, k in enumerate(kv_lens):
        if k <= 0:
            assert torch.equal(got[n], torch.zeros_like(got[n]))


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("page_size", [16, 32, 48])
@pytest.mark.parametrize("Q, H", [(1, 32), (4, 32), (1, 12)])
def test_small_pages_equal_triton_kernel_gpu(monkeypatch, page_size, Q, H):
    """SMALL_PAGES: pages that are not a multiple of the 64-key tile (the engine's default 16; 48: tiles that
    straddle page boundaries anywhere), a page-table entry per key row; equal to the Triton kernel (which reads
    such caches row by row too) and within tolerance of the reference, at 16 and 64 sequences and ragged ends."""
    monkeypatch.setattr(mla_gluon, "SMALL_PAGES", True)
    scale = 576 ** -0.5
    for kv_lens in (MIXED * 4, [4096] * 64, [1, 0, 777, 3000, 65, 4097, 0]):
        inp = make(kv_lens, Q, H, REAL["Dl"], page_size, torch.bfloat16, torch.bfloat16, "cuda", seed=page_size)
        n = len(kv_lens)
        ms = mod.default_max_splits(n, Q * H, block_h=mla_gluon.default_block_h(Q * H, n))
        want, got = _both(monkeypatch, lambda inp=inp, ms=ms: mod.mla_decode(
            inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, max_splits=ms))
        assert rel_err(got, reference(inp, scale, 512)) < 1e-2
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("page_size", [64, 16])
@pytest.mark.parametrize("Q, H", [(1, 32), (4, 32), (1, 12)])
def test_fp8_cache_gpu(monkeypatch, page_size, Q, H):
    """FP8_CACHE: tiles copied as fp8 and converted to bf16 in shared memory before the dots; within the fp8
    tests' tolerance of the reference on the same fp8 cache (kv_scale 0.25), padding rows zero, the Gluon kernel
    launched (page 16 through SMALL_PAGES)."""
    monkeypatch.setattr(mla_gluon, "FP8_CACHE", True)
    monkeypatch.setattr(mla_gluon, "SMALL_PAGES", True)
    spy = _Spy(monkeypatch)
    for kv_lens in ([8192, 1024, 0, 300], MIXED * 4):
        check(kv_lens, Q, H, **REAL, page_size=page_size, q_dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
              device="cuda", tol=2e-2, kv_scale=0.25)
    assert spy.calls == 2


def _poison_unused_rows(inp: dict) -> None:
    """Every fp8 cache row that no sequence's [0, kv_len) maps to set to e4m3's NaN (0x7f): a kernel that reads
    one into a dot turns its outputs NaN (`make` zeroes them for fp8 caches)."""
    cache, table = inp["cache"], inp["page_table"]
    page = cache.shape[1]
    used = torch.zeros(cache.shape[0] * page, dtype=torch.bool, device=cache.device)
    for n, k in enumerate(inp["kv_lens"].tolist()):
        if k > 0:
            pos = torch.arange(k, device=cache.device)
            used[table[n, pos // page].long() * page + pos % page] = True
    flat = cache.view(torch.uint8).view(-1, cache.shape[-1])
    flat[~used] = 0x7F


# (kv_lens, max_splits): ragged ends and padding sequences, mixed histories, one split, many splits
FP8_CASES = (([8192, 1024, 0, 300, 65, 1], None), (MIXED * 4, None), ([4097, 100], 1), ([20000], 40))


def _poisoned_fp8_cases(page_size: int, Q: int, H: int, kv_scale: float):
    """(inp, max_splits, w_uv) for each of FP8_CASES: `make`'s case over an fp8 cache (kv_scale) whose rows no
    sequence owns are NaN (`_poison_unused_rows`), and a random W_UV weight [H, 128, 512]."""
    for kv_lens, ms in FP8_CASES:
        inp = make(kv_lens, Q, H, REAL["Dl"], page_size, torch.bfloat16, torch.float8_e4m3fn, "cuda",
                   kv_scale=kv_scale, seed=page_size + H + len(kv_lens))
        _poison_unused_rows(inp)
        yield inp, ms, torch.randn(H, 128, 512, dtype=torch.bfloat16, device="cuda") / 16


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("page_size", [64, 16, 48])
@pytest.mark.parametrize("Q, H", [(1, 32), (1, 12), (4, 32), (2, 12)])
@pytest.mark.parametrize("maxnreg", [None, 168])
def test_fp8_warp_specialized_equals_one_warpgroup_gpu(monkeypatch, page_size, Q, H, maxnreg):
    """WS_FP8 (forced at every batch size; maxnreg 168: registers handed between the partitions): the producer
    warpgroup's conversion into two staging buffers gives the dots the same bf16 tiles as the one-warpgroup path,
    so outputs are bit-equal (16- and 32-row tiles; Q 4 x 32 heads from 16 sequences takes
    64-row tiles, the one-warpgroup path on both sides), over ragged ends (NaN cache rows past them must not be
    read), padding sequences, one and many splits, kv_scale and the W_UV combine; and within the fp8 tolerance of
    the reference."""
    monkeypatch.setattr(mla_gluon, "FP8_CACHE", True)
    monkeypatch.setattr(mla_gluon, "SMALL_PAGES", True)
    monkeypatch.setattr(mla_gluon, "WS_MIN_SEQS", 1)  # at every batch size here
    monkeypatch.setattr(mla_gluon, "WS_MAXNREG", maxnreg)
    scale = 576 ** -0.5
    for inp, ms, w_uv in _poisoned_fp8_cases(page_size, Q, H, 0.25):
        for kw in ({}, {"w_uv": w_uv}):
            outs = _outputs_under(monkeypatch, "WS_FP8", (False, True), inp, scale, 0.25, ms, **kw)
            assert torch.equal(outs[0], outs[1])
            assert not outs[1].isnan().any()
        plain = mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, 0.25,
                               max_splits=ms)
        assert rel_err(plain, reference(inp, scale, 512, 0.25)) < 2e-2


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
def test_kv_scale_strided_queries_and_w_uv_gpu(monkeypatch):
    """kv_scale folded in; q_lat and q_rope as strided views (the model's layouts); the W_UV combine, for which
    every split writes partials (single-split and padding sequences too)."""
    kv_lens = [5000, 0, 64, 1, 20000]
    inp = make(kv_lens, 1, 32, 576, 64, torch.bfloat16, torch.bfloat16, "cuda", kv_scale=0.5, seed=9)
    scale = 576 ** -0.5
    q_lat = inp["q"][..., :512].transpose(0, 2).contiguous().transpose(0, 2)  # [N, 1, H, 512], head-major storage
    q_rope = inp["q"][..., 512:]
    w_uv = torch.randn(32, 128, 512, dtype=torch.bfloat16, device="cuda") / 16
    for kw in ({}, {"w_uv": w_uv}):
        want, got = _both(monkeypatch, lambda kw=kw: mod.mla_decode(
            q_lat, inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, 0.5, q_rope=q_rope, **kw))
        assert torch.equal(got, want)
    plain = mod.mla_decode(q_lat, inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, 0.5, q_rope=q_rope)
    assert rel_err(plain, reference(inp, scale, 512, 0.5)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("pdl_on", ["1", "0"])
def test_cuda_graph_replay_gpu(monkeypatch, pdl_on):
    """Captured once with the Gluon kernel (PDL launch or plain); new kv_lens / page table / q copied into the
    static tensors; replay == reference."""
    monkeypatch.setenv("TOKENSPEED_PDL", pdl_on)
    spy = _Spy(monkeypatch)
    scale = 576 ** -0.5
    static = make([3000, 100, 0, 13000], 1, 32, 576, 64, torch.bfloat16, torch.bfloat16, "cuda", seed=1,
                  spare_pages=200)
    args = (static["q"], static["cache"], static["page_table"], static["kv_lens"], scale, 512)
    mod.mla_decode(*args, max_splits=16)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.mla_decode(*args, max_splits=16)
    assert spy.calls == 2
    for seed, lens in ((2, [3100, 5, 700, 9001]), (3, [1, 0, 12000, 64])):
        new = make(lens, 1, 32, 576, 64, torch.bfloat16, torch.bfloat16, "cuda", seed=seed)
        static["cache"][: new["cache"].shape[0]].copy_(new["cache"])
        static["page_table"].zero_()
        static["page_table"][:, : new["page_table"].shape[1]].copy_(new["page_table"])
        static["q"].copy_(new["q"])
        static["kv_lens"].copy_(new["kv_lens"])
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, reference(static, scale, 512)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("cache_dtype, ws", [(torch.bfloat16, False), (torch.float8_e4m3fn, False),
                                             (torch.float8_e4m3fn, True)])
@pytest.mark.parametrize("Q, H", [(1, 32), (1, 12), (4, 32)])
def test_lazy_sum_matches_per_tile_sum_gpu(monkeypatch, cache_dtype, ws, Q, H):
    """LAZY_SUM (the softmax sum kept per key lane, reduced once per split) changes only the fp32 summation order
    of l: outputs within a few bf16 ulps of the per-tile sum's, and within tolerance of the reference, over bf16
    and fp8 caches (one warpgroup and warp-specialized, which stay bit-equal to each other), page 16, ragged ends,
    padding sequences, one and many splits, 64-row tiles (16 sequences of 4 x 32 query rows) and the W_UV combine;
    no element left unwritten."""
    monkeypatch.setattr(mla_gluon, "FP8_CACHE", True)
    monkeypatch.setattr(mla_gluon, "SMALL_PAGES", True)
    monkeypatch.setattr(mla_gluon, "WS_FP8", ws)
    monkeypatch.setattr(mla_gluon, "WS_MIN_SEQS", 1 if ws else 1 << 30)
    monkeypatch.delenv(mla_gluon.LAZY_SUM_ENV, raising=False)
    scale, fp8 = 576 ** -0.5, cache_dtype == torch.float8_e4m3fn
    cases = (([8192, 1024, 0, 300, 65, 1], None), ([65536], None), ([4097, 100], 1), ([20000], 40),
             ([3000, 17, 0, 1500] * 4, None))  # 16 sequences: 64-row tiles of two warpgroups at Q 4 x 32 heads
    for kv_lens, ms in cases:
        inp = make(kv_lens, Q, H, REAL["Dl"], 16, torch.bfloat16, cache_dtype, "cuda", kv_scale=0.5,
                   seed=H + len(kv_lens))
        if fp8:
            _poison_unused_rows(inp)
        w_uv = torch.randn(H, 128, 512, dtype=torch.bfloat16, device="cuda") / 16
        for kw in ({}, {"w_uv": w_uv}):
            outs = _outputs_under(monkeypatch, "LAZY_SUM", (False, True), inp, scale, 0.5, ms, **kw)
            assert rel_err(outs[1], outs[0]) < 8e-3
            if ws:  # the warp-specialized fp8 kernel stages the same tiles: bit for bit the one-warpgroup one
                one, = _outputs_under(monkeypatch, "WS_FP8", (False,), inp, scale, 0.5, ms, **kw)
                monkeypatch.setattr(mla_gluon, "WS_FP8", True)
                assert torch.equal(one, outs[1])
            if not kw:
                assert rel_err(outs[1], reference(inp, scale, 512, 0.5)) < (2e-2 if fp8 else 1e-2)


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("page_size", [64, 16, 48])
@pytest.mark.parametrize("Q, H", [(1, 32), (1, 12), (4, 32), (2, 12)])
@pytest.mark.parametrize("lazy", [True, False])
def test_fp8_dots_gpu(monkeypatch, page_size, Q, H, lazy):
    """FP8_DOTS (the warp-specialized kernel forced at every batch size): e4m3 queries, keys read straight from the
    copied fp8 tile, e4m3 p against the transposed latent. Within 6% (max error over max magnitude) of the
    reference and of the bf16 dots over the same cache: the query's and p's e4m3 roundings (3 mantissa bits, ~3.5%
    on these random inputs on the H200) are the only difference; no NaN; over ragged ends (NaN cache rows past
    them must not be read), padding sequences, one and many splits (up to 40: the three-buffer key ring wraps many
    times), kv_scale, causal verify windows and the W_UV combine (every split's partials)."""
    monkeypatch.setattr(mla_gluon, "FP8_CACHE", True)
    monkeypatch.setattr(mla_gluon, "SMALL_PAGES", True)
    monkeypatch.setattr(mla_gluon, "WS_FP8", True)
    monkeypatch.setattr(mla_gluon, "WS_MIN_SEQS", 1)
    monkeypatch.setattr(mla_gluon, "LAZY_SUM", lazy)
    monkeypatch.delenv(mla_gluon.FP8_DOTS_ENV, raising=False)
    scale = 576 ** -0.5
    for inp, ms, w_uv in _poisoned_fp8_cases(page_size, Q, H, 0.25):
        for kw in ({}, {"w_uv": w_uv}):
            bf16_dots, fp8_dots = _outputs_under(monkeypatch, "FP8_DOTS", (False, True), inp, scale, 0.25, ms, **kw)
            assert not fp8_dots.isnan().any()
            assert rel_err(fp8_dots, bf16_dots) < 6e-2
        got = mod.mla_decode(inp["q"], inp["cache"], inp["page_table"], inp["kv_lens"], scale, 512, 0.25,
                             max_splits=ms)  # FP8_DOTS still on
        assert rel_err(got, reference(inp, scale, 512, 0.25)) < 6e-2
