"""A step whose forward runs out of device memory ends only its own requests (every running request is in each
step, so: those running then): they finish with finish_reason "error" and a message saying what to change, the
tokens they had are the right ones, their pages and KDA slots go back to the pool, and the engine goes on serving:
a request arriving after the failure gets the same greedy tokens as in a clean run. Both schedules: synchronous,
and asynchronous (the failure hits step N+1's launch while step N is in flight, whose tokens are delivered
first). Without the handling the error ends the engine (the whole server)."""

from __future__ import annotations

import os

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
    while engine.has_work or step <= max(events):
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


def _fill_device() -> list[torch.Tensor]:
    """Tensors taking every byte torch's allocator can still get on the current device (down to 64 KB blocks)."""
    hog: list[torch.Tensor] = []
    for size in (1 << 30, 1 << 26, 1 << 20, 1 << 16):
        while True:
            try:
                hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    return hog


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_out_of_memory_on_the_gpu() -> None:
    """On the GPU, with the device filled by other tensors, a prompt's step really runs out of memory: the request
    ends with the error, and once the memory is back the engine serves the same prompt with the tokens it gave
    before. Not under pytest-xdist: it fills the whole device (benchmarks/gpu_tests_h200.sh runs it alone)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("fills the whole device: run without xdist workers")
    engine = LLM("tiny-k3", device="cuda", dtype="float32", max_num_seqs=4, num_pages=1024, enforce_eager=True,
                 enable_prefix_caching=False).engine
    prompt = list(range(3, 300))
    before = _run_one(engine, "warm", prompt)  # compiles this shape's kernels while there is memory
    hog = _fill_device()
    try:
        failed = _run_one(engine, "big", prompt)
    finally:
        del hog
        torch.cuda.empty_cache()
    assert failed[1] == "error" and "out of device memory" in failed[2]
    assert _run_one(engine, "after", prompt) == before
    assert engine.cache.usage == 0.0 and not engine.requests


def _run_one(engine, rid: str, prompt: list[int]) -> tuple[list[int], str | None, str | None]:
    engine.add_request(rid, prompt, GREEDY)
    tokens, reason, error = [], None, None
    while engine.has_work:
        for o in engine.step():
            tokens += o.new_token_ids
            reason, error = o.finish_reason, o.error
    return tokens, reason, error
