"""The MLA decode layer's fusions against the compositions they replace.

* `mla_norm_store_absorb` (one launch: the latent store of `mla_norm_store_latent` and the W_UK absorption
  q_lat = q_nope @ W_UK[h]) against the Triton store + a torch bmm: the cache rows bit for bit (rows outside
  slot_mapping stay NaN), q_lat within fp32 summation-order noise, q_nope a strided view of the q projection,
  token counts across one absorption tile (T 1..3) and two (17); output poisoned with NaN.
* `mla_decode(..., w_uv=...)` (the W_UV product in the combine kernel's epilogue, every split through the
  combine) against `mla_decode` then the per-head product: uniform (N, Q) batches with a padding sequence, the
  balanced and the uniform plans, max_splits 1 (one split: no combine without w_uv) and several (min_chunk
  forced small so sequences split), and the ragged form (a sequence without tokens, a padding sequence).
* The public ops route to the kernels under TOKENSPEED_OPS=triton and to the compositions in reference mode, with
  the same results; bad W_UV shapes raise. CUDA (lead's H200 run): Kimi-Linear's widths, bf16 and fp8 caches, PDL
  on and off, against the CUDA compositions.
Small shapes: H 4, r 64, rope 16, nope 32, v 32 (fp32, the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter

H, R, DR, NOPE, V, PAGE, PAGES = 4, 64, 16, 32, 32, 4, 40


def _store_inputs(T: int, device: str = "cpu", dtype=torch.float32, cache_dtype=torch.float32, r=R, dr=DR, h=H,
                  nope=NOPE, v=V, seed=0):
    """kv_a [T, r + dr + 8], norm weight, NaN cache, slots, q [T, h, nope + dr] (q_nope its first columns) and
    kv_b_proj's weight viewed [h, nope + v, r]."""
    g = torch.Generator().manual_seed(seed)
    kv_a = (torch.randn(T, r + dr + 8, generator=g) * 2).to(dtype).to(device)
    w = (torch.rand(r, generator=g) + 0.5).to(dtype).to(device)
    cache = torch.full((PAGES, PAGE, r + dr), float("nan")).to(cache_dtype).to(device)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:T].to(device)
    q = torch.randn(T, h, nope + dr, generator=g).to(dtype).to(device)
    kv_b = (torch.randn(h * (nope + v), r, generator=g) / r**0.5).to(dtype).to(device).view(h, nope + v, r)
    return kv_a, w, cache, slots, q, kv_b


def _store_composition(kv_a, w, cache, slots, kv_scale, q, kv_b, store, r=R, dr=DR, nope=NOPE):
    """The unfused ops: `store` (the Triton or the reference mla_norm_store_latent), then the bmm of the model."""
    out = cache.clone()
    store(kv_a[:, :r], kv_a[:, r:r + dr], w, 1e-6, out, slots, kv_scale)
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), kv_b[:, :nope].to(q.dtype)).transpose(0, 1)
    return out, q_lat


@cpu_interp
@pytest.mark.parametrize("kv_scale", [1.0, 0.37])
@pytest.mark.parametrize("T", [1, 2, 3, 17])
def test_norm_store_absorb_interp(T: int, kv_scale: float) -> None:
    from tokenspeed.ops.triton.mla_prep import mla_norm_store_absorb, mla_norm_store_latent

    kv_a, w, cache, slots, q, kv_b = _store_inputs(T, seed=T)
    want_cache, want_q = _store_composition(kv_a, w, cache, slots, kv_scale, q, kv_b, mla_norm_store_latent)
    got_cache = cache.clone()
    out = torch.full((T, H, R), float("nan"))
    got_q = mla_norm_store_absorb(kv_a[:, :R], kv_a[:, R:R + DR], w, 1e-6, got_cache, slots, kv_scale,
                                  q[..., :NOPE], kv_b[:, :NOPE], out=out)
    assert got_q is out
    assert torch.equal(got_cache.nan_to_num(-7.0), want_cache.nan_to_num(-7.0))  # NaN rows untouched, rows exact
    assert rel_err(got_q, want_q) < 1e-6


