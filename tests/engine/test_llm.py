"""The engine end to end on the CPU (tiny presets, fp32): greedy tokens do not depend on how a request is run.

Scenarios: the same greedy tokens alone, in a batch of 16 mixed lengths, with chunk sizes 7, 16 and 64 (and 8 beside
decodes), after
forced preemption, with a prefix-cache hit from an earlier turn, and with the cache disabled; multi-turn reuse
reports cached tokens; a scaled swe-smith-like run reaches a cache hit >= 0.85; 200 random requests through a
small cache all finish correctly with integrity after every step and every page free at the end; fp8 cache.
"""

from __future__ import annotations

import random

import pytest
import torch

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


def test_prefill_chunk_beside_decodes(solo) -> None:
    """With prefill_chunk_beside_decodes, a prompt takes at most that many tokens in a step where another request
    decodes (the decoders' steps stay short) and up to the full chunk otherwise; the greedy tokens are unchanged."""
    model, prompts, params, expected = solo
    llm = _llm(model, chunked_prefill_size=64, max_num_batched_tokens=128, prefill_chunk_beside_decodes=8)
    steps: list[list[tuple[bool, int]]] = []  # per step: (decoding, new tokens) of each scheduled request
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append([(r.num_computed_tokens >= r.request.num_prompt_tokens, r.num_new_tokens)
                      for r in batch.requests])
        return batch

    llm.engine.scheduler.schedule = recording
    assert _tokens(llm, prompts, params) == expected
    beside = [n for step in steps if any(d for d, _ in step) for d, n in step if not d]
    alone = [n for step in steps if not any(d for d, _ in step) for _, n in step]
    assert beside and max(beside) <= 8  # prompts did run beside decodes, in short chunks
    assert max(alone) > 8  # and in longer ones when nothing decoded


class _Recording:
    """The model, recording (new tokens per sequence, verify) of each forward it runs."""

    def __init__(self, model, steps: list) -> None:
        self._model, self._steps = model, steps

    def __call__(self, batch, *args):
        self._steps.append((list(batch.query_lens_host), batch.verify))
        return self._model(batch, *args)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_start_up_warm_up_touches_no_request_state(solo, num_drafts: int) -> None:
    """The GPU start-up warm-up (prefill forwards, then mixed decode + tail steps on a cached history, and a tail on
    a long history, all on the scratch page and slot 0, run here on the CPU; the mixed steps commit as serving's
    do; with speculation the same steps again as verifications with their replay, and the shorter windows) writes
    only the scratch page (the one past the pool) and KDA slot 0, leaves no recorded verification
    behind, and changes no request's tokens."""
    model, prompts, params, expected = solo
    llm = _llm(model)
    buffers, scratch = llm.engine.runner.buffers, llm.engine.runner.num_pages
    for pool in buffers.mla_latent:
        pool.normal_()
    for pool in buffers.kda_conv + buffers.kda_recurrent:
        pool[1:].normal_()
    before = [t.clone() for t in buffers.mla_latent + buffers.kda_conv + buffers.kda_recurrent]
    runner, steps = llm.engine.runner, []
    model = runner.model
    runner.model = _Recording(model, steps)
    try:
        runner.warm_up([70, 9, 1], [(1, 5), (1, 1, 1, 12)], num_drafts=num_drafts, long_tails=[(20, 91)])
    finally:
        runner.model = model
    # the mixed steps and the long tail commit (the kernel variants of serving's steps); with drafts each mixed step
    # also runs as a verification, its one-token rows as windows
    windows = [([1 + num_drafts, 5], True), ([1 + num_drafts] * 3 + [12], True)] if num_drafts else []
    # then each shorter window (no graph: eager), alone and beside a full one
    short = [(q, True) for w in range(2, 1 + num_drafts) for q in ([w], [1 + num_drafts, w])]
    assert steps == [([70], False), ([9], False), ([1], False), ([1, 5], False), *windows[:1],
                     ([1, 1, 1, 12], False), *windows[1:], *short, ([20], False)]
    assert not buffers.replay
    for old, new in zip(before[: len(buffers.mla_latent)], buffers.mla_latent, strict=True):
        assert torch.equal(old[:scratch], new[:scratch]) and not torch.equal(old[scratch], new[scratch])
    for old, new in zip(before[len(buffers.mla_latent):], buffers.kda_conv + buffers.kda_recurrent, strict=True):
        assert torch.equal(old[1:], new[1:])
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
    prev_len = 0
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
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, preemptions = {}, 0
    while engine.has_work:
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                preemptions += out.metrics.num_preemptions
        engine.cache.check_integrity()
    assert [done[i] for i in ids] == expected
    assert preemptions > 0 and not engine.requests
    pages = engine.cache.pages
    assert not engine.cache.requests and not engine.cache.slots.live
    assert all(c == 0 for c in pages.refcount) and pages.num_available_pages == pages.num_pages


