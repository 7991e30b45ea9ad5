"""Sampler: greedy, seeded and filtered sampling, penalties, min_tokens, raw logprobs and prompt logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.executor.sampler import (
    SamplerInput,
    apply_penalties,
    make_generator,
    prompt_logprobs,
    prompt_logprobs_chunk,
    sample,
    sample_filtered,
)


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    generator: torch.Generator | None = None,
    eos: Sequence[int] = (),
) -> SamplerInput:
    return SamplerInput(params, list(prompt), list(output), generator, list(eos))


def grid_counts(logits: torch.Tensor, params: SamplingParams, draws: int = 1000) -> torch.Tensor:
    """Token counts of sample_filtered over `draws` evenly spaced uniforms: exactly draws * p per token (+-1)."""
    rows = logits[None, :].expand(draws, -1)
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    ids = sample_filtered(rows, [params] * draws, uniforms)
    return torch.bincount(ids, minlength=logits.shape[0])


def test_greedy_is_argmax_and_ignores_filters() -> None:
    logits = torch.randn(6, 50)
    logits[5, [7, 3, 30]] = 100.0  # a tie: the lowest id wins
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.01, min_p=0.9)
    out = sample(logits, [row(params)] * 6)
    expected = logits.argmax(-1).tolist()
    assert out.token_ids == expected and expected[5] == 3
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(8, 40)
    logits[0, [9, 2]] = 50.0
    assert SamplingParams(top_k=1, temperature=1.3).greedy
    assert sample(logits, [row(SamplingParams(top_k=1, temperature=1.3))] * 8).token_ids == logits.argmax(-1).tolist()
    # The filtered path with k = 1 agrees too, whatever the uniform (ties to the lower id as argmax).
    params = [SamplingParams(top_k=1, temperature=1.3, top_p=0.9)] * 8
    ids = sample_filtered(logits, params, torch.rand(8, dtype=torch.float64))
    assert ids.tolist() == logits.argmax(-1).tolist()


def _run_steps(seed_row_at: int, others: int, steps: list[torch.Tensor], seed: int) -> list[int]:
    """Sample the seeded request over `steps` (its logits per step) placed at row `seed_row_at` among other rows."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    generator = make_generator(seed)
    tokens: list[int] = []
    other_gen = make_generator(999)
    for step, target in enumerate(steps):
        batch = torch.randn(others + 1, target.shape[0]) * 3  # fresh noise for the other rows
        batch[seed_row_at] = target
        rows = [row(SamplingParams(temperature=1.0 + 0.1 * i), output=[1] * step) for i in range(others + 1)]
        if others >= 2:  # a greedy row and another seeded request share the batch
            rows[(seed_row_at + 1) % len(rows)] = row(SamplingParams(temperature=0.0))
            rows[(seed_row_at + 2) % len(rows)] = row(SamplingParams(seed=999), generator=other_gen)
        rows[seed_row_at] = row(params, prompt=[0, 1], output=tokens, generator=generator)
        tokens.append(sample(batch, rows).token_ids[seed_row_at])
    return tokens


