"""Speculative verification with KDA replay on whole tiny models (fp32).

Scenarios: a verify forward of k+1 tokens per sequence gives the same logits as committing them, leaves every KDA
state untouched (except a prompt chunk's beside the windows: committed in the forward, skipped by the replay);
replaying any accepted count 0..k+1 per sequence (different per sequence in one batch) leaves conv and recurrent
states equal to decoding those tokens one by one (within 1e-5); decoding continues correctly.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model

PAGE = 4


def _batch(model, seqs: dict[int, list[int]], cached: dict[int, int], verify: bool = False,
           prompt_slots: tuple[int, ...] = ()) -> ForwardBatch:
    slots = list(seqs)
    pages = [list(range(s * 16, s * 16 + 16)) for s in slots]
    return ForwardBatch.build([seqs[s] for s in slots], [cached[s] for s in slots], pages, slots, PAGE,
                              verify=verify, prompt_rows=[i for i, s in enumerate(slots) if s in prompt_slots])


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


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_prompt_chunk_beside_verify_windows_commits_in_the_forward(preset: str) -> None:
    """A verification that also carries a prompt chunk (no drafts; the chunked scan on the CPU): the chunk's KDA
    state is committed by the forward, bit for bit the state of the same forward without verification, recorded
    as committed, and the replay applies none of its tokens (even when told all of them) while it advances the
    windows by their accepted counts as usual."""
    model = load_model(preset, dtype=torch.float32, seed=8)
    g = torch.Generator().manual_seed(4)
    first = {0: torch.randint(3, 500, (9,), generator=g).tolist(), 3: torch.randint(3, 500, (5,), generator=g).tolist()}
    step = {0: torch.randint(3, 500, (4,), generator=g).tolist(),  # t0 + 3 drafts
            3: torch.randint(3, 500, (11,), generator=g).tolist()}  # the next prompt chunk
    cached = {s: len(p) for s, p in first.items()}
    spec = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
    ref = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
    with torch.no_grad():
        for cache in (spec, ref):
            model(_batch(model, first, {s: 0 for s in first}), cache)
        window_before = _states(spec, [0])
        vb = _batch(model, step, cached, verify=True, prompt_slots=(3,))
        verify_logits = model(vb, spec)
        assert all(torch.equal(a, b) for a, b in zip(window_before, _states(spec, [0])))
        assert spec.replay and all(rec.committed == (1,) for rec in spec.replay.values())
        commit_logits = model(_batch(model, step, cached), ref)  # both rows committed, no verification
        assert rel_err(verify_logits, commit_logits) < 1e-6
        assert all(torch.equal(a, b) for a, b in zip(_states(spec, [3]), _states(ref, [3])))
        model.replay_kda(spec, vb, [2, len(step[3])])
        assert all(torch.equal(a, b) for a, b in zip(_states(spec, [3]), _states(ref, [3])))
        ref2 = CacheBuffers.allocate(model.config, 128, PAGE, 8, torch.float32)
        model(_batch(model, {0: first[0]}, {0: 0}), ref2)
        model(_batch(model, {0: step[0][:2]}, {0: cached[0]}), ref2)
        for a, b in zip(_states(spec, [0]), _states(ref2, [0])):
            assert rel_err(a, b) < 1e-5