def _decode_inputs(kv_lens, Q, seed=0, ragged_q_lens=None, per_seq=8):
    """Cache (random pages, unused rows NaN), page table (per_seq pages a sequence), kv_lens; queries [N, Q, H,
    R + DR] or, ragged, [T, ...]; W_UV view [H, V, R] of a kv_b_proj weight."""
    g = torch.Generator().manual_seed(seed)
    N = len(kv_lens)
    pages = max(PAGES, N * per_seq)
    cache = torch.full((pages, PAGE, R + DR), float("nan"))
    table = torch.randperm(pages, generator=g)[:N * per_seq].view(N, per_seq).to(torch.int32)
    flat = cache.view(-1, R + DR)
    for n, k in enumerate(kv_lens):
        pos = torch.arange(max(k, 0))
        flat[table[n, pos // PAGE].long() * PAGE + pos % PAGE] = torch.randn(max(k, 0), R + DR, generator=g)
    T = sum(ragged_q_lens) if ragged_q_lens is not None else None
    q = torch.randn(*((T,) if T is not None else (N, Q)), H, R + DR, generator=g)
    w_uv = (torch.randn(H * (NOPE + V), R, generator=g) / R**0.5).view(H, NOPE + V, R)[:, NOPE:]
    return cache, table, torch.tensor(kv_lens), q, w_uv


def _uv_composition(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The model's W_UV bmm on the latent output ([..., H, R] -> [..., H, V])."""
    flat = o_lat.reshape(-1, H, R)
    return torch.bmm(flat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(*o_lat.shape[:-1], V)


@cpu_interp
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("max_splits", [1, 6])
@pytest.mark.parametrize("kv_lens,Q", [([23], 1), ([30, 0, 13], 2), ([9, 26], 3)])
def test_decode_w_uv_uniform_interp(kv_lens, Q: int, max_splits: int, balanced: bool) -> None:
    from tokenspeed.ops.triton.mla_decode import mla_decode

    cache, table, lens, q, w_uv = _decode_inputs(kv_lens, Q, seed=len(kv_lens) + Q)
    kw = {"q_rope": q[..., R:], "max_splits": max_splits, "balanced": balanced, "min_chunk": 4}
    o_lat = mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, **kw)
    out = torch.full((len(kv_lens), Q, H, V), float("nan"))
    got = mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, w_uv=w_uv, out=out, **kw)
    assert got is out
    want = _uv_composition(o_lat, w_uv)
    assert rel_err(got, want) < 1e-5
    if 0 in kv_lens:  # a padding sequence: zeros (written by the W_UV combine)
        assert torch.equal(got[kv_lens.index(0)], torch.zeros_like(got[0]))


@cpu_interp
@pytest.mark.parametrize("max_splits", [1, 4])
def test_decode_w_uv_ragged_interp(max_splits: int) -> None:
    from tokenspeed.ops.triton.mla_decode import mla_decode

    q_lens, kv_lens = [1, 3, 0, 2, 1], [21, 30, 7, 0, 12]
    cache, table, lens, q, w_uv = _decode_inputs(kv_lens, 0, seed=7, ragged_q_lens=q_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    kw = {"q_rope": q[..., R:], "cu_seqlens_q": cu, "max_q": max(q_lens), "max_splits": max_splits,
          "min_chunk": 4}
    o_lat = mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, **kw)
    out = torch.full((sum(q_lens), H, V), float("nan"))
    got = mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, w_uv=w_uv, out=out, **kw)
    assert rel_err(got, _uv_composition(o_lat, w_uv)) < 1e-5
    assert torch.equal(got[4:6], torch.zeros_like(got[4:6]))  # the padding sequence's two tokens


@cpu_interp
@pytest.mark.parametrize("unroll", ["2", "4"])
@pytest.mark.parametrize("ragged", [False, True])
def test_decode_w_uv_merge_unroll_same_bits(monkeypatch, ragged: bool, unroll: str) -> None:
    """The W_UV combine's merge with the loads of `unroll` split slots issued together gives the bits of the
    one-slot loop (TOKENSPEED_MLA_MERGE_UNROLL=1); tokens of one tile with different split counts (1 to 7)."""
    from tokenspeed.ops.triton.mla_decode import mla_decode, plan_ragged, plan_splits

    q_lens, kv_lens = ([1, 3, 2, 1], [110, 60, 9, 3]) if ragged else (None, [111, 80, 13, 3])
    cache, table, lens, q, w_uv = _decode_inputs(kv_lens, 1, seed=11, ragged_q_lens=q_lens, per_seq=32)
    kw = {"q_rope": q[..., R:], "max_splits": 7, "min_chunk": 4, "w_uv": w_uv, "BLOCK_N": 16}
    if ragged:
        kw.update(cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]), max_q=max(q_lens))
        splits = plan_ragged(q_lens, kv_lens, H, 7, 16, 16, 4)["splits"]
    else:
        splits = plan_splits(kv_lens, 7, True, 16, 4)[1]
    assert max(splits) > 4 and min(splits) == 1  # a tail past the unroll beside single splits
    monkeypatch.setenv("TOKENSPEED_MLA_MERGE_UNROLL", "1")
    one = mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, **kw)
    monkeypatch.setenv("TOKENSPEED_MLA_MERGE_UNROLL", unroll)
    assert torch.equal(mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, **kw), one)
    monkeypatch.delenv("TOKENSPEED_MLA_MERGE_UNROLL")
    o_lat = mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, **{k: v for k, v in kw.items() if k != "w_uv"})
    assert rel_err(one, _uv_composition(o_lat, w_uv)) < 1e-5


