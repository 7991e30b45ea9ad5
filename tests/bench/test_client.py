"""The streaming client and the session runner against the in-process mock OpenAI server."""

from __future__ import annotations

import asyncio

import pytest

from tokenspeed.bench import runner
from tokenspeed.bench.client import completion_payload, make_client, stream_completion
from tokenspeed.bench.metrics import summarize
from tokenspeed.bench.mock_server import MockConfig, MockServer
from tokenspeed.bench.session import ClientConfig, LiveHistoryError
from tokenspeed.bench.workloads import build
from tokenspeed.bench.workloads.dists import LogNormal
from tokenspeed.bench.workloads.synth import TokenSynth
from tokenspeed.bench.workloads.trace import BlockAllocator, Conversation, Session, Spawn, make_turn


def _one(url: str, prompt: list[int], n: int, timeout: float = 30.0, **kw):
    async def go():
        async with make_client() as client:
            body = completion_payload("mock", prompt, n, **kw)
            return await stream_completion(client, f"{url}/v1/completions", body, timeout)

    return asyncio.run(go())


def test_stream_usage_and_cached_tokens():
    with MockServer(MockConfig(step_s=0.001, tokens_per_step=3)) as url:
        p1 = list(range(16, 216))  # 200 tokens
        a = _one(url, p1, 7, token_ids=True)
        assert a.ok and a.prompt_tokens == 200 and a.output_tokens == 7 and a.cached_tokens == 0
        assert a.chunk_tokens == (3, 3, 1) and len(a.output_ids) == 7
        assert a.ttft > 0 and a.e2el >= a.ttft
        b = _one(url, p1 + list(a.output_ids) + [20] * 100, 2)  # 307 tokens: prompt 1 + output are cached
        # without token ids a chunk counts as one token (the usage still says 2)
        assert b.ok and b.cached_tokens == 192 and b.output_ids is None and b.chunk_tokens == (1,)
        assert b.output_tokens == 2


def test_tokens_without_text():
    """A server that drops chunks whose tokens decode to no text: the final chunk still times the request."""
    with MockServer(MockConfig(step_s=0.001, text_chunks=False)) as url:
        a = _one(url, [20] * 10, 5)
        assert a.ok and a.chunk_tokens == (1,) and a.output_tokens == 5 and a.ttft == a.e2el
        b = _one(url, [20] * 10, 5, token_ids=True)
        assert b.ok and b.chunk_tokens == (1, 1, 1, 1, 1)


def test_errors_overflow_timeout():
    with MockServer(MockConfig(step_s=0.001, max_model_len=100)) as url:
        over = _one(url, [20] * 99, 5)
        assert not over.ok and over.overflow and over.status == 400 and "maximum context length" in over.error
        assert _one(url, [20] * 10, 5).ok
    with MockServer(MockConfig(step_s=0.5)) as url:
        slow = _one(url, [20] * 10, 5, timeout=0.3)
        assert not slow.ok and not slow.overflow and slow.error.startswith("timeout")
    with MockServer(MockConfig(fail_every=1)) as url:
        bad = _one(url, [20] * 10, 5)
        assert not bad.ok and bad.status == 500 and not bad.overflow
    bad = _one("http://127.0.0.1:9", [20], 1)  # nothing listens on the discard port
    assert not bad.ok and bad.status == 0 and bad.error


def _run(url: str, spec: runner.RunSpec, history: str = "replay", timeout: float = 30.0) -> runner.RunResult:
    async def go():
        async with make_client() as client:
            cfg = ClientConfig(url, "mock", TokenSynth(), history=history, request_timeout_s=timeout)
            return await runner.run(client, cfg, spec)

    return asyncio.run(go())


@pytest.mark.parametrize("history", ["replay", "live"])
def test_count_bounded_run_matches_ideal(history):
    tr = build("swe-smith-like", scale=0.01)
    measured, warm = runner.split_sessions(tr.sessions, 6, 68, 2)
    spec = runner.RunSpec(3, measured, warmup="sessions", warmup_sessions=warm, progress=False)
    server = MockServer(MockConfig(step_s=0.0005))
    with server as url:
        res = _run(url, spec, history)
    scored = res.scored()
    assert len(scored) == sum(s.num_requests() for s in measured)
    assert sum(r.phase == "warmup" for r in res.records) == sum(s.num_requests() for s in warm)
    assert {(r.session, r.turn) for r in scored} == {(s.session_id, k) for s in measured
                                                     for k in range(len(s.root.turns))}
    s = summarize(res.records, peak_inflight=res.peak_inflight, server_hit_metrics=res.server_hit_metrics)
    assert s.completed == s.requests and s.prompt_len_mismatches == 0 and s.output_len_mismatches == 0
    assert s.server_cache_hit == pytest.approx(s.ideal_cache_hit, abs=0.01)
    assert s.server_cache_hit_metrics == pytest.approx(s.server_cache_hit, abs=0.01)
    assert 1 <= res.peak_inflight <= 3 and server.max_running <= 3
    for sess in measured:  # each conversation's turns went out in order, one at a time
        rs = sorted((r for r in scored if r.session == sess.session_id), key=lambda r: r.turn)
        assert all(b.start_s >= a.end_s for a, b in zip(rs, rs[1:]))


