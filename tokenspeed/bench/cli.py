"""`tokenspeed bench`: drive any OpenAI-compatible server with an agentic workload; sweep concurrency; report.

    tokenspeed bench --base-url http://127.0.0.1:8000 --workload swe-smith-like --scale 0.01 --concurrency 1,2,4
    tokenspeed bench --workload agentx-like --dry-run                    # trace statistics + ideal hit, no server
    tokenspeed bench --workload agentx-like --export-trace t.jsonl --dry-run
    tokenspeed bench --trace t.jsonl --base-url ... --concurrency 8      # replay a Mooncake-style trace
    tokenspeed bench --plot a.json b.json --output cmp.png               # overlay sweeps (no run)

Writes, per concurrency P, RESULT_DIR/NAME-cP.json (summary) and NAME-cP.jsonl (one line per request), then
NAME.json (the sweep), NAME-frontier.png and NAME-throughput.png. See docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from tokenspeed.bench.workloads import WORKLOADS, build, describe, export_jsonl, import_jsonl, swe_smith
from tokenspeed.bench.workloads.synth import TokenSynth
from tokenspeed.bench.workloads.trace import Trace


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
    return vals


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Register `tokenspeed bench` on the top-level subparsers."""
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server on agentic multi-turn workloads",
                       description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n".join(__doc__.split("\n")[1:]))
    g = p.add_argument_group("server and client")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    g.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (env OPENAI_API_KEY)")
    g.add_argument("--endpoint", default="/v1/completions", help="completions endpoint taking token-id prompts")
    g.add_argument("--history", choices=["replay", "live"], default="replay",
                   help="append the recorded output (AgentX semantics) or the server's own (swe-smith semantics)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per-request limit (s)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    g.add_argument("--vocab-size", type=int, default=512, help="token ids are drawn below this (the model's vocab)")
    g.add_argument("--token-low", type=int, default=16, help="token ids are drawn at or above this")
    g.add_argument("--max-connections", type=int, help="connection pool size (default: unbounded)")
    g.add_argument("--ideal-block-size", type=int, help="block size of the ideal-hit cache model (default: the "
                                                        "trace's, 64); set it to the server's page size to compare")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=sorted(WORKLOADS), default="swe-smith-like")
    g.add_argument("--trace", help="replay a Mooncake-style JSONL trace instead of generating one")
    g.add_argument("--trace-block-size", type=int, default=64, help="tokens per hash id of --trace")
    g.add_argument("--trace-cumulative", action="store_true",
                   help="--trace lines give the whole prompt (not the new tokens)")
    g.add_argument("--scale", type=float, default=1.0, help="multiplies every token count (turns stay)")
    g.add_argument("--seed", type=int, help="workload seed (default: the workload's own)")
    g.add_argument("--pool-size", type=int, help="sessions generated (default: swe 128, agentx 256, others >= 64)")
    g.add_argument("--swl-shared-prefix", type=int, help="swe-smith-like: tokens of turn 1 shared by all sessions")
    g.add_argument("--swl-var", action="store_true", help="swe-smith-like: lognormal outputs and think times")
    g.add_argument("--agentx-c-max", type=int, help="agentx-like: context limit that triggers compaction")
    g.add_argument("--random-input-len", type=int)
    g.add_argument("--random-output-len", type=int)
    g.add_argument("--random-range-ratio", type=float)
    g.add_argument("--sp-num-groups", type=int)
    g.add_argument("--sp-system-len", type=int)
    g.add_argument("--sp-question-len", type=int)
    g.add_argument("--sp-output-len", type=int)
    g.add_argument("--export-trace", help="write the trace as Mooncake-style JSONL")
    g.add_argument("--dry-run", action="store_true", help="print the trace's statistics and ideal hit; send nothing")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=_ints, default=[1], help="live sessions, comma-separated for a sweep")
    g.add_argument("--num-sessions", type=int, help="measured sessions per run (count-bounded runs)")
    g.add_argument("--duration", type=float, help="scored window (s): time-bounded, sessions recycled "
                                                   "(agentx-like default 1800)")
    g.add_argument("--grace", type=float, default=600.0, help="drain limit after a time-bounded window (s)")
    g.add_argument("--warmup", choices=["auto", "none", "sessions", "mid-session"], default="auto")
    g.add_argument("--warmup-sessions", type=int, help="sessions of a `sessions` warmup (swe-smith-like: 2)")
    g.add_argument("--warmup-requests", type=int, default=10, help="1-token requests per lane (mid-session)")
    g.add_argument("--quiesce", type=float, help="pause between warmup and window (s; mid-session default 5)")
    g.add_argument("--num-gpus", type=int, default=1, help="GPUs serving (prefill + decode): per-GPU figures")
    g.add_argument("--nonce", type=int, help="run salt (default: from the clock, so each run starts cold)")
    g.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("output")
    g.add_argument("--result-dir", default="bench-results")
    g.add_argument("--result-name", help="file prefix (default: WORKLOAD-sSCALE)")
    g.add_argument("--label", help="curve label in plots (default: the result name)")
    g.add_argument("--overlay", nargs="+", default=[], help="other sweep JSONs drawn on the frontier PNG")
    g.add_argument("--plot", nargs="+", help="only plot these result JSONs (no run)")
    g.add_argument("--output", help="PNG path of --plot (default RESULT_DIR/compare-frontier.png)")
    g.add_argument("--plot-x", default="tps_user", choices=["tps_user", "p90_interactivity", "p90_e2e_interactivity"])
    g.add_argument("--plot-y", default="output_tok_s_per_gpu",
                   choices=["output_tok_s_per_gpu", "total_tok_s_per_gpu", "tpm_per_gpu_output", "tpm_per_gpu_total"])
    g.add_argument("--interpolate-at", type=float, help="mark each curve's y at this x (e.g. 50 TPS/user)")
    return p


