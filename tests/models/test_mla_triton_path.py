"""One MLA layer through the Triton ops (TOKENSPEED_OPS=triton, CPU interpreter, fp32) against the reference ops.

* A prefill, two decodes and a verify window of two sequences (scattered pages), for the NoPE preset and a rotary
  (YaRN) variant: outputs and the latent cache agree (1e-5 relative); every step writes its rows with one
  `mla_norm_store_latent` kernel launch; every step passes the absorbed query to `mla_decode` as two views (q_rope
  given, no concatenation): decode and verify in the uniform form, the prefill (5 and 2 tokens) in the ragged one.
* Mixed batches (decodes beside a 20-token tail, a sequence without new tokens, after a ragged prefill of
  histories up to 50 tokens): with the kernel, the whole batch is one ragged `mla_decode` (neither the expanded
  form nor the torch absorbed reference runs) and matches the reference path (1e-5; the split plan forced to
  split); with the tail over ABSORBED_MAX_TAIL, the tail is expanded and only the short sequences go through the
  ragged kernel (a subset), or the uniform decode kernels when they are all decodes; on the CPU without
  TOKENSPEED_OPS=triton the layer takes today's path bit for bit.
* The fused decode (FUSED_DECODE; TOKENSPEED_MLA_FUSED overrides it at each call) against the unfused Triton ops.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err

# tests.ops.triton_env sets up Triton (the interpreter) before anything imports it
from tests.ops.triton_env import cpu_interp
from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM, parse_hf_config, preset_hf_config
from tokenspeed.models.weights import init_dummy_weights

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
PAGE = 4


def _layer(rotary: bool):
    raw = preset_hf_config("tiny-kimi-linear")
    if rotary:
        raw.update(mla_use_nope=False, rope_theta=500.0, rope_scaling=YARN)
    model = KimiForCausalLM(parse_hf_config(raw), dtype=torch.float32).eval()
    init_dummy_weights(model, seed=5)
    return model, model.model.layers[model.config.mla_layers[0]].self_attn


def _steps(model, attn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """prefill (5 and 2 tokens), decode, decode, verify (3 tokens each); returns the outputs and the cache."""
    cache = CacheBuffers.allocate(model.config, 12, PAGE, 4, torch.float32)
    pages = [[7, 2, 9, 0], [4, 11, 1, 6]]
    g = torch.Generator().manual_seed(0)
    outs, cached = [], [0, 0]
    for ids, verify in (([[1, 2, 3, 4, 5], [6, 7]], False), ([[8], [9]], False), ([[3], [2]], False),
                        ([[1, 2, 3], [4, 5, 6]], True)):
        batch = ForwardBatch.build(ids, cached, pages, [1, 3], PAGE, verify=verify)
        x = torch.randn(sum(map(len, ids)), model.config.hidden_size, generator=g)
        with torch.no_grad():
            outs.append(attn(x, batch, cache))
        cached = [c + len(i) for c, i in zip(cached, ids)]
    return outs, cache.mla_latent[attn.cache_index].clone()


@cpu_interp
@pytest.mark.parametrize(("fused", "stacked"), [(False, False), (True, False), (False, True)],
                         ids=["unfused", "fused", "unfused_stacked_gemv"])
@pytest.mark.parametrize("rotary", [False, True])
def test_mla_layer_triton_ops_match_reference(monkeypatch, rotary: bool, fused: bool, stacked: bool) -> None:
    """stacked: the unfused path's W_UK / W_UV products on `ops.stacked_linear`'s kernel (TOKENSPEED_STACKED_GEMV=1)
    wherever it takes the rows (the decodes and the verify window: two each; the 7-row prefill too)."""
    from tokenspeed import ops
    from tokenspeed.models.kimi import mla
    from tokenspeed.ops.triton import mla_decode as dec
    from tokenspeed.ops.triton import mla_prep, stacked_gemv

    monkeypatch.setenv(ops.STACKED_GEMV_ENV, "1" if stacked else "0")
    stacked_calls = []
    real_stacked = stacked_gemv.stacked_linear
    monkeypatch.setattr(stacked_gemv, "stacked_linear",
                        lambda x, w, out=None: stacked_calls.append(x.shape[0]) or real_stacked(x, w, out))
    model, attn = _layer(rotary)
    monkeypatch.delenv(mla.FUSED_ENV, raising=False)  # FUSED_DECODE decides
    monkeypatch.setattr(mla, "FUSED_DECODE", fused)
    monkeypatch.setattr(mla, "FUSED_MIN_SEQS", 1)  # any batch (the default waits for larger ones)
    monkeypatch.setattr(mla, "FUSED_RAGGED", True)  # mixed steps too (off by default)
    monkeypatch.setattr(dec, "DEFAULT_WAVES", 0.06)  # 4 split slots per sequence, not 132: a fast interpreter
    calls = {"store": 0, "absorb": 0, "q_rope": 0, "w_uv": 0}
    store, absorb, decode = mla_prep.mla_norm_store_latent, mla_prep.mla_norm_store_absorb, dec.mla_decode
    monkeypatch.setattr(mla_prep, "mla_norm_store_latent",
                        lambda *a, **k: calls.__setitem__("store", calls["store"] + 1) or store(*a, **k))
    monkeypatch.setattr(mla_prep, "mla_norm_store_absorb",
                        lambda *a, **k: calls.__setitem__("absorb", calls["absorb"] + 1) or absorb(*a, **k))

    def counted_decode(*a, q_rope=None, w_uv=None, **k):
        calls["q_rope"] += q_rope is not None
        calls["w_uv"] += w_uv is not None
        return decode(*a, q_rope=q_rope, w_uv=w_uv, **k)

    monkeypatch.setattr(dec, "mla_decode", counted_decode)
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
        results[mode] = _steps(model, attn)
    # every step's store and attention (the prefill ragged); fused: the store absorbs, the combine multiplies W_UV
    n = 4
    assert calls == ({"store": 0, "absorb": n, "q_rope": n, "w_uv": n} if fused else
                     {"store": n, "absorb": 0, "q_rope": n, "w_uv": 0})
    assert len(stacked_calls) == (2 * n if stacked else 0)  # W_UK and W_UV of each step
    (outs, cache), (ref_outs, ref_cache) = results["triton"], results["reference"]
    for got, ref in zip(outs, ref_outs, strict=True):
        assert rel_err(got, ref) < 1e-5
    written = ~torch.isnan(ref_cache) & (ref_cache != 0)
    assert torch.equal(written, ~torch.isnan(cache) & (cache != 0))
    assert rel_err(cache[written], ref_cache[written]) < 1e-5


@cpu_interp
@pytest.mark.parametrize("mixed", [False, True])
def test_fused_decode_matches_unfused_path(monkeypatch, mixed: bool) -> None:
    """The fused layer path (store + W_UK absorption in one launch, W_UV in the combine) against the unfused Triton
    ops it replaces (FUSED_DECODE off), both through the kernels: uniform steps (prefill ragged, decode, verify)
    and a mixed ragged batch with splits forced; outputs within fp32 summation-order noise, caches bit for bit."""
    from tokenspeed.models.kimi import mla
    from tokenspeed.ops.triton import mla_decode as dec

    model, attn = _layer(False)
    monkeypatch.delenv(mla.FUSED_ENV, raising=False)  # FUSED_DECODE decides
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setattr(dec, "MIN_CHUNK", 4)  # several splits per sequence: the merge of the W_UV combine runs
    # the mixed (ragged) plan: a budget of 8 slots a sequence; uniform steps: histories under BLOCK_N take one split
    # whatever the slots (the merge still runs: with w_uv every split writes partials), so 4 slots, not 132
    monkeypatch.setattr(dec, "DEFAULT_WAVES", 2.0 if mixed else 0.06)
    results = {}
    monkeypatch.setattr(mla, "FUSED_MIN_SEQS", 1)  # any batch (the default waits for larger ones)
    monkeypatch.setattr(mla, "FUSED_RAGGED", True)  # mixed steps too (off by default)
    for fused in (False, True):
        monkeypatch.setattr(mla, "FUSED_DECODE", fused)
        results[fused] = _mixed_steps(model, attn) if mixed else _steps(model, attn)
    if mixed:
        pairs = zip(results[True], results[False], strict=True)
    else:
        pairs = zip(results[True][0], results[False][0], strict=True)
        assert torch.equal(results[True][1].nan_to_num(-7.0), results[False][1].nan_to_num(-7.0))
    for got, ref in pairs:
        assert rel_err(got, ref) < 1e-5


def test_fused_switch_reads_the_environment(monkeypatch) -> None:
    """TOKENSPEED_MLA_FUSED overrides FUSED_DECODE at each call ("1" on, "0" off, unset / empty: the constant), and
    the layer's path decision (`_fused_form`, on the host) follows it between two calls in one process."""
    from tokenspeed.models.kimi import mla

    model, attn = _layer(False)
    cache = CacheBuffers.allocate(model.config, 12, PAGE, 4, torch.float32)
    batch = ForwardBatch.build([[8], [9]], [5, 2], [[7, 2, 9, 0], [4, 11, 1, 6]], [1, 3], PAGE)
    q = torch.zeros(2, attn.num_heads, attn.nope + attn.rope)
    latent = cache.mla_latent[attn.cache_index]
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setattr(mla, "FUSED_MIN_SEQS", 1)  # any batch (the default waits for larger ones)
    monkeypatch.setattr(mla, "FUSED_RAGGED", True)  # mixed steps too (off by default)
    for const in (True, False):
        monkeypatch.setattr(mla, "FUSED_DECODE", const)
        for env, want in ((None, const), ("", const), ("1", True), ("0", False), (" 1 ", True)):
            if env is None:
                monkeypatch.delenv(mla.FUSED_ENV, raising=False)
            else:
                monkeypatch.setenv(mla.FUSED_ENV, env)
            assert mla.fused_decode_enabled() is want
            assert attn._fused_form(q, batch, latent) == ("uniform" if want else None)
    monkeypatch.setenv(mla.FUSED_ENV, "yes")
    with pytest.raises(ValueError, match=mla.FUSED_ENV):
        mla.fused_decode_enabled()
    monkeypatch.undo()  # the shipped defaults: fused from FUSED_MIN_SEQS sequences, unless the variable says
    monkeypatch.delenv(mla.FUSED_ENV, raising=False)
    n = mla.FUSED_MIN_SEQS
    assert mla.FUSED_DECODE and n > 1 and not mla.fused_decode_enabled(n - 1) and mla.fused_decode_enabled(n)
    monkeypatch.setenv(mla.FUSED_ENV, "1")
    assert mla.fused_decode_enabled(1)


