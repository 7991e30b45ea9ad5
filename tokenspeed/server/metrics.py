"""Prometheus metrics of the server: request counters, token counters, latency histograms, engine gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenspeed.engine.outputs import RequestMetrics, StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)


class Metrics:
    """One registry per server. Names use the `tokenspeed:` prefix and vLLM's meanings."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("tokenspeed:request_success", "finished requests", labels + ["finished_reason"],
                                registry=r)
        self.prompt_tokens = Counter("tokenspeed:prompt_tokens", "prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("tokenspeed:generation_tokens", "generated tokens", labels, registry=r)
        self.cache_queries = Counter("tokenspeed:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                     labels, registry=r)
        self.cache_hits = Counter("tokenspeed:prefix_cache_hits", "prompt tokens served from the prefix cache",
                                  labels, registry=r)
        self.spec_drafts = Counter("tokenspeed:spec_decode_num_draft_tokens", "draft tokens verified", labels,
                                   registry=r)
        self.spec_accepted = Counter("tokenspeed:spec_decode_num_accepted_tokens", "draft tokens accepted", labels,
                                     registry=r)
        self.spec_steps = Counter("tokenspeed:spec_decode_num_steps", "verify steps (acceptance length = "
                                  "1 + accepted / steps)", labels, registry=r)
        self.ttft = Histogram("tokenspeed:time_to_first_token_seconds", "time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tokenspeed:time_per_output_token_seconds", "mean time per output token after the "
                              "first, per request", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenspeed:inter_token_latency_seconds", "time between consecutive output tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenspeed:e2e_request_latency_seconds", "arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        # Where a request's time went, measured by the engine (vLLM's request_*_time_seconds): a long time to first
        # token is queueing (no free sequence slot or cache pages) or prefill (its chunks, and the steps it shared)
        self.queue_time = Histogram("tokenspeed:request_queue_time_seconds", "engine: arrival to first scheduled",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("tokenspeed:request_prefill_time_seconds", "engine: first scheduled to first "
                                      "output token", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("tokenspeed:request_decode_time_seconds", "engine: first output token to "
                                     "finish", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("tokenspeed:num_requests_running", "requests running in the engine", labels,
                             registry=r)
        self.waiting = Gauge("tokenspeed:num_requests_waiting", "requests waiting in the engine", labels,
                             registry=r)
        self.cache_usage = Gauge("tokenspeed:kv_cache_usage_perc", "fraction of MLA cache pages in use", labels,
                                 registry=r)
        self._seen_hits = self._seen_queries = 0

    def speculation(self, drafts: int, accepted: int, steps: int) -> None:
        m = self.model_name
        self.spec_drafts.labels(m).inc(drafts)
        self.spec_accepted.labels(m).inc(accepted)
        self.spec_steps.labels(m).inc(steps)

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int, ttft: float | None, e2e: float) -> None:
        m = self.model_name
        self.requests.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.e2e.labels(m).observe(e2e)
        if ttft is not None and output_tokens > 1:
            self.tpot.labels(m).observe((e2e - ttft) / (output_tokens - 1))

    def failed(self) -> None:
        """A request whose engine step failed (out of device memory): counted under finished_reason "error"."""
        self.requests.labels(self.model_name, "error").inc()

    def phases(self, m: RequestMetrics) -> None:
        """A finished request's engine-side phases (each observed only when both of its ends happened: an aborted
        request may never have been scheduled or produced a token)."""
        name = self.model_name
        if m.queue_time is not None:
            self.queue_time.labels(name).observe(m.queue_time)
            if m.ttft is not None:
                self.prefill_time.labels(name).observe(max(m.ttft - m.queue_time, 0.0))
        if m.ttft is not None and m.e2e is not None:
            self.decode_time.labels(name).observe(max(m.e2e - m.ttft, 0.0))

    def token(self, itl: float | None, first: float | None) -> None:
        self.generation_tokens.labels(self.model_name).inc()
        if first is not None:
            self.ttft.labels(self.model_name).observe(first)
        if itl is not None:
            self.itl.labels(self.model_name).observe(itl)

    def engine(self, stats: StepStats | None, num_unfinished: int) -> None:
        """Refresh the gauges from the engine's last step (called when /metrics is scraped)."""
        m = self.model_name
        if stats is None:
            self.running.labels(m).set(0)
            self.waiting.labels(m).set(num_unfinished)
            return
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.cache_usage.labels(m).set(stats.cache_usage)
        self.cache_hits.labels(m).inc(stats.num_cache_hit_tokens - self._seen_hits)
        self.cache_queries.labels(m).inc(stats.num_cache_query_tokens - self._seen_queries)
        self._seen_hits, self._seen_queries = stats.num_cache_hit_tokens, stats.num_cache_query_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)
