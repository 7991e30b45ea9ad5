"""Asynchronous scheduling (step N+1 launched before step N's tokens are read) gives the synchronous engine's greedy
tokens, keeps the cache exact, and falls back to the synchronous step when it must.

Scenarios (CPU, tiny presets, fp32; `async_scheduling="on"` forces it without CUDA graphs): a batch of 16 mixed
lengths with chunked prefill (both presets), with steps actually launched ahead; stop tokens that end requests
mid-run (the extra row is dropped); multi-turn sessions whose later turns hit the prefix cache through the deferred
decode checkpoints, with the sync run's tokens and cached-token counts; seeded sampled requests chosen on the
device with the sync run's tokens; penalty / logprobs requests in the mix (synchronous steps while they live); aborts of requests in flight; 200 requests through a
small cache (preemption pressure: pipelining pauses) with integrity after every step and every page free at the end.
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


def _llm(model: str = "tiny-k3", mode: str = "on", **kw) -> LLM:
    kw.setdefault("cache_memory_gb", 0.02)
    kw.setdefault("page_size", PAGE)
    return LLM(model, async_scheduling=mode, **kw)


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _all_free(llm: LLM) -> None:
    cache = llm.engine.cache
    cache.check_integrity()
    assert not cache.requests and not cache.slots.live and not llm.engine.requests
    assert all(c == 0 for c in cache.pages.refcount)


@pytest.mark.parametrize("model", ["tiny-k3", "tiny-kimi-linear"])
def test_mixed_batch_equals_sync(model: str) -> None:
    prompts = _prompts(16, 1)
    params = [GREEDY.clone(max_tokens=random.Random(i).randint(1, 12)) for i in range(16)]
    kw = {"chunked_prefill_size": 16, "max_num_batched_tokens": 48}
    expected = _run(_llm(model, "off", **kw), prompts, params)
    llm = _llm(model, **kw)
    assert llm.engine.async_scheduling
    assert _run(llm, prompts, params) == expected
    assert llm.engine.num_async_steps > 10
    _all_free(llm)


def test_stop_tokens_end_requests_mid_run() -> None:
    prompts = _prompts(8, 2)
    long = GREEDY.clone(max_tokens=16)
    plain = _run(_llm(mode="off"), prompts, long)
    params = [long.clone(stop_token_ids=[out[len(out) // 2]]) for out in plain]
    expected = _run(_llm(mode="off"), prompts, params)
    assert any(len(e) < 16 for e in expected)
    llm = _llm()
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.outputs[0].finish_reason for o in outs] == ["stop" if len(e) < 16 else "length" for e in expected]
    _all_free(llm)


def test_multi_turn_prefix_hits_match_sync() -> None:
    """Later turns resume from checkpoints taken during decode; in async mode those at decode page boundaries are
    planned one step late (before the next forward), so hits and tokens match the synchronous engine's."""
    results = {}
    for mode in ("off", "on"):
        llm = _llm(mode=mode, cache_memory_gb=0.05)
        rng = random.Random(5)
        sessions = [[rng.randrange(3, 512) for _ in range(40 + 13 * i)] for i in range(3)]
        tokens, cached = [], []
        for turn in range(5):
            outs = llm.generate(sessions, GREEDY.clone(max_tokens=11 + turn))
            for i, out in enumerate(outs):
                tokens.append(out.outputs[0].token_ids)
                cached.append(out.usage.cached_tokens)
                sessions[i] = sessions[i] + out.outputs[0].token_ids + [rng.randrange(3, 512) for _ in range(5)]
        results[mode] = (tokens, cached)
        if mode == "on":
            assert llm.engine.num_async_steps > 0
        _all_free(llm)
    assert results["on"][0] == results["off"][0]
    on, off = results["on"][1], results["off"][1]
    assert sum(on) >= sum(off) - PAGE * len(off) // 5 and sum(on[3:]) > 0  # a turn that ended on a page boundary
    # may lose its last decode checkpoint (one page recomputed); every later turn still hits the cache


def test_seeded_sampling_runs_async_with_the_sync_tokens() -> None:
    """Seeded temperature / top-k / top-p requests are chosen on the device: the same tokens as synchronous steps
    (one draw per step from each request's own generator), mixed with greedy rows."""
    prompts = _prompts(6, 6)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=9),
              SamplingParams(temperature=1.2, top_k=20, seed=4, max_tokens=7),
              SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=5, max_tokens=10), GREEDY,
              SamplingParams(temperature=1.0, seed=6, max_tokens=5)]
    expected = _run(_llm(mode="off"), prompts, params)
    llm = _llm()
    assert _run(llm, prompts, params) == expected
    assert llm.engine.num_async_steps > 5
    _all_free(llm)


def test_penalty_and_logprobs_requests_fall_back_to_sync() -> None:
    prompts = _prompts(6, 3)
    params = [GREEDY] * 4 + [SamplingParams(temperature=0.8, seed=3, max_tokens=8, repetition_penalty=1.3),
                             GREEDY.clone(logprobs=2)]
    expected = _run(_llm(mode="off"), prompts, params)
    llm = _llm()
    assert _run(llm, prompts, params) == expected
    assert llm.engine.num_async_steps == 0  # a penalty / logprobs request was live throughout
    # with only plain requests left the engine pipelines again
    assert _run(llm, prompts[:4], GREEDY) == expected[:4]
    assert llm.engine.num_async_steps > 0
    _all_free(llm)


def test_abort_in_flight() -> None:
    prompts = _prompts(6, 4, 10, 30)
    params = GREEDY.clone(max_tokens=12)
    expected = _run(_llm(mode="off"), prompts, params)
    llm = _llm()
    ids = [llm.add_request(p, params) for p in prompts]
    done = {}
    steps = 0
    while llm.engine.has_work:
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 4:  # requests 1 and 4 are decoding, with a step in flight
            assert llm.engine._in_flight is not None
            llm.engine.abort(ids[1])
            llm.engine.abort(ids[4])
        llm.engine.cache.check_integrity()
    assert [done[i] for i in ids if i not in (ids[1], ids[4])] == [e for j, e in enumerate(expected) if j not in (1, 4)]
    _all_free(llm)


def test_pressure_200_requests_small_cache() -> None:
    prompts = _prompts(200, 7, 1, 40)
    params = [GREEDY.clone(max_tokens=random.Random(i).randint(1, 8)) for i in range(200)]
    expected = _run(_llm(mode="off", max_num_seqs=64), prompts, params)
    llm = _llm(max_num_seqs=24, num_checkpoint_slots=6, num_pages=40, chunked_prefill_size=16,
               max_num_batched_tokens=32)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while llm.engine.has_work:
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        llm.engine.cache.check_integrity()
    assert [done[i] for i in ids] == expected
    assert llm.engine.num_async_steps > 0
    _all_free(llm)
