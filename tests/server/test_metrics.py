"""The server's Prometheus metrics: the engine-side phases of a finished request (queue, prefill, decode) land in
their histograms, and phases that never happened (an aborted request never scheduled) are not observed."""

from __future__ import annotations

import pytest

from tokenspeed.engine.outputs import RequestMetrics
from tokenspeed.server.metrics import Metrics


def _sample(m: Metrics, name: str, suffix: str) -> float:
    return m.registry.get_sample_value(f"tokenspeed:{name}_{suffix}", {"model_name": "m"}) or 0.0


def test_request_phases_are_observed() -> None:
    m = Metrics("m")
    m.phases(RequestMetrics(queue_time=0.25, ttft=0.75, e2e=2.0))
    assert _sample(m, "request_queue_time_seconds", "sum") == pytest.approx(0.25)
    assert _sample(m, "request_prefill_time_seconds", "sum") == pytest.approx(0.5)
    assert _sample(m, "request_decode_time_seconds", "sum") == pytest.approx(1.25)
    assert _sample(m, "request_prefill_time_seconds", "count") == 1
    text = m.render().decode()
    assert 'tokenspeed:request_queue_time_seconds_bucket{le="0.5",model_name="m"} 1.0' in text


def test_phases_that_did_not_happen_are_not_observed() -> None:
    m = Metrics("m")
    m.phases(RequestMetrics(queue_time=None, ttft=None, e2e=0.1))  # aborted while waiting
    m.phases(RequestMetrics(queue_time=0.1, ttft=None, e2e=0.3))  # aborted during its prefill
    assert _sample(m, "request_queue_time_seconds", "count") == 1
    assert _sample(m, "request_prefill_time_seconds", "count") == 0
    assert _sample(m, "request_decode_time_seconds", "count") == 0
