"""One MLA layer through the Triton ops (TOKENSPEED_OPS=triton, CPU interpreter, fp32) against the reference ops.

* A prefill, two decodes and a verify window of two sequences (scattered pages), for the NoPE preset and a rotary
  (YaRN) variant: outputs and the latent cache agree (1e-5 relative); every step writes its rows with one
  `mla_norm_store_latent` kernel launch; every step passes the absorbed query to `mla_decode` as two views (q_rope
  given, no concatenation): decode and verify in the uniform form, the prefill (5 and 2 tokens) in the ragged one.
* Mixed batches (decodes beside a 20-token tail, a sequence without new tokens, after a ragged prefill of
  histories up to 50 tokens): with the kernel, the whole batch is one ragged `mla_decode` (neither the expanded
  form nor the torch absorbed reference runs) and matches the reference path (1e-5; the split plan forced to
  split); with the tail over ABSORBED_MAX_TAIL, the tail is expanded and only the short sequences go through the
  ragged kernel (a subset); on the CPU without TOKENSPEED_OPS=triton the layer takes today's path bit for bit.
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
@pytest.mark.parametrize("rotary", [False, True])
def test_mla_layer_triton_ops_match_reference(monkeypatch, rotary: bool) -> None:
    from tokenspeed.ops.triton import mla_decode as dec
    from tokenspeed.ops.triton import mla_prep

    model, attn = _layer(rotary)
    monkeypatch.setattr(dec, "DEFAULT_WAVES", 0.06)  # 4 split slots per sequence, not 132: a fast interpreter
    calls = {"store": 0, "q_rope": 0}
    store, decode = mla_prep.mla_norm_store_latent, dec.mla_decode
    monkeypatch.setattr(mla_prep, "mla_norm_store_latent",
                        lambda *a, **k: calls.__setitem__("store", calls["store"] + 1) or store(*a, **k))
    monkeypatch.setattr(dec, "mla_decode", lambda *a, q_rope=None, **k: calls.__setitem__(
        "q_rope", calls["q_rope"] + (q_rope is not None)) or decode(*a, q_rope=q_rope, **k))
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
        results[mode] = _steps(model, attn)
    assert calls == {"store": 4, "q_rope": 4}  # every step's store and attention (the prefill ragged)
    (outs, cache), (ref_outs, ref_cache) = results["triton"], results["reference"]
    for got, ref in zip(outs, ref_outs, strict=True):
        assert rel_err(got, ref) < 1e-5
    written = ~torch.isnan(ref_cache) & (ref_cache != 0)
    assert torch.equal(written, ~torch.isnan(cache) & (cache != 0))
    assert rel_err(cache[written], ref_cache[written]) < 1e-5


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

    calls = {"expanded": 0, "absorbed_ref": 0, "ragged_seqs": []}
    for name, key in (("_attend_expanded", "expanded"), ("_attend_absorbed", "absorbed_ref")):
        real = getattr(attn, name)
        monkeypatch.setattr(attn, name, lambda *a, _r=real, _k=key: calls.__setitem__(_k, calls[_k] + 1) or _r(*a))
    decode = dec.mla_decode
    monkeypatch.setattr(dec, "mla_decode", lambda *a, cu_seqlens_q=None, **k: (
        cu_seqlens_q is not None and calls["ragged_seqs"].append(cu_seqlens_q.numel() - 1)) or decode(
        *a, cu_seqlens_q=cu_seqlens_q, **k))
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
    assert calls == {"expanded": 0, "absorbed_ref": 0, "ragged_seqs": [4, 4]}  # both steps: one whole-batch call
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
    # prefill: 50 and 40 expanded, 3 and 5 ragged; mixed step: the tail expanded, the two decodes ragged
    assert calls == {"expanded": 2, "absorbed_ref": 0, "ragged_seqs": [2, 2]}
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
    assert calls == {"expanded": 2, "absorbed_ref": 2, "ragged_seqs": []}
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)
