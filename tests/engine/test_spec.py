"""Speculative decoding in the engine (n-gram drafts, KDA verify + replay): greedy output equals greedy output
without speculation, token for token, in mixed batches, with requests finishing mid-window, with prefix-cache
hits; forced acceptance accepts exactly L drafts per step; acceptance statistics are reported.
"""

from __future__ import annotations

import random

import pytest

from tokenspeed import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 512) for _ in range(rng.randint(2, 6))]
        out.append((motif * 12)[: rng.randint(8, 60)])  # repetitive: the n-gram proposer finds drafts
    return out


@pytest.mark.parametrize("model", ["tiny-k3", "tiny-kimi-linear"])
def test_greedy_with_speculation_equals_without(model: str) -> None:
    prompts = _prompts(12, 3)
    params = [GREEDY.clone(max_tokens=random.Random(i).randint(1, 20)) for i in range(12)]
    plain = LLM(model, cache_memory_gb=0.02, page_size=8)
    spec = LLM(model, cache_memory_gb=0.02, page_size=8, speculative_algorithm="ngram", speculative_num_steps=3)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    spec.engine.cache.check_integrity()
    # second turn: prefix-cache hits under speculation
    turn2 = [p + e + [9, 10, 11] for p, e in zip(prompts, expected)]
    again = spec.generate(turn2, GREEDY.clone(max_tokens=6))
    assert [o.outputs[0].token_ids for o in again] == [
        o.outputs[0].token_ids for o in plain.generate(turn2, GREEDY.clone(max_tokens=6))]
    assert sum(o.usage.cached_tokens for o in again) > 0


def test_forced_acceptance_accepts_exactly_l() -> None:
    llm = LLM("tiny-k3", cache_memory_gb=0.02, speculative_algorithm="repeat", speculative_num_steps=3,
              speculative_force_accept_length=2)
    out = llm.generate([[5, 6, 7, 8]], GREEDY.clone(max_tokens=13))[0]
    m = out.metrics
    assert len(out.outputs[0].token_ids) == 13
    # 1 token from the prefill step, then 4 verify steps of 2 accepted drafts + 1 bonus
    assert (m.num_spec_steps, m.num_accepted_tokens, m.mean_acceptance_length) == (4, 8, 3.0)


def test_ngram_drafts_are_accepted_on_repetitive_text() -> None:
    llm = LLM("tiny-k3", cache_memory_gb=0.02, speculative_algorithm="ngram", speculative_num_steps=3)
    outs = llm.generate(_prompts(8, 5), GREEDY)
    steps = sum(o.metrics.num_spec_steps for o in outs)
    assert steps > 0 and sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert all(1.0 <= (o.metrics.mean_acceptance_length or 1.0) <= 4.0 for o in outs)


@pytest.mark.parametrize("model", ["tiny-k3", "tiny-kimi-linear"])
def test_eagle3_greedy_equals_plain(model: str) -> None:
    prompts = _prompts(8, 11)
    params = [GREEDY.clone(max_tokens=random.Random(i).randint(1, 16)) for i in range(8)]
    plain = LLM(model, cache_memory_gb=0.02, page_size=8)
    spec = LLM(model, cache_memory_gb=0.02, page_size=8, speculative_algorithm="EAGLE3",
               speculative_draft_model_path="tiny-eagle3", speculative_num_steps=3)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_spec_steps for o in outs) > 0
    turn2 = [p + e + [9, 10] for p, e in zip(prompts, expected)]
    assert [o.outputs[0].token_ids for o in spec.generate(turn2, GREEDY.clone(max_tokens=5))] == [
        o.outputs[0].token_ids for o in plain.generate(turn2, GREEDY.clone(max_tokens=5))]
    spec.engine.cache.check_integrity()


