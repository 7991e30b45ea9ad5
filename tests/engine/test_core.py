"""The engine core's slow-step warning: a step slower than TOKENSPEED_SLOW_STEP_S is logged with the shape of its
batch (and, with asynchronous scheduling, of the step read back in it), so a stall in serving names its batch; and
prompts in the engine process's wire form (an int64 array) behave as lists."""

from __future__ import annotations

import logging

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.core.sampling_params import RequestError
from tokenspeed.engine import core
from tokenspeed.engine.process import prompt_array, prompt_bytes


def test_slow_steps_are_logged_with_their_shape(monkeypatch, caplog) -> None:
    """With a limit of 0 s every step is slow: the prefill of two prompts and the decodes are named. With the
    default limit a tiny model's steps are not logged."""
    llm = LLM("tiny-k3", cache_memory_gb=0.02, page_size=8, async_scheduling="on")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger=core.__name__):
        llm.generate([[5, 6, 7], [8, 9]], params)
    assert not [r for r in caplog.records if "slow step" in r.getMessage()]
    monkeypatch.setenv(core.SLOW_STEP_ENV, "0")
    with caplog.at_level(logging.WARNING, logger=core.__name__):
        llm.generate([[5, 6, 7], [8, 9]], params)
    msgs = [r.getMessage() for r in caplog.records if "slow step" in r.getMessage()]
    assert any("new tokens [3, 2]" in m for m in msgs), msgs
    assert any("new tokens 2 x 1" in m for m in msgs), msgs
    assert any("read back the step of" in m for m in msgs), msgs  # async: the step waited on is named too



def test_prompt_ids_as_the_engine_process_receives_them() -> None:
    """The engine process hands `add_request` the prompt as an int64 array over the message bytes
    (`process.prompt_bytes` / `prompt_array`): the same greedy tokens as a list, and out-of-vocabulary ids are
    refused with the ids named."""
    llm = LLM("tiny-k3", cache_memory_gb=0.02)
    engine, params = llm.engine, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 300, 42, 9, 61]
    out: dict[str, list[int]] = {}
    engine.add_request("list", prompt, params)
    engine.add_request("array", prompt_array(prompt_bytes(prompt)), params)
    while engine.has_work:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out["array"] == out["list"] and len(out["list"]) == 5
    with pytest.raises(RequestError, match=r"\[-1, 99999999\]"):
        engine.add_request("bad", prompt_array(prompt_bytes([3, -1, 4, 99999999])), params)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", prompt_array(b""), params)