MIXED_PAGE = 4


def _mixed_steps(model, attn) -> list[torch.Tensor]:
    """A ragged prefill of four histories (50, 3, 40 and 5 tokens), then a mixed step: two decodes, a 20-token tail
    and a sequence without new tokens. Returns both steps' outputs."""
    cache = CacheBuffers.allocate(model.config, 48, MIXED_PAGE, 4, torch.float32)
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1)).tolist()
    pages = [perm[0:13], perm[13:15], perm[15:31], perm[31:33]]
    g = torch.Generator().manual_seed(2)
    outs, cached = [], [0, 0, 0, 0]
    for lens in ([50, 3, 40, 5], [1, 1, 20, 0]):
        ids = [[(7 * i + n) % 100 + 3 for i in range(q)] for n, q in enumerate(lens)]
        batch = ForwardBatch.build(ids, cached, pages, [0, 1, 2, 3], MIXED_PAGE)
        x = torch.randn(sum(lens), model.config.hidden_size, generator=g)
        with torch.no_grad():
            outs.append(attn(x, batch, cache))
        cached = [c + q for c, q in zip(cached, lens)]
    return outs


def _count_paths(monkeypatch, attn) -> dict:
    """Counts the layer's attention forms and the ragged `mla_decode` calls (with their sequence counts)."""
    from tokenspeed.ops.triton import mla_decode as dec

    calls = {"expanded": 0, "absorbed_ref": 0, "ragged_seqs": [], "uniform_seqs": []}
    for name, key in (("_attend_expanded", "expanded"), ("_attend_absorbed", "absorbed_ref")):
        real = getattr(attn, name)
        monkeypatch.setattr(attn, name, lambda *a, _r=real, _k=key: calls.__setitem__(_k, calls[_k] + 1) or _r(*a))
    decode = dec.mla_decode
    monkeypatch.setattr(dec, "mla_decode", lambda *a, cu_seqlens_q=None, **k: (
        calls["ragged_seqs"].append(cu_seqlens_q.numel() - 1) if cu_seqlens_q is not None
        else calls["uniform_seqs"].append(a[0].shape[0])) or decode(*a, cu_seqlens_q=cu_seqlens_q, **k))
    return calls