def test_sampled_and_greedy_requests_in_one_speculative_batch() -> None:
    prompts = _prompts(6, 21)
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12,
                                                   ignore_eos=True) for i in range(6)]
    plain = LLM("tiny-k3", cache_memory_gb=0.02)
    spec = LLM("tiny-k3", cache_memory_gb=0.02, speculative_algorithm="ngram")
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert len(g.outputs[0].token_ids) == params[i].max_tokens
        if i % 2:
            assert g.outputs[0].token_ids == e.outputs[0].token_ids


def test_greedy_verify_steps_take_the_argmax_path(monkeypatch) -> None:
    """Verify steps whose requests are all plain greedy choose by one argmax (`ModelRunner._accept_greedy`, no
    per-position sampler inputs) and give the tokens of the general sampler path; a request asking for logprobs
    keeps the general path and gets one logprob per emitted token."""
    from tokenspeed.executor.runner import ModelRunner

    calls = []
    fast = ModelRunner._accept_greedy
    monkeypatch.setattr(ModelRunner, "_accept_greedy", lambda self, *a: calls.append(1) or fast(self, *a))
    prompts = _prompts(6, 31)
    spec = LLM("tiny-k3", cache_memory_gb=0.02, speculative_algorithm="ngram", speculative_num_steps=3)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)]
    assert calls
    calls.clear()
    monkeypatch.setattr(ModelRunner, "_accept_greedy", lambda self, *a: calls.append(1) or None)  # must not run
    with_lp = spec.generate(prompts, GREEDY.clone(logprobs=0))
    assert not calls
    assert [o.outputs[0].token_ids for o in with_lp] == got
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in with_lp)


def test_penalised_greedy_with_speculation_equals_without() -> None:
    """Greedy rows with a frequency penalty take the sampler path under speculation: each window position counts
    the output tokens plus the drafts before it (a view, not a copy), so the tokens equal those of plain decoding."""
    prompts = _prompts(6, 41)
    params = GREEDY.clone(frequency_penalty=0.7, max_tokens=16)
    plain = LLM("tiny-k3", cache_memory_gb=0.02)
    spec = LLM("tiny-k3", cache_memory_gb=0.02, speculative_algorithm="ngram", speculative_num_steps=3)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_spec_steps for o in outs) > 0


def _staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, every: int = 3) -> list[list[int]]:
    """Greedy tokens of `prompts` added one every `every` engine steps (later prompts prefill while earlier ones
    decode), in prompt order."""
    engine, out, step = llm.engine, {}, 0
    pending = list(enumerate(prompts))
    while pending or engine.has_work:
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return [out.get(f"r{i}", []) for i in range(len(prompts))]


@pytest.mark.parametrize("model", ["tiny-k3", "tiny-kimi-linear"])
def test_prompt_chunks_beside_verify_windows_equal_plain(model: str, monkeypatch) -> None:
    """Prompts that arrive while others are speculating prefill in chunks beside verify windows (the KDA layers
    commit those chunks in the forward, `ReplayInputs.committed`): the greedy tokens equal plain decoding's, and such
    mixed verify steps did run."""
    from tokenspeed.executor.runner import ModelRunner

    mixed = []
    build = ModelRunner._build

    def spy(self, reqs, tokens, verify, prompt_rows=()):
        if verify and prompt_rows:
            mixed.append(max(len(tokens[i]) for i in prompt_rows))
        return build(self, reqs, tokens, verify, prompt_rows)
    monkeypatch.setattr(ModelRunner, "_build", spy)
    rng = random.Random(7)
    prompts = [(p * 8)[: rng.randint(30, 70)] for p in _prompts(6, 13)]
    params = GREEDY.clone(max_tokens=14)
    opts = {"cache_memory_gb": 0.02, "page_size": 8, "chunked_prefill_size": 16, "max_num_batched_tokens": 32}
    expected = _staggered(LLM(model, **opts), prompts, params)
    spec = LLM(model, speculative_algorithm="ngram", speculative_num_steps=3, **opts)
    assert _staggered(spec, prompts, params) == expected
    assert mixed and max(mixed) > 1
    spec.engine.cache.check_integrity()
