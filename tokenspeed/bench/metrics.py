"""Run metrics exactly as workloads.md defines them, from per-request records.

Per request: TTFT = sent -> first token (ms); E2EL = sent -> last token (ms); TPOT = (E2EL - TTFT) / (OSL - 1) (ms);
ITL = gaps between successive streamed tokens (ms; a chunk of k tokens gives k gaps of gap / k).
Per run (scored, completed requests; duration = last request end - first request start, s):
- output tok/s/GPU = sum OSL / duration / GPUs; total tok/s/GPU counts prompt + output; TPM/GPU = 60 x tok/s/GPU
  (both reported: `tpm_per_gpu_output` is the AgentX convention, `tpm_per_gpu_total` the Part I seed's);
- TPS/user = 1000 / mean TPOT; P90 interactivity = 1000 / p90(ITL ms); P90 E2E-normalised interactivity =
  1000 / p90(E2EL_i ms / OSL_i) (both tokens/s/user);
- cache hit = cached prompt tokens / prompt tokens: server (usage.cached_tokens; /metrics counters) vs ideal.
Percentiles are linear-interpolated (numpy); every latency reports mean, p50, p90, p95, p99.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tokenspeed.bench.record import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Dist:
    """mean and percentiles of one latency (ms); all 0 with count 0 when there is no sample."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if len(values) == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values, dtype=float)
        p = np.percentile(a, PERCENTILES)
        return cls(len(a), float(a.mean()), *(float(x) for x in p))


def _plen(r: RequestRecord) -> int:
    """Prompt tokens as the server counted them (usage), else as sent."""
    return r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