@cpu_interp
def test_public_ops_route_and_agree(monkeypatch) -> None:
    """TOKENSPEED_OPS=triton runs the fused kernels (counted), reference mode the compositions; same results."""
    from tokenspeed import ops
    from tokenspeed.ops.triton import mla_decode as dec
    from tokenspeed.ops.triton import mla_prep

    calls = {"absorb": 0, "uv": 0}
    absorb, decode = mla_prep.mla_norm_store_absorb, dec.mla_decode
    monkeypatch.setattr(mla_prep, "mla_norm_store_absorb",
                        lambda *a, **k: calls.__setitem__("absorb", calls["absorb"] + 1) or absorb(*a, **k))
    monkeypatch.setattr(dec, "mla_decode", lambda *a, w_uv=None, **k: calls.__setitem__(
        "uv", calls["uv"] + (w_uv is not None)) or decode(*a, w_uv=w_uv, **k))
    kv_a, w, cache, slots, q, kv_b = _store_inputs(2, seed=3)
    dcache, table, lens, dq, w_uv = _decode_inputs([17, 9], 1, seed=4)
    dcache = dcache.nan_to_num(0.0)  # the reference's padded batch reads rows past the shorter history
    res = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
        c = cache.clone()
        q_lat = ops.mla_norm_store_absorb(kv_a[:, :R], kv_a[:, R:R + DR], w, 1e-6, c, slots, 1.0, q[..., :NOPE],
                                          kv_b[:, :NOPE])
        o = ops.mla_decode(dq[..., :R], dcache, table, lens, 0.2, R, 1.0, q_rope=dq[..., R:], w_uv=w_uv)
        res[mode] = (c, q_lat, o)
    assert calls == {"absorb": 1, "uv": 1}
    (c_r, q_r, o_r), (c_t, q_t, o_t) = res["reference"], res["triton"]
    assert rel_err(c_t[~torch.isnan(c_r)], c_r[~torch.isnan(c_r)]) < 1e-6
    assert rel_err(q_t, q_r) < 1e-6
    assert rel_err(o_t, o_r) < 1e-5


@cpu_interp
def test_bad_w_uv_raises() -> None:
    from tokenspeed.ops.triton.mla_decode import mla_decode

    cache, table, lens, q, w_uv = _decode_inputs([9], 1)
    with pytest.raises(ValueError, match="w_uv"):
        mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, q_rope=q[..., R:], w_uv=w_uv[:, :, :R - 1])
    with pytest.raises(ValueError, match="w_uv"):
        mla_decode(q[..., :R], cache, table, lens, 0.2, R, 1.0, q_rope=q[..., R:], w_uv=w_uv[:2])


@needs_cuda
@pytest.mark.parametrize("pdl_on", ["1", "0"])
@pytest.mark.parametrize("cache_dtype,kv_scale", [(torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.25)])
def test_cuda_real_shapes(monkeypatch, pdl_on: str, cache_dtype, kv_scale: float) -> None:
    """Kimi-Linear's widths (H 32, r 512, rope 64, nope 128, v 128), bf16 activations: the fused store+absorb and
    the W_UV combine against the CUDA compositions (Triton store, cuBLAS bmm, the unfused mla_decode)."""
    from tokenspeed.ops.triton.mla_decode import mla_decode
    from tokenspeed.ops.triton.mla_prep import mla_norm_store_absorb, mla_norm_store_latent

    monkeypatch.setenv("TOKENSPEED_PDL", pdl_on)
    h, r, dr, nope, v = 32, 512, 64, 128, 128
    for T in (1, 5, 40):
        kv_a, w, cache, slots, q, kv_b = _store_inputs(T, "cuda", torch.bfloat16, cache_dtype, r, dr, h, nope, v, T)
        want_cache, want_q = _store_composition(kv_a, w, cache, slots, kv_scale, q, kv_b, mla_norm_store_latent, r,
                                                dr, nope)
        got_cache = cache.clone()
        got_q = mla_norm_store_absorb(kv_a[:, :r], kv_a[:, r:r + dr], w, 1e-6, got_cache, slots, kv_scale,
                                      q[..., :nope], kv_b[:, :nope])
        assert torch.equal(got_cache.float().nan_to_num(-7.0), want_cache.float().nan_to_num(-7.0))
        assert rel_err(got_q.float(), want_q.float()) < 1e-2
        # decode over 4K / 300 / 0 rows: splits, one split, padding
        lens = torch.tensor([4096, 300, 0][: max(1, min(T, 3))], device="cuda")
        n = lens.shape[0]
        dc = (torch.randn(n * 64 + 4, 64, r + dr, device="cuda") / kv_scale).to(cache_dtype)
        table = torch.randperm(n * 64 + 4, device="cuda")[: n * 64].view(n, 64).to(torch.int32)
        dq = torch.randn(n, 1, h, r + dr, device="cuda", dtype=torch.bfloat16)
        w_uv = kv_b[:, nope:]
        o_lat = mla_decode(dq[..., :r], dc, table, lens, 0.07, r, kv_scale, q_rope=dq[..., r:])
        want = torch.bmm(o_lat.view(n, h, r).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        got = mla_decode(dq[..., :r], dc, table, lens, 0.07, r, kv_scale, q_rope=dq[..., r:], w_uv=w_uv)
        assert rel_err(got.view(n, h, v).float(), want.float()) < 2e-2