def test_live_history_needs_token_ids():
    tr = build("swe-smith-like", scale=0.005, num_sessions=1)
    with MockServer(MockConfig(step_s=0.0005, token_ids=False)) as url:
        with pytest.raises(LiveHistoryError):
            _run(url, runner.RunSpec(1, tr.sessions, progress=False), "live")


def _tree_session() -> Session:
    """Root turn 0 starts a sidecar when sent and 2 blocking subagents (staggered) when it ends; turn 1 joins them;
    turn 1 also spawns a background subagent that turn 2 does not wait for."""
    a = BlockAllocator()

    def sub() -> Conversation:
        return Conversation((make_turn(a, 64, 3, kind="subagent"), make_turn(a, 64, 3, kind="subagent", delay_ms=50.0)),
                            "subagent")

    side = Conversation((make_turn(a, 64, 2, kind="sidecar"),), "sidecar")
    root = Conversation((
        make_turn(a, 128, 3, spawns=(Spawn(1, False, False), Spawn(2, True, True, 0.0), Spawn(3, True, True, 80.0))),
        make_turn(a, 64, 3, spawns=(Spawn(4, True, False, 0.0),)),
        make_turn(a, 64, 3)))
    return Session(0, (root, side, sub(), sub(), sub()))


def test_spawns_joins_and_sidecars():
    s = _tree_session()
    with MockServer(MockConfig(step_s=0.01)) as url:
        res = _run(url, runner.RunSpec(1, (s,), progress=False))
    r = {(x.conv, x.turn): x for x in res.scored()}
    assert len(r) == 1 + 3 + 2 + 2 + 2
    root0, root1, root2 = r[(0, 0)], r[(0, 1)], r[(0, 2)]
    assert r[(1, 0)].kind == "sidecar" and r[(1, 0)].start_s < root0.end_s  # sent with the root turn
    assert r[(2, 0)].start_s >= root0.end_s and r[(3, 0)].start_s >= root0.end_s + 0.08  # staggered
    assert root1.start_s >= max(r[(2, 1)].end_s, r[(3, 1)].end_s)  # blocking join
    assert r[(4, 0)].start_s >= root1.end_s and root2.start_s < r[(4, 1)].end_s  # background: no join
    assert r[(2, 1)].start_s >= r[(2, 0)].end_s + 0.05  # the subagent's own delay
    assert r[(2, 0)].ideal_cached == 0 and root1.ideal_cached == 128  # replay: prompt 1 cached, not its output


def test_mid_session_warmup_and_window():
    fast = LogNormal(0.005, 0.01)
    tr = build("agentx-like", scale=0.01, num_sessions=4, tool_delay_s=fast, human_delay_s=fast, sub_delay_s=fast)
    spec = runner.RunSpec(2, tr.sessions, duration_s=1.0, grace_s=5.0, warmup="mid-session", warmup_requests=2,
                          progress=False)
    with MockServer(MockConfig(step_s=0.002)) as url:
        res = _run(url, spec)
    warm = [r for r in res.records if r.phase == "warmup"]
    assert len(warm) == 2 * 3 and [r.max_tokens for r in warm].count(1) >= 4  # warmed turn + 2 one-token requests
    scored = res.scored()
    assert len(scored) >= 4 and all(r.ok for r in scored)
    assert all(res.window_start_s <= r.start_s < res.window_end_s for r in scored)  # nothing starts after it
    warmed = {r.lane: r.turn for r in warm}
    for lane in (0, 1):
        first = min((r for r in scored if r.lane == lane and r.conv == 0), key=lambda r: r.start_s)
        assert first.epoch == 0 and first.turn == warmed[lane] + 1  # resumes right after its warmed turn
        assert first.cached_tokens == first.ideal_cached > 0  # its history is warm


def test_drain_grace_cancels_and_counts():
    a = BlockAllocator()
    s = Session(0, (Conversation((make_turn(a, 64, 200), make_turn(a, 64, 2))),))
    spec = runner.RunSpec(2, (s,), duration_s=0.2, grace_s=0.1, progress=False)
    with MockServer(MockConfig(step_s=0.02)) as url:
        res = _run(url, spec)
    scored = res.scored()
    assert len(scored) == 2 and {r.epoch for r in scored} == {0, 1}  # lane 2 recycles the pool with a new salt
    assert all(r.error == "cancelled (drain)" and not r.ok for r in scored)
    assert summarize(res.records).errors == 2


def test_many_concurrent_streams_one_pool():
    """150 streams of 2 s each (40 tokens, 50 ms apart) through one connection pool all overlap."""
    tr = build("random", scale=0.1, num_sessions=150, input_len=640, output_len=400)
    server = MockServer(MockConfig(step_s=0.05))
    with server as url:
        res = _run(url, runner.RunSpec(150, tr.sessions, progress=False))
    s = summarize(res.records, peak_inflight=res.peak_inflight)
    assert s.completed == 150 and s.output_tokens == 150 * 40
    assert res.peak_inflight == 150 and server.max_running >= 50  # (server-side overlap shrinks on a busy CPU)
