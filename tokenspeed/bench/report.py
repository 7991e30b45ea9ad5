"""Outputs: the console table (the familiar `bench serve` layout), the JSON summary, the per-request JSONL."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from tokenspeed.bench.metrics import Dist, Summary
from tokenspeed.bench.record import RequestRecord

W = 50  # table width


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _line(label: str, value) -> str:
    return f"{label:<40}{_fmt(value):<10}"


def _title(text: str, fill: str = "-") -> str:
    return f"{text:{fill}^{W}}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100.0 * v:.2f}%"


def _dist(name: str, unit: str, d: Dist, pcts: Sequence[int] = (50, 90, 99)) -> list[str]:
    rows = [_line(f"Mean {name} ({unit}):", d.mean), _line(f"Median {name} ({unit}):", d.p50)]
    return rows + [_line(f"P{p} {name} ({unit}):", getattr(d, f"p{p}")) for p in pcts if p != 50]


def format_table(s: Summary, title: str = "Serving Benchmark Result", header: Sequence[tuple[str, object]] = ()) -> str:
    """One run as a console table."""
    rows = [_title(f" {title} ", "="), *(_line(k, v) for k, v in header),
            _line("Successful requests:", s.completed), _line("Failed requests:", s.errors),
            _line("Context overflows:", s.overflows), _line("Benchmark duration (s):", s.duration_s),
            _line("Total input tokens:", s.input_tokens), _line("Total generated tokens:", s.output_tokens),
            _line("Request throughput (req/s):", s.request_throughput),
            _line("Output token throughput (tok/s):", s.output_tok_s),
            _line("Total token throughput (tok/s):", s.total_tok_s),
            _line(f"Output tok/s/GPU ({s.num_gpus} GPU):", s.output_tok_s_per_gpu),
            _line("Total tok/s/GPU:", s.total_tok_s_per_gpu),
            _line("TPM/GPU (output only):", s.tpm_per_gpu_output),
            _line("TPM/GPU (prompt + output):", s.tpm_per_gpu_total),
            _line("Peak in-flight requests:", s.peak_inflight),
            _title("Time to First Token"), *_dist("TTFT", "ms", s.ttft),
            _line("Median TTFT, first turns (ms):", s.ttft_first_turn.p50),
            _line("P90 TTFT, first turns (ms):", s.ttft_first_turn.p90),
            _line("Median TTFT, later turns (ms):", s.ttft_later_turns.p50),
            _line("P90 TTFT, later turns (ms):", s.ttft_later_turns.p90),
            *(_line(f"Server {p} time, mean (ms):", s.server_phase_ms[p]) for p in ("queue", "prefill", "decode")
              if p in s.server_phase_ms),
            _title("Time per Output Token (excl. 1st token)"), *_dist("TPOT", "ms", s.tpot),
            _title("Inter-token Latency"), *_dist("ITL", "ms", s.itl),
            _title("End-to-end Latency"), *_dist("E2EL", "ms", s.e2el),
            _title("Interactivity"),
            _line("TPS/user (1000 / mean TPOT):", s.tps_user),
            _line("P90 interactivity (tok/s/user):", s.p90_interactivity),
            _line("P90 E2E-norm. interactivity:", s.p90_e2e_interactivity),
            _line("Tokens per chunk (after 1st):", s.tokens_per_chunk),
            _title("Prefix Cache Hit"),
            f"{'Server (usage cached_tokens):':<40}{_pct(s.server_cache_hit):<10}",
            f"{'Server (/metrics counters):':<40}{_pct(s.server_cache_hit_metrics):<10}",
            f"{'Ideal (infinite block cache):':<40}{_pct(s.ideal_cache_hit):<10}",
            "=" * W]
    if not s.valid:
        rows.append("INVALID RUN: context overflows > 1% or errors > 10% of requests")
    return "\n".join(rows)


SWEEP_COLUMNS = (("conc", 5, ""), ("req", 6, ""), ("out tok/s/GPU", 14, ".2f"), ("tot tok/s/GPU", 14, ".2f"),
                 ("TPS/user", 9, ".2f"), ("P90 inter.", 11, ".2f"), ("TTFT p50", 10, ".1f"), ("TTFT p90", 10, ".1f"),
                 ("hit srv", 9, ""), ("hit ideal", 10, ""), ("err", 5, ""))


def format_sweep(points: Sequence[dict]) -> str:
    """One row per concurrency of a sweep (points as written in the sweep JSON)."""
    rows = ["".join(f"{name:>{w}}" for name, w, _ in SWEEP_COLUMNS)]
    for p in points:
        s = p["summary"]
        vals = (p["concurrency"], s["completed"], s["output_tok_s_per_gpu"], s["total_tok_s_per_gpu"], s["tps_user"],
                s["p90_interactivity"], s["ttft"]["p50"], s["ttft"]["p90"], _pct(s["server_cache_hit"]),
                _pct(s["ideal_cache_hit"]), s["errors"] + s["overflows"])
        rows.append("".join(f"{v:>{w}{spec}}" for (_, w, spec), v in zip(SWEEP_COLUMNS, vals)))
    return "\n".join(rows)


def run_document(summary: Summary, *, concurrency: int, workload: dict, client: dict, timeline: dict,
                 window: dict, command: str, jsonl: str | None) -> dict:
    """The JSON summary of one run."""
    return {"tool": "tokenspeed bench", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command,
            "concurrency": concurrency, "workload": workload, "client": client, "window": window,
            "summary": summary.as_dict(), "timeline": timeline, "requests_jsonl": jsonl}


def write_json(doc: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def write_jsonl(records: Sequence[RequestRecord], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(r.to_json() + "\n")


def read_points(path: str | Path) -> tuple[str, list[dict]]:
    """(label, points) of a sweep JSON, or of a single-run JSON (one point)."""
    doc = json.loads(Path(path).read_text())
    if "points" in doc:
        return doc.get("label") or Path(path).stem, doc["points"]
    return doc.get("label") or Path(path).stem, [doc]