def test_seeded_sampling_reproducible_and_independent_of_batch() -> None:
    steps = [torch.randn(64, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    alone = _run_steps(0, 0, steps, seed=1234)
    torch.manual_seed(77)  # the global stream must not matter either
    assert _run_steps(0, 0, steps, seed=1234) == alone
    assert _run_steps(3, 5, steps, seed=1234) == alone
    assert _run_steps(0, 9, steps, seed=1234) == alone
    assert _run_steps(2, 2, steps, seed=1234) == alone
    assert _run_steps(0, 0, steps, seed=4321) != alone
    assert len(set(alone)) > 1


def test_unseeded_rows_use_global_generator() -> None:
    logits = torch.zeros(16, 100)
    rows = [row(SamplingParams())] * 16
    torch.manual_seed(5)
    first = sample(logits, rows).token_ids
    torch.manual_seed(5)
    assert sample(logits, rows).token_ids == first
    assert len(set(first)) > 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    draws = 20000
    rows = [row(SamplingParams(temperature=temperature))] * draws
    ids = torch.tensor(sample(logits.expand(draws, -1), rows).token_ids)
    observed = torch.bincount(ids, minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, -1) * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0, (chi2, observed.tolist(), expected.tolist())  # 4 dof: p(chi2 > 25) ~ 5e-5


def test_tiny_temperature_is_argmax_without_nan() -> None:
    logits = torch.randn(4, 30) * 10
    out = sample(logits, [row(SamplingParams(temperature=1e-30))] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_k_largest_renormalised() -> None:
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    counts = grid_counts(logits, SamplingParams(top_k=2))
    expected = torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]) * 1000
    assert (counts - expected).abs().max() <= 1, counts


def test_top_p_keeps_smallest_prefix() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    counts = grid_counts(logits, SamplingParams(top_p=0.75))  # 0.5 + 0.3 >= 0.75
    assert (counts - torch.tensor([0, 625, 0, 375])).abs().max() <= 1, counts
    counts = grid_counts(logits, SamplingParams(top_p=0.85))  # needs 0.15 too
    assert (counts - torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95 * 1000).abs().max() <= 1, counts
    assert grid_counts(logits, SamplingParams(top_p=1.0)).min() > 0


def test_top_p_tiny_keeps_only_argmax() -> None:
    logits = torch.randn(200, 10)
    ids = sample(logits, [row(SamplingParams(top_p=1e-6))] * 200).token_ids
    assert ids == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    counts = grid_counts(logits, SamplingParams(min_p=0.25))  # threshold 0.125: drops 0.05
    assert (counts - torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95 * 1000).abs().max() <= 1, counts
    counts = grid_counts(logits, SamplingParams(min_p=0.5))  # threshold 0.25
    assert (counts - torch.tensor([0, 625, 0, 375])).abs().max() <= 1, counts


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(logits, [row(params, prompt=[0, 0], output=[1, 4])])
    assert torch.equal(got, torch.tensor([[1.0, -2.0, 0.5, 3.0, -4.0]]))
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]))  # input untouched
    # The choice flips: token 0 was in the prompt and loses to token 1.
    flip = torch.tensor([[2.0, 1.5, 0.0]])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(flip, [row(greedy.clone(repetition_penalty=1.0), prompt=[0])]).token_ids == [0]
    assert sample(flip, [row(greedy, prompt=[0])]).token_ids == [1]


def test_frequency_and_presence_penalty_formula() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, [row(params, prompt=[1, 1, 3], output=[0, 0, 0, 2])])
    # prompt tokens are not penalised by frequency / presence; output: -(0.5 * count + 0.25)
    assert torch.allclose(got, torch.tensor([[1.0 - 1.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0]]), atol=0, rtol=1e-6)
    negative = apply_penalties(logits, [row(SamplingParams(frequency_penalty=-1.0), output=[2, 2])])
    assert torch.equal(negative, torch.tensor([[1.0, 1.0, 3.0, 1.0]]))
    flip = torch.tensor([[2.0, 1.8]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(flip, [row(greedy, output=[0])]).token_ids == [0]
    assert sample(flip, [row(greedy.clone(presence_penalty=0.3), output=[0])]).token_ids == [1]
    assert sample(flip, [row(greedy.clone(frequency_penalty=0.1), output=[0])]).token_ids == [0]
    assert sample(flip, [row(greedy.clone(frequency_penalty=0.1), output=[0, 0, 0])]).token_ids == [1]


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.randn(3, 8)
    rows = [
        row(SamplingParams(), output=[1, 2]),
        row(SamplingParams(repetition_penalty=1.5), output=[1]),
        row(SamplingParams()),
    ]
    got = apply_penalties(logits, rows)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])  # 3 = EOS, 4 = a stop token id
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    assert sample(logits, [row(params, output=[], eos=[3])]).token_ids == [2]
    assert sample(logits, [row(params, output=[1], eos=[3])]).token_ids == [2]
    assert sample(logits, [row(params, output=[1, 1], eos=[3])]).token_ids == [3]
    assert sample(logits, [row(params.clone(ignore_eos=True), eos=[3])]).token_ids == [3]  # EOS does not stop
    sampled = [row(params.clone(temperature=1.0), eos=[3])] * 500
    assert set(sample(logits.expand(500, -1), sampled).token_ids) <= {0, 1, 2}


