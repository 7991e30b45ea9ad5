"""SamplingParams: vLLM defaults, normalisation, and a RequestError naming the field for every bad value."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tokenspeed.core.sampling_params import RequestError, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, -1, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ([], [], False)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy


@pytest.mark.parametrize(
    "changes, field, allowed",
    [
        ({"n": 0}, "n", ">= 1"),
        ({"n": 1.5}, "n", "integer"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", "between 0 and max_tokens"),
        ({"min_tokens": 17}, "min_tokens", "between 0 and max_tokens (16)"),
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": math.nan}, "temperature", "finite"),
        ({"temperature": True}, "temperature", "finite number"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.01}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-1 or 0 (disabled) or >= 1"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": -2.01}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": math.inf}, "frequency_penalty", "finite"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
        ({"logprobs": -1}, "logprobs", "between 0 and 20"),
        ({"logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "between 0 and 20"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "between 0 and 20"),
        ({"seed": 2**64}, "seed", "2**64"),
        ({"seed": "7"}, "seed", "integer"),
        ({"stop": ""}, "stop", "non-empty"),
        ({"stop": 5}, "stop", "string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
        ({"stop_token_ids": 3}, "stop_token_ids", "list"),
        ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
        ({"logit_bias": {5: 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", ">= 0"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "integer"),
        ({"logit_bias": {5: math.nan}}, "logit_bias", "finite"),
        ({"logit_bias": [5, 1.0]}, "logit_bias", "map of token id"),
    ],
)
def test_invalid_field_raises_request_error_naming_field(changes: dict, field: str, allowed: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**changes)
    message = str(info.value)
    assert message.startswith(field + " "), message
    assert allowed in message, message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 4, "min_tokens": 4},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"logit_bias": {0: -100, 7: 100.0}},
        {"logit_bias": {}},
    ],
)
def test_boundary_values_are_accepted(changes: dict) -> None:
    SamplingParams(**changes)


def test_stop_token_ids_checked_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=[0, 99])
    p.validate(vocab_size=100)
    p.validate()
    with pytest.raises(RequestError, match=r"^stop_token_ids .*\[0, 100\)"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)


def test_logit_bias_checked_against_vocab_and_copied() -> None:
    bias = {3: 1.0, 99: -2.0}
    p = SamplingParams(logit_bias=bias)
    p.validate(vocab_size=100)
    bias[5] = 1.0
    assert p.logit_bias == {3: 1.0, 99: -2.0}  # a copy, not the caller's dict
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(RequestError, match=r"^logit_bias .*\[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).validate(vocab_size=100)


def test_stop_normalised_to_fresh_lists() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    stops = ["x"]
    p = SamplingParams(stop=stops)
    stops.append("y")
    assert p.stop == ["x"]


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert not SamplingParams(top_k=2).greedy
    assert not SamplingParams(top_k=0).top_k_enabled and not SamplingParams(top_k=-1).top_k_enabled


def test_clone_changes_copy_and_validates() -> None:
    p = SamplingParams(temperature=0.5, stop="a")
    q = p.clone(temperature=0.0, stop="b")
    assert (q.temperature, q.stop, q.greedy) == (0.0, ["b"], True)
    assert (p.temperature, p.stop) == (0.5, ["a"])
    with pytest.raises(RequestError, match="^top_p"):
        p.clone(top_p=2.0)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0  # type: ignore[misc]
