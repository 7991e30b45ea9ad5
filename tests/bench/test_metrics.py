"""Metric math on hand-made timelines, the report layout, /metrics parsing."""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed.bench import prom
from tokenspeed.bench.metrics import Dist, summarize, timeline
from tokenspeed.bench.record import RequestRecord
from tokenspeed.bench.report import format_sweep, format_table


def rec(**kw) -> RequestRecord:
    base = dict(phase="scored", lane=0, session=0, epoch=0, conv=0, turn=0, kind="root", prompt_len=100,
                max_tokens=4, ideal_cached=0, start_s=0.0, ok=True, status=200)
    base.update(kw)
    if base["ok"] and "chunk_ms" in kw:
        base.setdefault("ttft_ms", kw["chunk_ms"][0])
        base.setdefault("e2el_ms", kw["chunk_ms"][-1])
    return RequestRecord(**base)


RECORDS = [
    # first turn: 4 tokens in chunks 1, 1, 2 at 100, 110, 130 ms; 100 prompt tokens, 0 cached (ideal 0)
    rec(chunk_ms=(100.0, 110.0, 130.0), chunk_tokens=(1, 1, 2), prompt_tokens=100, output_tokens=4, cached_tokens=0),
    # later turn sent at 50 ms: 2 tokens at 200, 240 ms; 300 prompt tokens, 256 cached (ideal 256)
    rec(turn=1, start_s=0.05, prompt_len=300, max_tokens=2, ideal_cached=256, chunk_ms=(200.0, 240.0),
        chunk_tokens=(1, 1), prompt_tokens=300, output_tokens=2, cached_tokens=256),
    rec(turn=2, start_s=0.06, ok=False, status=400, error="HTTP 400: maximum context length", overflow=True),
    rec(turn=3, start_s=0.07, ok=False, error="timeout after 1 s"),
    rec(phase="warmup", start_s=-5.0, chunk_ms=(1.0, 2.0), chunk_tokens=(1, 1), output_tokens=2),
]


def test_request_level_math():
    a, b = RECORDS[0], RECORDS[1]
    assert a.ttft_ms == 100 and a.e2el_ms == 130 and a.tpot_ms == pytest.approx(30 / 3)
    assert a.itl_ms() == [10.0, 10.0, 10.0]  # the 2-token chunk splits its 20 ms gap
    assert b.tpot_ms == 40 and b.itl_ms() == [40.0] and b.end_s == pytest.approx(0.29)
    assert RequestRecord.from_json(a.to_json()) == a


def test_run_level_math():
    s = summarize(RECORDS, num_gpus=2, peak_inflight=3, server_hit_metrics=0.5)
    assert (s.requests, s.completed, s.errors, s.overflows) == (4, 2, 1, 1)
    assert s.error_rate == 0.25 and s.overflow_rate == 0.25 and not s.valid
    assert s.duration_s == pytest.approx(0.29)  # last end (0.05 + 0.24) - first start (0)
    assert s.output_tokens == 6 and s.input_tokens == 400
    assert s.output_tok_s == pytest.approx(6 / 0.29) and s.output_tok_s_per_gpu == pytest.approx(3 / 0.29)
    assert s.total_tok_s_per_gpu == pytest.approx(203 / 0.29)
    assert s.tpm_per_gpu_output == pytest.approx(60 * 3 / 0.29)
    assert s.tpm_per_gpu_total == pytest.approx(60 * 203 / 0.29)
    assert s.tpot.mean == 25 and s.tps_user == pytest.approx(1000 / 25)
    assert s.itl.count == 4 and s.itl.p90 == pytest.approx(np.percentile([10, 10, 10, 40], 90))
    assert s.p90_interactivity == pytest.approx(1000 / np.percentile([10, 10, 10, 40], 90))
    assert s.p90_e2e_interactivity == pytest.approx(1000 / np.percentile([130 / 4, 240 / 2], 90))
    assert s.ttft.mean == 150 and s.ttft_first_turn.p50 == 100 and s.ttft_later_turns.p50 == 200
    assert s.e2el.p50 == pytest.approx(185)
    assert s.server_cache_hit == pytest.approx(256 / 400) and s.ideal_cache_hit == pytest.approx(256 / 400)
    assert s.server_cache_hit_metrics == 0.5 and s.peak_inflight == 3
    assert s.tokens_per_chunk == pytest.approx(4 / 3)  # chunks after the first: (1, 2) and (1)
    assert s.prompt_len_mismatches == 0 and s.output_len_mismatches == 0
    assert s.cache_hit_by_kind == {"root": {"requests": 2, "server": 256 / 400, "ideal": 256 / 400}}