def test_logit_bias_moves_the_choice_not_the_logprobs() -> None:
    """A +bias makes a token the greedy choice and -100 excludes one from sampling; only the biased rows change,
    the reported logprobs stay raw, the caller's logits are untouched, and such rows never take the on-device
    path (nor the plain-greedy argmax)."""
    from tokenspeed.executor.sampler import is_plain_greedy, samples_on_device

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0]])
    before = logits.clone()
    greedy = SamplingParams(temperature=0.0, logprobs=0, logit_bias={1: 10.0})
    out = sample(logits, [row(greedy), row(SamplingParams(temperature=0.0, logprobs=0))])
    assert out.token_ids == [1, 2] and torch.equal(logits, before)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([raw[0, 1].item(), raw[1, 2].item()], abs=1e-6)
    banned = SamplingParams(temperature=1.0, logit_bias={2: -100.0})
    draws = sample(logits[:1].expand(400, -1), [row(banned)] * 400).token_ids
    assert 2 not in draws and set(draws) <= {0, 1, 3}
    with_penalty = SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={1: 2.5}, min_tokens=1)
    assert sample(logits[:1], [row(with_penalty, output=[], eos=[2])]).token_ids == [1]  # EOS 2 masked, 1 biased
    assert sample(logits[:1], [row(with_penalty, output=[1], eos=[2])]).token_ids == [2]  # 1 - 2 (presence) + 2.5
    assert not samples_on_device(greedy) and not is_plain_greedy(greedy.clone(logprobs=None), 0)


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    logits = torch.randn(3, 32)
    logits[1] = 0.1 * logits[1]
    logits[1, 4], logits[1, 9] = 1.0, 0.5
    rows = [
        row(SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=5), prompt=[0, 1, 2], output=[3]),
        row(SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0), output=[4]),
        row(SamplingParams()),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert top[0][1] == pytest.approx(raw[0].max().item(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    assert out.token_ids[1] == 9  # the penalty moved the choice from 4; its logprob above is still the raw one


def test_prompt_logprobs_alignment() -> None:
    prompt = [5, 1, 7, 2]
    logits = torch.randn(4, 10)
    for t in range(1, 4):  # row t - 1 predicts prompt[t]
        logits[t - 1, prompt[t]] += 6.0
    got = prompt_logprobs(logits, prompt, top_n=2)
    raw = torch.log_softmax(logits, -1)
    assert len(got) == 4 and got[0] is None
    for t in range(1, 4):
        entry = got[t]
        assert entry is not None
        assert next(iter(entry)) == prompt[t]  # the actual token first
        assert entry[prompt[t]] == pytest.approx(raw[t - 1, prompt[t]].item(), abs=1e-6)
        assert entry[prompt[t]] == pytest.approx(raw[t - 1].max().item(), abs=1e-6)  # it is the top-1 here
        assert len(entry) == 2  # top-2 includes the actual token
        top = raw[t - 1].topk(2)
        assert list(entry) == top.indices.tolist()
        assert list(entry.values()) == pytest.approx(top.values.tolist(), abs=1e-6)


def test_prompt_logprobs_actual_token_outside_top_n_and_edges() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    got = prompt_logprobs(logits, [0, 3], top_n=1)
    raw = torch.log_softmax(logits[0], -1)
    assert got[1] == pytest.approx({3: raw[3].item(), 0: raw[0].item()})
    assert list(got[1]) == [3, 0]
    assert prompt_logprobs(logits[:1], [4], top_n=3) == [None]
    with pytest.raises(ValueError, match="prompt tokens"):
        prompt_logprobs(logits, [0, 1, 2], top_n=1)


def test_prompt_logprobs_chunks_concatenate_to_whole() -> None:
    prompt = [3, 8, 1, 1, 6, 0, 9]
    logits = torch.randn(len(prompt), 12)
    whole = prompt_logprobs(logits, prompt, top_n=3)
    chunks: list = [None]
    for start, stop in [(0, 3), (3, 4), (4, 7)]:
        chunks += prompt_logprobs_chunk(logits[start:stop], prompt, start, top_n=3)
    assert chunks == whole
    assert prompt_logprobs_chunk(logits[6:], prompt, 6, top_n=3) == []  # the last row predicts past the prompt


def test_input_errors() -> None:
    with pytest.raises(ValueError, match="B = 2"):
        sample(torch.zeros(3, 5), [row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        sample(torch.zeros(1, 5), [row(SamplingParams(repetition_penalty=1.2), output=[5])])
