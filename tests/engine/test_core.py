"""The engine core's slow-step warning: a step slower than TOKENSPEED_SLOW_STEP_S is logged with the shape of its
batch (and, with asynchronous scheduling, of the step read back in it), so a stall in serving names its batch."""

from __future__ import annotations

import logging

from tokenspeed import LLM, SamplingParams
from tokenspeed.engine import core


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