def load_trace(a: argparse.Namespace, max_conc: int) -> Trace:
    """The trace from --trace or the chosen generator with the CLI's overrides."""
    if a.trace:
        return import_jsonl(a.trace, a.trace_block_size, a.trace_cumulative)
    w = a.workload
    kw: dict = {"seed": a.seed, "num_sessions": a.pool_size}
    if w == "swe-smith-like":
        kw.update(shared_prefix=a.swl_shared_prefix, variant="var" if a.swl_var else None)
    elif w == "agentx-like":
        kw.update(c_max=a.agentx_c_max)
        kw["num_sessions"] = a.pool_size or max(256, 2 * max_conc)
    elif w == "random":
        kw.update(input_len=a.random_input_len, output_len=a.random_output_len, range_ratio=a.random_range_ratio)
    else:
        kw.update(num_groups=a.sp_num_groups, system_len=a.sp_system_len, question_len=a.sp_question_len,
                  output_len=a.sp_output_len)
    if w in ("random", "shared-prefix"):
        kw["num_sessions"] = a.pool_size or max(64, a.num_sessions or 0, 8 * max_conc)
    return build(w, a.scale, **kw)


def plan_run(a: argparse.Namespace, trace: Trace, conc: int, nonce: int):
    """The RunSpec of one concurrency (workload defaults: workloads.md's warmup, window and session counts)."""
    from tokenspeed.bench.runner import RunSpec, split_sessions

    agentic = trace.name == "agentx-like"
    duration = a.duration if a.duration is not None else (1800.0 if agentic else None)
    warmup = a.warmup if a.warmup != "auto" else ("mid-session" if duration is not None else "sessions")
    swe = trace.name == "swe-smith-like"
    if duration is not None:
        measured, warm = tuple(trace.sessions), ()
    else:
        n = a.num_sessions or (swe_smith.sessions_for(conc) if swe else len(trace.sessions))
        n_warm = a.warmup_sessions if a.warmup_sessions is not None else (2 if swe else 1)
        offset = swe_smith.WARMUP_OFFSET if swe and len(trace.sessions) > swe_smith.WARMUP_OFFSET + n_warm else None
        measured, warm = split_sessions(trace.sessions, n, offset, n_warm if warmup == "sessions" else 0)
    quiesce = a.quiesce if a.quiesce is not None else (5.0 if warmup == "mid-session" else 0.0)
    return RunSpec(concurrency=conc, sessions=measured, duration_s=duration, grace_s=a.grace, warmup=warmup,
                   warmup_sessions=warm, warmup_concurrency=2, warmup_requests=a.warmup_requests, quiesce_s=quiesce,
                   nonce=nonce, seed=trace.seed, progress=not a.no_progress)


