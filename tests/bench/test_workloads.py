"""Generators match workloads.md: swe-smith-like shape, agentx-like statistics over 1,000 sessions, scale, seeds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tokenspeed.bench.workloads import build, describe, ideal_hit, prompt_lengths
from tokenspeed.bench.workloads.agentx import AgentXParams


# ----- swe-smith-like ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_swe_smith_shape(scale):
    tr = build("swe-smith-like", scale=scale)
    assert len(tr.sessions) == 128 and tr.seed == 42
    turns = [len(s.root.turns) for s in tr.sessions]
    assert min(turns) >= 10 and max(turns) <= 15 and set(turns) == set(range(10, 16))
    first, delta, out = round(50_000 * scale), round(800 * scale), round(500 * scale)
    for s in tr.sessions:
        t = s.root.turns
        assert t[0].input_len == first and all(x.input_len == delta for x in t[1:])
        assert all(x.output_len == out and x.delay_ms == 0.0 for x in t)
        assert prompt_lengths(s.root) == [first + k * (delta + out) for k in range(len(t))]
    if scale == 1.0:
        assert max(max(prompt_lengths(s.root)) for s in tr.sessions) == 68_200


def test_swe_smith_ideal_hit_near_spec():
    """workloads.md: ideal 0.908 (new tokens per turn = 800 + 500 counted as misses: replay semantics)."""
    tr = build("swe-smith-like")
    assert ideal_hit(tr, "replay").ratio() == pytest.approx(0.908, abs=0.005)
    assert ideal_hit(tr, "live").ratio() > ideal_hit(tr, "replay").ratio()


def test_swe_smith_deterministic_and_pool_independent():
    a, b = build("swe-smith-like", scale=0.01), build("swe-smith-like", scale=0.01)
    assert a.sessions == b.sessions
    small = build("swe-smith-like", scale=0.01, num_sessions=10)
    assert small.sessions == a.sessions[:10]
    assert build("swe-smith-like", scale=0.01, seed=7).sessions != a.sessions


def test_swe_smith_shared_prefix_and_var():
    tr = build("swe-smith-like", shared_prefix=2048)
    heads = {s.root.turns[0].blocks[0][:32] for s in tr.sessions}
    assert len(heads) == 1 and all(s.root.turns[0].shared_blocks == 32 for s in tr.sessions)
    assert ideal_hit(tr, "replay").ratio() > ideal_hit(build("swe-smith-like"), "replay").ratio()
    var = build("swe-smith-like", variant="var")
    outs = np.array([t.output_len for s in var.sessions for t in s.root.turns])
    delays = np.array([t.delay_ms for s in var.sessions for t in s.root.turns[1:]])
    assert outs.min() >= 16 and outs.max() <= 500 and abs(np.median(outs) - 250) < 25
    assert delays.max() <= 10_000 and abs(np.median(delays) - 1000) < 150
    assert all(s.root.turns[0].delay_ms == 0 for s in var.sessions)


def test_scale_multiplies_tokens_not_turns():
    a, b = build("agentx-like", scale=1.0, num_sessions=5), build("agentx-like", scale=0.1, num_sessions=5)
    roots = [[sum(t.kind == "root" for t in s.root.turns) for s in tr.sessions] for tr in (a, b)]
    assert roots[0] == roots[1]
    for sa, sb in zip(a.sessions, b.sessions):
        assert sb.root.turns[0].input_len == pytest.approx(0.1 * sa.root.turns[0].input_len, abs=2)


# ----- agentx-like over 1,000 sessions -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def agentx():
    return build("agentx-like", num_sessions=1000)


def _root_turns(tr):
    return [t for s in tr.sessions for t in s.root.turns if t.kind == "root"]


def test_agentx_spawn_rate_fanout_blocking(agentx):
    roots = _root_turns(agentx)
    events = [[sp for sp in t.spawns if sp.at_end] for t in roots]
    events = [e for e in events if e]
    assert len(events) / len(roots) == pytest.approx(0.04, abs=0.004)
    assert len(events) / len(agentx.sessions) == pytest.approx(5.6, rel=0.15)  # "about 6 spawns per session"
    fan = Counter(len(e) for e in events)
    for k, p in zip(range(1, 6), (0.50, 0.20, 0.15, 0.10, 0.05)):
        assert fan[k] / len(events) == pytest.approx(p, abs=0.025), (k, fan)
    blocking = [e[0].blocking for e in events]
    assert all(len({sp.blocking for sp in e}) == 1 for e in events)  # one decision per spawn event
    assert np.mean(blocking) == pytest.approx(0.8, abs=0.03)
    offsets = [sp.offset_ms for e in events for sp in e]
    assert min(offsets) >= 0 and max(offsets) <= 2000 and np.mean(offsets) == pytest.approx(1000, rel=0.05)
    sidecars = sum(1 for t in roots for sp in t.spawns if not sp.at_end)
    assert sidecars / len(roots) == pytest.approx(0.10, abs=0.01)


def test_agentx_delay_caps(agentx):
    p = AgentXParams()
    root = np.array([t.delay_ms for s in agentx.sessions for t in s.root.turns[1:] if t.delay_ms > 0])
    assert root.max() == 10_000.0
    # capped fraction = 0.85 P(tool > 10 s) + 0.15 P(human > 10 s)
    expect = 0.85 * (1 - p.tool_delay_s.cdf(10.0)) + 0.15 * (1 - p.human_delay_s.cdf(10.0))
    assert np.mean(root == 10_000.0) == pytest.approx(expect, abs=0.01)
    assert np.median(root) == pytest.approx(1000 * 1.3, rel=0.25)  # mixture median ~1.3 s
    sub = np.array([t.delay_ms for s in agentx.sessions for c in s.convs[1:] for t in c.turns[1:]])
    assert sub.max() <= 10_000.0 and np.median(sub) == pytest.approx(500, rel=0.1)


def test_agentx_lengths_clamps_and_compaction(agentx):
    g = 16_384
    roots = [s.root for s in agentx.sessions]
    n_root = [sum(1 for t in c.turns if t.kind == "root") for c in roots]
    assert min(n_root) >= 20 and max(n_root) <= 600 and np.median(n_root) == pytest.approx(100, rel=0.1)
    prefixes = np.array([c.turns[0].input_len - g for c in roots])
    assert prefixes.min() >= 512 and prefixes.max() <= 50_000 and np.median(prefixes) == pytest.approx(4000, rel=0.15)
    assert {c.turns[0].blocks[0][:256] for c in roots} == {range(0, 256)}  # the global prefix, shared by all
    for c in roots:
        lens = prompt_lengths(c)
        for k, t in enumerate(c.turns):
            if t.kind == "compaction":
                nxt = c.turns[k + 1]
                assert lens[k] > 160_000 and nxt.reset and 500 <= t.output_len <= 4000
                assert nxt.input_len == g + t.output_len + 8192 and nxt.shared_blocks == 256
            elif t.kind == "root":
                assert lens[k] <= 160_000
    d = describe(agentx, with_ideal=False)
    assert 40_000 <= d["isl_mean"] <= 70_000
    subs = [c for s in agentx.sessions for c in s.convs[1:] if c.kind == "subagent"]
    assert all(1 <= len(c.turns) <= 60 and 64 <= c.turns[-1].output_len <= 4000 for c in subs)
    assert all(c.turns[0].shared_blocks == 128 and c.turns[0].blocks[0][:128] == range(256, 384) for c in subs)


def test_agentx_ideal_hit_shape():
    tr = build("agentx-like", num_sessions=20)
    hit = ideal_hit(tr, "replay")
    assert 0.95 <= hit.ratio("root") <= 0.985
    assert hit.ratio("sidecar") == 0.0 and hit.ratio("subagent") < hit.ratio("root")


# ----- random and shared-prefix --------------------------------------------------------------------------------------
def test_random_lengths():
    tr = build("random", num_sessions=200, input_len=1000, output_len=100, range_ratio=0.5)
    ins = [s.root.turns[0].input_len for s in tr.sessions]
    outs = [s.root.turns[0].output_len for s in tr.sessions]
    assert 500 <= min(ins) and max(ins) <= 1000 and 50 <= min(outs) and max(outs) <= 100
    assert ideal_hit(tr).ratio() == 0.0
    exact = build("random", num_sessions=5, scale=0.5)
    assert {(s.root.turns[0].input_len, s.root.turns[0].output_len) for s in exact.sessions} == {(512, 64)}


def test_shared_prefix_ideal_by_hand():
    n, groups, system, question = 40, 4, 1024, 100
    tr = build("shared-prefix", num_sessions=n, num_groups=groups, system_len=system, question_len=question)
    assert all(s.root.turns[0].input_len == system + question for s in tr.sessions)
    # every prompt but the first of each group hits its group's whole system prompt (1024 = 16 full blocks)
    assert ideal_hit(tr).ratio() == pytest.approx((n - groups) * system / (n * (system + question)))