@cpu_interp
def test_mixed_batch_takes_the_ragged_kernel(monkeypatch) -> None:
    from tokenspeed.ops.triton import mla_decode as dec

    model, attn = _layer(False)
    monkeypatch.setattr(dec, "MIN_CHUNK", 16)  # with DEFAULT_WAVES 8: the long histories take 2 splits
    monkeypatch.setattr(dec, "DEFAULT_WAVES", 8.0)
    assert dec.plan_ragged([1, 1, 20, 0], [51, 4, 60, 5], 4, 8, 16)["splits"] == [2, 1, 2, 0]
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    ref = _mixed_steps(model, attn)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = _count_paths(monkeypatch, attn)
    got = _mixed_steps(model, attn)
    assert calls == {"expanded": 0, "absorbed_ref": 0, "ragged_seqs": [4, 4], "uniform_seqs": []}  # whole batch
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-5


@cpu_interp
def test_tail_over_the_limit_is_expanded(monkeypatch) -> None:
    from tokenspeed.models.kimi import mla

    model, attn = _layer(False)
    monkeypatch.setattr(mla, "ABSORBED_MAX_TAIL", 16)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    ref = _mixed_steps(model, attn)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = _count_paths(monkeypatch, attn)
    got = _mixed_steps(model, attn)
    # prefill: 50 and 40 expanded, 3 and 5 ragged; mixed step: the tail expanded, the two decodes through the
    # uniform decode kernels (Gluon on an H200)
    assert calls == {"expanded": 2, "absorbed_ref": 0, "ragged_seqs": [2], "uniform_seqs": [2]}
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-5