async def _sweep(a: argparse.Namespace, trace: Trace, name: str) -> list[dict]:
    from tokenspeed.bench import report, runner
    from tokenspeed.bench.client import fetch_model, make_client
    from tokenspeed.bench.metrics import summarize, timeline
    from tokenspeed.bench.session import ClientConfig

    out_dir = Path(a.result_dir)
    points = []
    async with make_client(a.max_connections, a.request_timeout, a.api_key) as client:
        model = a.model or await fetch_model(client, a.base_url.rstrip("/"))
        synth = TokenSynth(seed=trace.seed, block_size=trace.block_size, low=a.token_low, high=a.vocab_size)
        cfg = ClientConfig(a.base_url.rstrip("/"), model, synth, history=a.history, endpoint=a.endpoint,
                           request_timeout_s=a.request_timeout, temperature=a.temperature, extra_body=a.extra_body,
                           ideal_block_size=a.ideal_block_size or trace.block_size)
        base_nonce = a.nonce if a.nonce is not None else int(time.time() * 1000) & 0xFFFFFFFF
        workload = {"name": trace.name, "scale": trace.scale, "seed": trace.seed, "block_size": trace.block_size,
                    "pool_sessions": len(trace.sessions), "params": trace.params}
        client_doc = {"base_url": cfg.base_url, "model": model, "endpoint": cfg.endpoint, "history": cfg.history,
                      "request_timeout_s": cfg.request_timeout_s, "num_gpus": a.num_gpus, "token_range":
                      [a.token_low, a.vocab_size], "nonce": base_nonce, "ideal_block_size": cfg.ideal_block_size,
                      "args": {k: v for k, v in vars(a).items() if k != "api_key"}}
        for k, conc in enumerate(a.concurrency):
            spec = plan_run(a, trace, conc, base_nonce + k)
            res = await runner.run(client, cfg, spec)
            s = summarize(res.records, a.num_gpus, res.peak_inflight, res.server_hit_metrics, res.server_phase_ms)
            jsonl = out_dir / f"{name}-c{conc}.jsonl"
            report.write_jsonl(res.records, jsonl)
            window = {"start_s": res.window_start_s, "end_s": res.window_end_s, "duration_s": spec.duration_s,
                      "warmup": spec.warmup, "measured_sessions": None if spec.duration_s else len(spec.sessions),
                      "started_unix": res.started_unix}
            doc = report.run_document(s, concurrency=conc, workload=workload, client=client_doc,
                                      timeline=timeline(res.records, a.num_gpus), window=window,
                                      command=" ".join(sys.argv), jsonl=jsonl.name)
            report.write_json(doc, out_dir / f"{name}-c{conc}.json")
            header = [("Workload:", f"{trace.name} (scale {trace.scale:g})"), ("Concurrency:", conc),
                      ("History:", a.history)]
            print(report.format_table(s, header=header), flush=True)
            points.append(doc)
    return points


def run_bench(a: argparse.Namespace) -> int:
    """Entry point of `tokenspeed bench`; returns the exit code."""
    from tokenspeed.bench import plot, report

    if a.plot:
        curves = [report.read_points(f) for f in a.plot]
        out = Path(a.output or Path(a.result_dir) / "compare-frontier.png")
        out.parent.mkdir(parents=True, exist_ok=True)
        plot.plot_frontier(curves, out, a.plot_x, a.plot_y, a.interpolate_at)
        print(f"wrote {out}")
        return 0
    try:
        trace = load_trace(a, max(a.concurrency))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.export_trace:
        n = export_jsonl(trace, a.export_trace)
        print(f"wrote {n} requests to {a.export_trace}", file=sys.stderr)
    if a.dry_run:
        print(json.dumps(describe(trace), indent=2))
        return 0
    name = a.result_name or f"{trace.name}-s{trace.scale:g}"
    from tokenspeed.bench.client import httpx
    from tokenspeed.bench.session import LiveHistoryError

    try:
        points = asyncio.run(_sweep(a, trace, name))
    except (httpx.HTTPError, LiveHistoryError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    out_dir = Path(a.result_dir)
    label = a.label or name
    report.write_json({"label": label, "points": points}, out_dir / f"{name}.json")
    print(report.format_sweep(points))
    curves = [(label, points), *(report.read_points(f) for f in a.overlay)]
    plot.plot_frontier(curves, out_dir / f"{name}-frontier.png", a.plot_x, a.plot_y, a.interpolate_at)
    plot.plot_timeline([(label, points)], out_dir / f"{name}-throughput.png")
    print(f"wrote {out_dir}/{name}.json, {name}-c*.json(l), {name}-frontier.png, {name}-throughput.png")
    return 0
