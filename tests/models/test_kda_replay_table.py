"""The model's KDA state replay through one layer table (`KimiForCausalLM.kda_replay_table` / `replay_kda`).

Checked on tiny models in fp32: a verify forward's recorded inputs give a uniform table over every KDA layer
(offsets that address each layer's tensors from layer 0's); replaying through a prebuilt table equals replaying
with one built on the spot and consumes the recorded inputs; a table of another verification is refused; with
TOKENSPEED_OPS=triton (CPU interpreter) the replay is one multi-layer launch whose pools equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err

# tests.ops.triton_env sets up Triton (the interpreter) before anything imports it
from tests.ops.triton_env import cpu_interp
from tokenspeed import ops
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model
from tokenspeed.ops.kda_layers import LAYER_FIELDS

PAGE = 4


def _verified(preset: str, seed: int = 3):
    """A model, a cache whose slots 0 and 5 hold prompts, and a recorded 4-token verification of both."""
    model = load_model(preset, dtype=torch.float32, seed=seed)
    cache = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
    g = torch.Generator().manual_seed(seed)
    seqs = {0: torch.randint(3, 500, (9,), generator=g).tolist(), 5: torch.randint(3, 500, (5,), generator=g).tolist()}
    pages = [list(range(s * 16, s * 16 + 16)) for s in seqs]
    window = {s: torch.randint(3, 500, (4,), generator=g).tolist() for s in seqs}
    with torch.no_grad():
        model(ForwardBatch.build(list(seqs.values()), [0, 0], pages, list(seqs), PAGE), cache)
        vb = ForwardBatch.build(list(window.values()), [len(p) for p in seqs.values()], pages, list(seqs), PAGE,
                                verify=True)
        model(vb, cache)
    return model, cache, vb


def _pools(cache: CacheBuffers) -> list[torch.Tensor]:
    return [t.clone() for t in cache.kda_conv + cache.kda_recurrent]


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_table_covers_every_kda_layer(preset: str) -> None:
    model, cache, _ = _verified(preset)
    table = model.kda_replay_table(cache)
    L = len(model.config.kda_layers)
    assert table.num_layers == L and table.offsets is not None, table.reason
    assert table.offsets.shape == (L, len(LAYER_FIELDS))
    for layer, row in zip(table.layers, table.offsets.tolist()):
        for t, t0, off in zip(layer, table.base, row):
            assert t0.data_ptr() + off * t0.element_size() == t.data_ptr()
    assert table.layers[1].conv_state is cache.kda_conv[1] and table.layers[2].qkv is cache.replay[2].projected


def test_prebuilt_table_equals_fresh_and_consumes_inputs() -> None:
    model, cache, vb = _verified("tiny-k3")
    model2, cache2, vb2 = _verified("tiny-k3")
    table = model.kda_replay_table(cache)
    accepted = torch.tensor([3, 1])
    model.replay_kda(cache, vb, accepted, table=table)
    model2.replay_kda(cache2, vb2, accepted)
    assert not cache.replay and not cache2.replay
    assert all(torch.equal(a, b) for a, b in zip(_pools(cache), _pools(cache2)))


def test_table_of_another_verification_is_refused() -> None:
    model, cache, vb = _verified("tiny-k3")
    _, other, _ = _verified("tiny-k3")
    with pytest.raises(ValueError, match="other tensors"):
        model.replay_kda(cache, vb, [1, 1], table=model.kda_replay_table(other))


@cpu_interp
def test_triton_replay_is_one_launch(monkeypatch) -> None:
    """TOKENSPEED_OPS=triton, interpreter: one multi-layer launch, no per-layer ones, told the verify window (the
    WY replay's bound); pools as the reference."""
    from tokenspeed.ops.triton import kda_decode as mod

    model, cache, vb = _verified("tiny-kimi-linear")
    ref_cache = CacheBuffers(cache.page_size, cache.mla_latent, [t.clone() for t in cache.kda_conv],
                             [t.clone() for t in cache.kda_recurrent], replay=dict(cache.replay))
    accepted = torch.tensor([4, 2])
    model.replay_kda(ref_cache, vb, accepted)  # reference (CPU tensors, auto mode)
    calls, bounds = {"multi": 0, "single": 0}, []
    multi, single = mod.kda_replay_layers, mod.kda_decode
    monkeypatch.setattr(mod, "kda_replay_layers", lambda *a, **k: calls.__setitem__("multi", 1 + calls["multi"])
                        or bounds.append(k.get("max_seq_tokens")) or multi(*a, **k))
    monkeypatch.setattr(mod, "kda_decode", lambda *a, **k: calls.__setitem__("single", 1 + calls["single"])
                        or single(*a, **k))
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    assert ops.dispatch.kda_replay_layers_unsupported(model.kda_replay_table(cache)) is None
    model.replay_kda(cache, vb, accepted)
    assert calls == {"multi": 1, "single": 0} and bounds == [4]
    for a, b in zip(_pools(cache), _pools(ref_cache)):
        assert rel_err(a, b) < 1e-5
