"""The scheduler on its own (no model): token counts and page ids only.

Scenarios: a step gives running requests their tokens in order (a decode one, a prompt min(uncomputed, chunk,
budget)) and then admits waiting requests FCFS; a chunk that passes the last page boundary of the known tokens
ends on it; `max_num_seqs` bounds the running set; with `prefill_chunk_beside_decodes` a prompt's chunk is capped
in a step where another request decodes and not otherwise; when pages run out the most recently admitted request
is preempted and goes back to the front of the queue, keeping its tokens.
"""

from __future__ import annotations

from tokenspeed import SamplingParams
from tokenspeed.cache import CacheManager, CachePlan
from tokenspeed.config import SchedulerConfig
from tokenspeed.core.request import Request
from tokenspeed.scheduler.scheduler import Scheduler

PAGE = 4


def _scheduler(pages: int = 64, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("chunked_prefill_size", 16)
    plan = CachePlan(num_pages=pages, page_size=PAGE, num_slots=2 * config.get("max_num_seqs", 64) + 8)
    return Scheduler(SchedulerConfig(**config), CacheManager(plan))


def _request(rid: str, prompt_len: int) -> Request:
    prompt = [(hash(rid) + i) % 1000 + 3 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))


def _step(s: Scheduler) -> list[tuple[str, int]]:
    """One step as the engine runs it, with a sampled token of 7 for each request that reaches its last known
    token; returns (request id, new tokens) per scheduled request, in order."""
    batch = s.schedule()
    for sr in batch.requests:
        req = sr.request
        req.num_computed_tokens += sr.num_new_tokens
        s.cache.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
        if sr.sample:
            req.append_output(7)
    return [(sr.request.request_id, sr.num_new_tokens) for sr in batch.requests]


def test_running_first_then_waiting_fcfs_within_the_budget() -> None:
    s = _scheduler()  # budget 32, chunk 16, page 4
    for rid, n in (("a", 40), ("b", 10), ("c", 6)):
        s.add(_request(rid, n))
    # a: one chunk; b: 10 cut to its last page boundary, 8; c: 6 of the 8 left, cut to 4
    assert _step(s) == [("a", 16), ("b", 8), ("c", 4)]
    assert _step(s) == [("a", 16), ("b", 2), ("c", 2)]  # running ones in admission order; b and c sample
    assert _step(s) == [("a", 8), ("b", 1), ("c", 1)]  # decodes take one token
    assert _step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_a_chunk_ends_on_the_last_page_boundary_it_passes() -> None:
    s = _scheduler(chunked_prefill_size=16, max_num_batched_tokens=30)
    s.add(_request("a", 18))  # last boundary 16
    s.add(_request("b", 18))
    assert _step(s) == [("a", 16), ("b", 14)]  # b: what the budget leaves, short of the boundary: not cut
    assert _step(s) == [("a", 2), ("b", 2)]  # b: 14 -> 18 passes 16: ends there (a checkpoint can be taken)
    assert _step(s) == [("a", 1), ("b", 2)]


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = _scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add(_request(rid, 3))
    assert _step(s) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_prefill_chunk_beside_decodes_caps_only_beside_decodes() -> None:
    s = _scheduler(prefill_chunk_beside_decodes=4)
    s.add(_request("a", 40))
    assert _step(s) == [("a", 16)]  # nothing decodes: the full chunk
    s.add(_request("b", 3))
    assert _step(s) == [("a", 16), ("b", 3)]  # b is a prompt in this step: nothing decodes yet
    s.add(_request("c", 30))
    assert _step(s) == [("a", 4), ("b", 1), ("c", 4)]  # b decodes: both prompts capped at 4
    assert _step(s) == [("a", 4), ("b", 1), ("c", 4)]


def test_out_of_pages_preempts_the_latest_admitted_to_the_front_of_the_queue() -> None:
    s = _scheduler(pages=6, max_num_batched_tokens=64, chunked_prefill_size=64)
    s.add(_request("a", 12))  # 3 pages each: the pool is full
    s.add(_request("b", 12))
    assert _step(s) == [("a", 12), ("b", 12)]
    # a's decode needs a fourth page: b, admitted last, is preempted in the same step, keeping its sampled token
    assert _step(s) == [("a", 1)]
    (b,) = s.waiting
    assert b.request_id == "b" and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert b.stats.num_preemptions == 1 and [r.request_id for r in s.running] == ["a"]
    s.cache.check_integrity()
