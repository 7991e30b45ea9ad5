"""Speculative verification with KDA replay on whole tiny models (fp32).

Scenarios: a verify forward of k+1 tokens per sequence gives the same logits as committing them, leaves every KDA
state untouched; replaying any accepted count 0..k+1 per sequence (different per sequence in one batch) leaves
conv and recurrent states equal to decoding those tokens one by one (within 1e-5); decoding continues correctly.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model

PAGE = 4


def _batch(model, seqs: dict[int, list[int]], cached: dict[int, int], verify: bool = False) -> ForwardBatch:
    slots = list(seqs)
    pages = [list(range(s * 16, s * 16 + 16)) for s in slots]
    return ForwardBatch.build([seqs[s] for s in slots], [cached[s] for s in slots], pages, slots, PAGE,
                              verify=verify)


def _states(cache: CacheBuffers, slots: list[int]) -> list[torch.Tensor]:
    return [t[slots].clone() for t in cache.kda_conv + cache.kda_recurrent]


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_verify_then_replay_equals_sequential_decode(preset: str) -> None:
    model = load_model(preset, dtype=torch.float32, seed=8)
    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(3, 500, (13,), generator=g).tolist(), 2: torch.randint(3, 500, (6,), generator=g)
               .tolist(), 5: torch.randint(3, 500, (21,), generator=g).tolist()}
    windows = {s: torch.randint(3, 500, (4,), generator=g).tolist() for s in prompts}  # t0 + 3 drafts
    accepted = {0: 1, 2: 4, 5: 3}
    cached = {s: len(p) for s, p in prompts.items()}
    slots = list(prompts)

    spec = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
    ref = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
    with torch.no_grad():
        for cache in (spec, ref):
            model(_batch(model, prompts, {s: 0 for s in slots}), cache)
        before = _states(spec, slots)
        vb = _batch(model, windows, cached, verify=True)
        verify_logits = model(vb, spec)
        assert all(torch.equal(a, b) for a, b in zip(before, _states(spec, slots)))  # nothing committed
        commit_logits = model(_batch(model, windows, cached), ref)
        assert rel_err(verify_logits, commit_logits) < 1e-6
        model.replay_kda(spec, vb, [accepted[s] for s in slots])
        # reference: fresh prompts, then the accepted tokens one by one
        ref = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
        model(_batch(model, prompts, {s: 0 for s in slots}), ref)
        for j in range(4):
            step = {s: [windows[s][j]] for s in slots if j < accepted[s]}
            if step:
                model(_batch(model, step, {s: cached[s] + j for s in step}), ref)
        for a, b in zip(_states(spec, slots), _states(ref, slots)):
            assert rel_err(a, b) < 1e-5
        # decoding goes on from the replayed state exactly as from the sequential one
        nxt = {s: [7] for s in slots}
        pos = {s: cached[s] + accepted[s] for s in slots}
        assert rel_err(model(_batch(model, nxt, pos), spec), model(_batch(model, nxt, pos), ref)) < 1e-5


def test_replay_of_zero_tokens_keeps_the_state() -> None:
    model = load_model("tiny-k3", dtype=torch.float32, seed=2)
    cache = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
    with torch.no_grad():
        model(_batch(model, {1: [5, 6, 7]}, {1: 0}), cache)
        before = _states(cache, [1])
        vb = _batch(model, {1: [8, 9]}, {1: 3}, verify=True)
        model(vb, cache)
        model.replay_kda(cache, vb, [0])
    assert all(torch.equal(a, b) for a, b in zip(before, _states(cache, [1])))