def test_validity_thresholds():
    ok = [rec(start_s=i * 0.01, chunk_ms=(1.0, 2.0), chunk_tokens=(1, 1), output_tokens=2) for i in range(99)]
    assert summarize(ok + [RECORDS[2]]).valid  # 1% overflow is allowed
    assert not summarize(ok[:98] + [RECORDS[2]] * 2).valid
    assert summarize(ok[:90] + [RECORDS[3]] * 10).valid and not summarize(ok[:89] + [RECORDS[3]] * 11).valid


def test_dist_and_empty():
    d = Dist.of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (d.count, d.mean, d.p50, d.p90, d.p99) == (10, 5.5, 5.5, pytest.approx(9.1), pytest.approx(9.91))
    s = summarize([])
    assert s.requests == 0 and s.duration_s == 0 and s.server_cache_hit is None and s.tps_user == 0


def test_timeline_conserves_tokens():
    tl = timeline(RECORDS, num_gpus=2, bin_s=0.1)
    assert tl["t_s"][:3] == [0.0, 0.1, 0.2]
    # tokens: 1 @0.1, 1 @0.11, 2 @0.13, 1 @0.25, 1 @0.29 -> bins [0,0.1): 0, [0.1,0.2): 4, [0.2,0.3): 2
    assert [round(x * 0.1 * 2, 6) for x in tl["output_tok_s_per_gpu"]] == [0.0, 4.0, 2.0]


def test_console_layout():
    s = summarize(RECORDS)
    text = format_table(s, header=[("Concurrency:", 4)])
    lines = text.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert "Successful requests:                    2" in text
    assert any(line.startswith("Mean TTFT (ms):") and line[40:].strip() == "150.00" for line in lines)
    assert "Median TPOT (ms):" in text and "P99 ITL (ms):" in text and "P90 interactivity" in text
    assert "INVALID RUN" in lines[-1]
    sweep = format_sweep([{"concurrency": 4, "summary": s.as_dict()}])
    assert sweep.splitlines()[1].split()[:2] == ["4", "2"]


def test_prometheus_parsing():
    text = """# HELP tokenspeed:prefix_cache_hits_total prompt tokens served from the prefix cache
# TYPE tokenspeed:prefix_cache_hits_total counter
tokenspeed:prefix_cache_hits_total{model_name="a"} 300
tokenspeed:prefix_cache_hits_total{model_name="b"} 100
tokenspeed:prefix_cache_queries_total{model_name="a",x="}"} 1000
vllm:num_requests_running 2
garbage line here
"""
    m = prom.parse_prometheus(text)
    assert m["tokenspeed:prefix_cache_hits_total"] == 400 and m["vllm:num_requests_running"] == 2
    c = prom.cache_counters(m)
    assert c == prom.CacheCounters(400, 1000)
    assert prom.hit_between(prom.CacheCounters(100, 200), prom.CacheCounters(400, 1000)) == pytest.approx(300 / 800)
    assert prom.cache_counters({"x_total": 1.0}) is None and prom.hit_between(None, c) is None


def test_request_phase_means_between_scrapes():
    """The engine-side phase histograms (ours and vLLM's names) give each phase's mean over the requests finished
    between two scrapes; a phase absent from a scrape, or with no request finished, is left out."""
    def scrape(text: str) -> prom.Scrape:
        m = prom.parse_prometheus(text)
        return prom.Scrape(prom.cache_counters(m), prom.phase_sums(m))

    before = scrape('tokenspeed:request_queue_time_seconds_sum{model_name="a"} 1.0\n'
                    'tokenspeed:request_queue_time_seconds_count{model_name="a"} 4\n'
                    'vllm:request_prefill_time_seconds_sum{model_name="a"} 2.0\n'
                    'vllm:request_prefill_time_seconds_count{model_name="a"} 4\n')
    after = scrape('tokenspeed:request_queue_time_seconds_sum{model_name="a"} 1.5\n'
                   'tokenspeed:request_queue_time_seconds_count{model_name="a"} 6\n'
                   'vllm:request_prefill_time_seconds_sum{model_name="a"} 2.0\n'
                   'vllm:request_prefill_time_seconds_count{model_name="a"} 4\n'
                   'tokenspeed:request_decode_time_seconds_sum{model_name="a"} 3.0\n'
                   'tokenspeed:request_decode_time_seconds_count{model_name="a"} 2\n')
    assert prom.phase_ms_between(before, after) == pytest.approx({"queue": 250.0, "decode": 1500.0})
    assert prom.phase_ms_between(None, after) == {}
    s = summarize(RECORDS, server_phase_ms={"queue": 250.0})
    assert "Server queue time, mean (ms):" in format_table(s) and "prefill time" not in format_table(s)
