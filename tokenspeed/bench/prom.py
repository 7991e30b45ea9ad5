"""The server's prefix-cache hit and request phases from its Prometheus `/metrics`, scraped before and after the
scored window.

Counters are matched by name suffix so several engines work: hits `*prefix_cache_hits_total` (vLLM:
`vllm:prefix_cache_hits_total`, ours: `tokenspeed:prefix_cache_hits_total`), queries `*prefix_cache_queries_total`;
both count tokens. The phases are the engine-side histograms `*request_{queue,prefill,decode}_time_seconds` (vLLM's
names, ours too): their sums and counts give each phase's mean over the requests that finished in the window, so a
time to first token splits into queueing and prefill as the server saw them. Samples of one counter with several
label sets (one per engine or model) are summed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

try:
    import httpx
except ImportError:  # pragma: no cover
    import httpx2 as httpx  # type: ignore[no-redef]

HIT_SUFFIXES = ("prefix_cache_hits_total", "prefix_cache_hit_tokens_total")
QUERY_SUFFIXES = ("prefix_cache_queries_total", "prefix_cache_query_tokens_total")


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative prefix-cache counters (tokens) at one scrape."""

    hits: float
    queries: float


PHASES = ("queue", "prefill", "decode")


@dataclass(frozen=True)
class Scrape:
    """What one /metrics scrape gives the bench."""

    cache: CacheCounters | None  # None: no prefix-cache counters
    phases: dict[str, tuple[float, float]]  # phase -> (seconds summed, requests) of request_<phase>_time_seconds


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped). Comments and malformed lines are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if not math.isnan(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def cache_counters(metrics: dict[str, float]) -> CacheCounters | None:
    def pick(suffixes: tuple[str, ...]) -> float | None:
        vals = [v for k, v in metrics.items() if k.endswith(suffixes)]
        return sum(vals) if vals else None

    hits, queries = pick(HIT_SUFFIXES), pick(QUERY_SUFFIXES)
    return None if hits is None or queries is None else CacheCounters(hits, queries)


def phase_sums(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each request phase histogram present in parsed metrics."""
    out = {}
    for phase in PHASES:
        base = f"request_{phase}_time_seconds"
        sums = [v for k, v in metrics.items() if k.endswith(base + "_sum")]
        counts = [v for k, v in metrics.items() if k.endswith(base + "_count")]
        if sums and counts:
            out[phase] = (sum(sums), sum(counts))
    return out


async def scrape(client: httpx.AsyncClient, base_url: str) -> Scrape | None:
    """GET /metrics; None when the server has no such endpoint."""
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    metrics = parse_prometheus(resp.text)
    return Scrape(cache_counters(metrics), phase_sums(metrics))


def phase_ms_between(before: Scrape | None, after: Scrape | None) -> dict[str, float]:
    """Mean ms per request of each phase over the requests the server finished between two scrapes (phases
    missing from either scrape, or with no request finished, are left out)."""
    if before is None or after is None:
        return {}
    out = {}
    for phase, (total, count) in after.phases.items():
        t0, c0 = before.phases.get(phase, (0.0, 0.0))
        if count - c0 > 0:
            out[phase] = 1e3 * (total - t0) / (count - c0)
    return out


def hit_between(before: CacheCounters | None, after: CacheCounters | None) -> float | None:
    """Hit ratio of the tokens queried between two scrapes."""
    if before is None or after is None:
        return None
    q = after.queries - before.queries
    return (after.hits - before.hits) / q if q > 0 else None