def test_cpu_path_unchanged(monkeypatch) -> None:
    """Without TOKENSPEED_OPS=triton on the CPU the kernel is not used: today's forms, the same bits as the
    reference mode."""
    model, attn = _layer(False)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    ref = _mixed_steps(model, attn)
    monkeypatch.delenv("TOKENSPEED_OPS")
    calls = _count_paths(monkeypatch, attn)
    got = _mixed_steps(model, attn)
    assert calls == {"expanded": 2, "absorbed_ref": 2, "ragged_seqs": [], "uniform_seqs": []}
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_uniform_form_on_cuda_only_for_decode_and_verify() -> None:
    """`_uniform_form`: equal query lengths of 1 (decode) and verify windows attend as one [N, Q, H] block; on
    CUDA, equal short tails outside verify do not (the split kernels compile per Q, so a lone 4-token turn would
    compile mid-serve: they take the ragged kernel); on the CPU every uniform length up to the limit does."""
    from types import SimpleNamespace

    from tokenspeed.models.kimi.mla import ABSORBED_MAX_QUERY_LEN, _uniform_form

    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)

    def batch(ql, verify=False):
        return SimpleNamespace(uniform_query_len=ql, verify=verify)

    assert _uniform_form(batch(1), cuda) and _uniform_form(batch(4, verify=True), cuda)
    assert not _uniform_form(batch(4), cuda) and not _uniform_form(batch(8), cuda)
    assert _uniform_form(batch(4), cpu) and _uniform_form(batch(ABSORBED_MAX_QUERY_LEN), cpu)
    assert not _uniform_form(batch(None), cuda) and not _uniform_form(batch(ABSORBED_MAX_QUERY_LEN + 1, True), cuda)


def test_expanded_form_takes_sequences_in_bounded_key_row_groups(monkeypatch) -> None:
    """The expanded form splits its sequences into groups whose keys and values fit in EXPANDED_MAX_BYTES (one
    sequence past it alone), so a step of many chunks on long histories does not build all their keys at once; the
    outputs are those of one call."""
    from tokenspeed.models.kimi import mla

    assert mla._key_row_groups([5, 5, 5], 10) == [(0, 2), (2, 3)]
    assert mla._key_row_groups([3, 20, 3, 3, 3], 10) == [(0, 1), (1, 2), (2, 5)]
    assert mla._key_row_groups([20], 10) == [(0, 1)]
    model, attn = _layer(False)
    ref = _mixed_steps(model, attn)  # the prefill expands histories of 50 and 40 keys in one call
    row_bytes = attn.num_heads * (attn.nope + attn.rope + attn.v_dim) * 4  # fp32 keys and values on the CPU
    monkeypatch.setattr(mla, "EXPANDED_MAX_BYTES", 45 * row_bytes)  # 45 key rows
    groups = []
    real = attn._attend_expanded_group
    monkeypatch.setattr(attn, "_attend_expanded_group", lambda q, subset, *a: groups.append(list(subset)) or real(
        q, subset, *a))
    got = _mixed_steps(model, attn)
    assert groups == [[0], [2], [2]]  # the prefill's two long sequences apart, then the mixed step's tail
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-6