@dataclass(frozen=True)
class Summary:
    """One run (one point of a sweep). Rates are per second; `per_gpu` values are divided by `num_gpus`."""

    num_gpus: int
    requests: int  # scored requests sent
    completed: int
    errors: int  # failed for any reason other than a context overflow
    overflows: int
    error_rate: float
    overflow_rate: float
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_tok_s: float
    total_tok_s: float
    output_tok_s_per_gpu: float
    total_tok_s_per_gpu: float
    tpm_per_gpu_output: float
    tpm_per_gpu_total: float
    tps_user: float  # 1000 / mean TPOT
    p90_interactivity: float  # 1000 / p90 ITL
    p90_e2e_interactivity: float  # 1000 / p90 (E2EL / OSL)
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    ttft_first_turn: Dist
    ttft_later_turns: Dist
    tokens_per_chunk: float  # streamed tokens per chunk after the first (~ tokens per decode iteration)
    server_cache_hit: float | None  # usage.prompt_tokens_details.cached_tokens / prompt tokens
    server_cache_hit_metrics: float | None  # /metrics prefix-cache counters over the window
    server_phase_ms: dict  # mean engine-side queue / prefill / decode ms per request finished in the window
    ideal_cache_hit: float | None  # infinite block-level cache over exactly the requests sent
    cache_hit_by_kind: dict  # kind -> {"server", "ideal", "requests"}
    peak_inflight: int
    prompt_len_mismatches: int  # usage.prompt_tokens != tokens sent
    output_len_mismatches: int  # usage.completion_tokens != max_tokens (ignore_eos not honoured)
    valid: bool  # overflow rate <= 1% and error rate <= 10%

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], num_gpus: int = 1, peak_inflight: int = 0,
              server_hit_metrics: float | None = None, server_phase_ms: dict | None = None) -> Summary:
    """Metrics of the scored records (others are ignored)."""
    scored = [r for r in records if r.phase == "scored"]
    ok = [r for r in scored if r.ok]
    overflows = sum(1 for r in scored if r.overflow)
    errors = sum(1 for r in scored if not r.ok and not r.overflow)
    n = len(scored)
    t_start = min((r.start_s for r in scored), default=0.0)
    t_end = max((r.end_s for r in ok), default=t_start)
    duration = max(t_end - t_start, 1e-9) if ok else 0.0
    inp = sum(_plen(r) for r in ok)
    out = sum(r.output_tokens or 0 for r in ok)
    per = (lambda x: x / duration) if duration else (lambda x: 0.0)
    tpots = [t for r in ok if (t := r.tpot_ms) is not None]
    itls = [x for r in ok for x in r.itl_ms()]
    norm = [r.e2el_ms / r.output_tokens for r in ok if r.output_tokens]
    tpot, itl = Dist.of(tpots), Dist.of(itls)
    later = [r.chunk_tokens[1:] for r in ok]
    chunks = sum(len(c) for c in later)
    reported = [r for r in ok if r.cached_tokens is not None]
    by_kind: dict = {}
    for kind in sorted({r.kind for r in ok}):
        rs = [r for r in ok if r.kind == kind]
        rep = [r for r in rs if r.cached_tokens is not None]
        by_kind[kind] = {"requests": len(rs),
                         "server": _ratio(sum(r.cached_tokens for r in rep), sum(_plen(r) for r in rep)),
                         "ideal": _ratio(sum(r.ideal_cached for r in rs), sum(r.prompt_len for r in rs))}
    return Summary(
        num_gpus=num_gpus, requests=n, completed=len(ok), errors=errors, overflows=overflows,
        error_rate=errors / n if n else 0.0, overflow_rate=overflows / n if n else 0.0, duration_s=duration,
        input_tokens=inp, output_tokens=out, request_throughput=per(len(ok)), output_tok_s=per(out),
        total_tok_s=per(inp + out), output_tok_s_per_gpu=per(out) / num_gpus,
        total_tok_s_per_gpu=per(inp + out) / num_gpus, tpm_per_gpu_output=60.0 * per(out) / num_gpus,
        tpm_per_gpu_total=60.0 * per(inp + out) / num_gpus,
        tps_user=1000.0 / tpot.mean if tpot.mean > 0 else 0.0,
        p90_interactivity=1000.0 / itl.p90 if itl.p90 > 0 else 0.0,
        p90_e2e_interactivity=(1000.0 / float(np.percentile(norm, 90))) if norm and max(norm) > 0 else 0.0,
        ttft=Dist.of([r.ttft_ms for r in ok]), tpot=tpot, itl=itl, e2el=Dist.of([r.e2el_ms for r in ok]),
        ttft_first_turn=Dist.of([r.ttft_ms for r in ok if r.first_turn]),
        ttft_later_turns=Dist.of([r.ttft_ms for r in ok if not r.first_turn]),
        tokens_per_chunk=sum(sum(c) for c in later) / chunks if chunks else 0.0,
        server_cache_hit=_ratio(sum(r.cached_tokens for r in reported), sum(_plen(r) for r in reported)),
        server_cache_hit_metrics=server_hit_metrics, server_phase_ms=dict(server_phase_ms or {}),
        ideal_cache_hit=_ratio(sum(r.ideal_cached for r in ok), sum(r.prompt_len for r in ok)),
        cache_hit_by_kind=by_kind, peak_inflight=peak_inflight,
        prompt_len_mismatches=sum(1 for r in ok if r.prompt_tokens is not None and r.prompt_tokens != r.prompt_len),
        output_len_mismatches=sum(1 for r in ok if r.output_tokens != r.max_tokens),
        valid=(overflows <= 0.01 * n) and (errors <= 0.10 * n))


def timeline(records: Sequence[RequestRecord], num_gpus: int = 1, bin_s: float | None = None) -> dict:
    """Output tok/s/GPU over time, from every streamed chunk of the scored requests.

    Returns {"bin_s", "t_s": bin starts (s from the first scored request), "output_tok_s_per_gpu": per bin}.
    """
    scored = [r for r in records if r.phase == "scored" and r.chunk_ms]
    if not scored:
        return {"bin_s": bin_s or 1.0, "t_s": [], "output_tok_s_per_gpu": []}
    t0 = min(r.start_s for r in records if r.phase == "scored")
    times = np.concatenate([r.start_s - t0 + np.asarray(r.chunk_ms) / 1000.0 for r in scored])
    weights = np.concatenate([np.asarray(r.chunk_tokens, dtype=float) for r in scored])
    span = float(times.max()) if len(times) else 0.0
    if bin_s is None:  # about 60 bins, rounded to a readable width
        raw = max(span / 60.0, 1e-3)
        bin_s = float(min((b for b in (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60) if b >= raw),
                          default=60.0))
    edges = np.arange(0.0, span + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    hist, _ = np.histogram(times, bins=edges, weights=weights)
    return {"bin_s": bin_s, "t_s": edges[:-1].round(6).tolist(),
            "output_tok_s_per_gpu": (hist / bin_s / num_gpus).round(3).tolist()}
