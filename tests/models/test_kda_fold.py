"""KDA layer with the low-rank gates folded into the fused decode (`kda.folds_gates`): a decode step takes in_proj,
then `ops.kda_decode(f=None, f_a=, f_b_weight=, g_a=, g_b_weight=)` with no `fg_b_proj` launch, and equals the
unfolded path (fg_b_proj's bmm, then `kda_decode(f=, norm_gate=)`): outputs and both pools, on the reference ops and
on the Triton ops (CPU interpreter), fp32, with a padding slot. Verify steps, prefill steps, large batches, the
full-rank preset and TOKENSPEED_KDA_FOLD=0 keep the bmm.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err

# tests.ops.triton_env sets up Triton (the interpreter) before anything imports it
from tests.ops.triton_env import cpu_interp
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model
from tokenspeed.models.kimi import kda


def _layer(preset: str):
    model = load_model(preset, dtype=torch.float32, seed=4)
    return model, model.model.layers[model.config.kda_layers[0]].self_attn


def _batch(qlens: list[int], slots: list[int], verify: bool = False) -> ForwardBatch:
    ids = [[3] * q for q in qlens]
    return ForwardBatch.build(ids, [4] * len(qlens), [[s] for s in slots], slots, 16, verify=verify)


def _count_bmm(monkeypatch, attn) -> list:
    calls: list = []
    real = attn.fg_b_proj.forward
    monkeypatch.setattr(attn.fg_b_proj, "forward", lambda x: calls.append(x.shape) or real(x))
    return calls


def _step(model, attn, batch: ForwardBatch, fold: bool, monkeypatch, seed: int = 1):
    """One forward of `attn` on `batch` from a fresh cache with random pools; (output, conv pool, recurrent pool)."""
    monkeypatch.setenv("TOKENSPEED_KDA_FOLD", "1" if fold else "0")
    g = torch.Generator().manual_seed(seed)
    cache = CacheBuffers.allocate(model.config, 8, 16, 4, torch.float32)
    conv, rec = cache.kda_conv[attn.cache_index], cache.kda_recurrent[attn.cache_index]
    conv.copy_(torch.randn(conv.shape, generator=g))
    rec.copy_(torch.randn(rec.shape, generator=g) * 0.3)
    x = torch.randn(batch.num_tokens, model.config.hidden_size, generator=g)
    with torch.no_grad():
        o = attn(x, batch, cache)
    return o, conv.clone(), rec.clone()


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_folded_decode_equals_unfolded(mode: str, monkeypatch) -> None:
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    model, attn = _layer("tiny-kimi-linear")
    batch = _batch([1, 1, 1], [1, -1, 3])
    calls = _count_bmm(monkeypatch, attn)
    folded = _step(model, attn, batch, True, monkeypatch)
    assert calls == []  # no fg_b_proj launch
    plain = _step(model, attn, batch, False, monkeypatch)
    assert len(calls) == 1
    for got, want in zip(folded, plain, strict=True):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("qlens,slots,verify,preset,fold", [
    ([1, 1], [1, 3], True, "tiny-kimi-linear", False),         # verify: the replay reads the materialised f
    ([1] * (kda.FOLD_GATES_MAX_SEQS + 1), list(range(kda.FOLD_GATES_MAX_SEQS + 1)), False, "tiny-kimi-linear",
     False),                                                     # large batch: the bmm
    ([3, 3], [1, 3], False, "tiny-kimi-linear", False),         # several tokens per sequence
    ([1, 1], [1, 3], False, "tiny-k3", False),                  # full-rank gate: nothing to fold
    ([1, 1], [1, 3], False, "tiny-kimi-linear", True),
])
def test_fold_choice(qlens, slots, verify, preset, fold, monkeypatch) -> None:
    _, attn = _layer(preset)
    batch = _batch(qlens, slots, verify)
    monkeypatch.delenv("TOKENSPEED_KDA_FOLD", raising=False)
    assert not kda.folds_gates(batch, attn.full_rank_gate)  # opt-in (a wash on the H200: kda.FOLD_GATES_MAX_SEQS)
    monkeypatch.setenv("TOKENSPEED_KDA_FOLD", "1")
    assert kda.folds_gates(batch, attn.full_rank_gate) is fold
    monkeypatch.setenv("TOKENSPEED_KDA_FOLD", "0")
    assert not kda.folds_gates(batch, attn.full_rank_gate)