def test_fp8_cache_end_to_end() -> None:
    llm = _llm("tiny-k3", dtype="bfloat16", kv_cache_dtype="fp8")
    assert str(llm.engine.runner.buffers.mla_latent[0].dtype) == "torch.float8_e4m3fn"
    outs = llm.generate(_prompts(4, 3), GREEDY)
    assert all(len(o.outputs[0].token_ids) == 8 and o.finished for o in outs)


def test_text_prompts_stop_strings_and_n() -> None:
    llm = _llm("tiny-k3")
    base = llm.generate("def main():", GREEDY.clone(max_tokens=12))[0]
    text = base.outputs[0].text
    assert base.prompt == "def main():" and base.usage.prompt_tokens == len("def main():")
    if len(text) >= 4:  # stop on a string that the greedy output contains: cut exactly before it
        stop = text[2:4]
        out = llm.generate("def main():", GREEDY.clone(max_tokens=12, stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[: text.index(stop)]
    many = llm.generate([[5, 6, 7]], SamplingParams(n=3, max_tokens=4, seed=1, temperature=1.0))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2] and many.usage.completion_tokens == 12


def test_prompt_logprobs_match_forward_logits() -> None:
    import torch

    from tokenspeed.models import forward_logits

    llm = _llm("tiny-k3", chunked_prefill_size=16, max_num_batched_tokens=16)
    ids = _prompts(1, 9, 40, 40)[0]
    out = llm.generate([ids], GREEDY.clone(max_tokens=1, prompt_logprobs=0))[0]
    ref = torch.log_softmax(forward_logits(llm.engine.model, ids), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for t in range(1, len(ids)):
        assert abs(out.prompt_logprobs[t][ids[t]] - ref[t - 1, ids[t]].item()) < 1e-4


def test_bad_requests_raise_and_engine_keeps_serving() -> None:
    from tokenspeed.core.sampling_params import RequestError

    llm = _llm("tiny-k3", max_model_len=64)
    for prompt, params in (([], GREEDY), ([1] * 64, GREEDY), ([10**6], GREEDY)):
        with pytest.raises(RequestError):
            llm.generate([prompt], params)
    with pytest.raises(RequestError):
        SamplingParams(temperature=-1)
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("given", [{"num_pages": 4}, {"cache_memory_gb": 1e-5}], ids=["num_pages", "budget"])
def test_cache_smaller_than_one_prefill_chunk_names_the_fix(given: dict) -> None:
    """A cache that cannot hold one prefill chunk is a ConfigError naming the setting to change (the given page
    count or the memory budget) and the chunk-size alternative."""
    from tokenspeed.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _llm("tiny-k3", chunked_prefill_size=64, **given)
    msg = str(err.value)
    assert "64-token prefill chunk needs (9 pages of 8 tokens)" in msg
    assert ("raise num_pages" if "num_pages" in given else "raise cache_memory_gb") in msg
    assert "lower chunked_prefill_size / max_num_batched_tokens" in msg
