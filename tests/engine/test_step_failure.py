"""A step whose forward runs out of device memory ends only its own requests (every running request is in each
step, so: those running then): they finish with finish_reason "error" and a message saying what to change, the
tokens they had are the right ones, their pages and KDA slots go back to the pool, and the engine goes on serving:
a request arriving after the failure gets the same greedy tokens as in a clean run. Both schedules: synchronous,
and asynchronous (the failure hits step N+1's launch while step N is in flight, whose tokens are delivered
first). Without the handling the error ends the engine (the whole server)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = {"early": [5, 6, 7, 8], "big": list(range(3, 40)), "late": [9, 10, 11]}


def _engine(async_scheduling: str):
    return LLM("tiny-k3", cache_memory_gb=0.02, page_size=8, async_scheduling=async_scheduling).engine


def _run(engine, events: dict[int, str]) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Step the engine, adding PROMPTS[name] at step events[step]; returns each request's (tokens, finish reason,
    error message)."""
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    step = 0
    while step in events or engine.has_work or step <= max(events):
        if step in events:
            engine.add_request(events[step], PROMPTS[events[step]], GREEDY)
        for o in engine.step():
            tokens, _, _ = out.get(o.request_id, ([], None, None))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason, o.error)
        step += 1
        assert step < 200
    return out


def _fail_steps_with(engine, victim: str, monkeypatch) -> list[list[str]]:
    """Make every runner call whose batch holds `victim` raise torch.OutOfMemoryError (before any work); returns
    the failed batches' request ids."""
    failed: list[list[str]] = []
    for name in ("execute", "launch"):
        real = getattr(engine.runner, name)

        def fake(batch, *args, _real=real):
            ids = [r.request.request_id for r in batch.requests]
            if victim in ids:
                failed.append(ids)
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
            return _real(batch, *args)

        monkeypatch.setattr(engine.runner, name, fake)
    return failed


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_out_of_memory_ends_only_that_steps_requests(async_scheduling: str, monkeypatch) -> None:
    events = {0: "early", 3: "big", 4: "late"}
    clean = _run(_engine(async_scheduling), events)
    engine = _engine(async_scheduling)
    failed = _fail_steps_with(engine, "big", monkeypatch)
    got = _run(engine, events)
    assert len(failed) == 1 and "big" in failed[0]
    for rid in failed[0]:  # the failed step's requests: an error, with the fix named
        tokens, reason, error = got[rid]
        assert reason == "error" and "out of device memory" in error and "--chunked-prefill-size" in error
        assert tokens == clean[rid][0][: len(tokens)]  # what they had before the failure was right
    for rid in set(PROMPTS) - set(failed[0]):  # everyone else: as if nothing happened
        assert got[rid][1] == "length" and got[rid][0] == clean[rid][0], rid
    assert "late" not in failed[0] and not engine.has_work
    assert engine.cache.usage == 0.0 and engine.num_running == 0  # every page and slot back in the pool
    assert not engine.requests
