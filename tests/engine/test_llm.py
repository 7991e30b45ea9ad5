"""The engine end to end on the CPU (tiny presets, fp32): greedy tokens do not depend on how a request is run.

Scenarios: the same greedy tokens alone, in a batch of 16 mixed lengths, with chunk sizes 7, 16 and 64, after
forced preemption, with a prefix-cache hit from an earlier turn, and with the cache disabled; multi-turn reuse
reports cached tokens; a scaled swe-smith-like run reaches a cache hit >= 0.85; 200 random requests through a
small cache all finish correctly with integrity after every step and every page free at the end; fp8 cache.
"""

from __future__ import annotations

import random

import pytest

from tokenspeed import LLM, SamplingParams

PAGE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _llm(model: str = "tiny-k3", **kw) -> LLM:
    kw.setdefault("cache_memory_gb", 0.02)
    kw.setdefault("page_size", PAGE)
    return LLM(model, **kw)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def solo(request):
    """(model, prompts, params, greedy tokens of each prompt run alone)."""
    prompts = _prompts(16, 1)
    params = [GREEDY.clone(max_tokens=random.Random(i).randint(1, 12)) for i in range(16)]
    llm = _llm(request.param, max_num_seqs=1)
    return request.param, prompts, params, [_tokens(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]


def test_batch_of_16_mixed_lengths(solo) -> None:
    model, prompts, params, expected = solo
    assert _tokens(_llm(model), prompts, params) == expected


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_chunk_sizes(solo, chunk: int) -> None:
    model, prompts, params, expected = solo
    llm = _llm(model, chunked_prefill_size=chunk, max_num_batched_tokens=max(chunk, 32))
    assert _tokens(llm, prompts, params) == expected


def test_cache_disabled(solo) -> None:
    model, prompts, params, expected = solo
    assert _tokens(_llm(model, enable_prefix_caching=False), prompts, params) == expected


def test_forced_preemption(solo) -> None:
    model, prompts, params, expected = solo
    # 12 pages of 8 tokens hold ~2 long requests at once: the scheduler must preempt and resume.
    llm = _llm(model, num_pages=12, max_num_seqs=16, chunked_prefill_size=32)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.engine.cache.check_integrity()


def test_prefix_hit_from_earlier_turn(solo) -> None:
    model, prompts, _, _ = solo
    cached, fresh = _llm(model), _llm(model, enable_prefix_caching=False)
    history = prompts[2] + prompts[3]
    for turn in range(3):
        params = GREEDY.clone(max_tokens=6)
        out = cached.generate([history], params)[0]
        assert out.outputs[0].token_ids == _tokens(fresh, [history], params)[0]
        if turn:
            assert out.usage.cached_tokens >= (prev_len // PAGE) * PAGE - PAGE
        prev_len = len(history) + len(out.outputs[0].token_ids)
        history = history + out.outputs[0].token_ids + [7, 8, 9, 10 + turn]


def test_swe_smith_like_multi_turn_cache_hit() -> None:
    """3 sessions x 10 turns: first prompt 500 tokens, +8 new tokens per turn, 5 output tokens per turn."""
    llm = _llm("tiny-k3", page_size=16, cache_memory_gb=0.05)
    rng = random.Random(5)
    sessions = [[rng.randrange(3, 512) for _ in range(500)] for _ in range(3)]
    prompt_tokens = cached_tokens = 0
    for turn in range(10):
        outs = llm.generate(sessions, GREEDY.clone(max_tokens=5))
        for i, out in enumerate(outs):
            prompt_tokens += out.usage.prompt_tokens
            cached_tokens += out.usage.cached_tokens
            sessions[i] = sessions[i] + out.outputs[0].token_ids + [rng.randrange(3, 512) for _ in range(8)]
    assert cached_tokens / prompt_tokens >= 0.85


def test_pressure_200_requests_small_cache() -> None:
    prompts = _prompts(200, 7, 1, 40)
    params = [GREEDY.clone(max_tokens=random.Random(i).randint(1, 8)) for i in range(200)]
    expected = _tokens(_llm("tiny-k3", max_num_seqs=64), prompts, params)
    llm = _llm("tiny-k3", max_num_seqs=24, num_checkpoint_slots=6, num_pages=24, chunked_prefill_size=32)
    engine = llm.engine  # 24 pages of 8 tokens for up to 24 sequences of up to 48 tokens
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.cache.check_integrity()
    assert [done[i] for i in ids] == expected
    assert sum(s.num_preempted for s in engine.step_stats) > 0
    pages = engine.cache.pages
    assert not engine.cache.requests and not engine.cache.slots.live
    assert all(c == 0 for c in pages.refcount) and pages.num_available_pages == pages.num_pages


def test_fp8_cache_end_to_end() -> None:
    llm = _llm("tiny-k3", dtype="bfloat16", kv_cache_dtype="fp8")
    assert str(llm.engine.runner.buffers.mla_latent[0].dtype) == "torch.float8_e4m3fn"
    outs = llm.generate(_prompts(4, 3), GREEDY)
    assert all(len(o.outputs[0].token_ids) == 8 and o.finished for o in outs)
