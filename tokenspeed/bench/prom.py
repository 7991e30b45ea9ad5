"""The server's prefix-cache hit from its Prometheus `/metrics`, scraped before and after the scored window.

Counters are matched by name suffix so several engines work: hits `*prefix_cache_hits_total` (vLLM:
`vllm:prefix_cache_hits_total`, ours: `tokenspeed:prefix_cache_hits_total`), queries `*prefix_cache_queries_total`;
both count tokens. Samples of one counter with several label sets (one per engine or model) are summed.
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


async def scrape(client: httpx.AsyncClient, base_url: str) -> CacheCounters | None:
    """GET /metrics; None when the server has no such endpoint or no prefix-cache counters."""
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return cache_counters(parse_prometheus(resp.text))


def hit_between(before: CacheCounters | None, after: CacheCounters | None) -> float | None:
    """Hit ratio of the tokens queried between two scrapes."""
    if before is None or after is None:
        return None
    q = after.queries - before.queries
    return (after.hits - before.hits) / q if q > 0 else None
