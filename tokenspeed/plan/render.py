"""Text table and JSON forms of a `MemoryPlan` (every JSON size is an integer number of bytes)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tokenspeed.plan.planner import MemoryPlan
from tokenspeed.plan.precision import GB, MB, GiB, KiB

LABELS = {
    "routed_experts": "routed experts",
    "kda_proj": "KDA projections",
    "kda_fp32": "KDA fp32 (conv, A_log, dt_bias, o_norm)",
    "mla_proj": "MLA projections",
    "shared_experts": "shared experts",
    "latent_down": "latent down projection",
    "latent_up": "latent up projection",
    "router": "router (+ fp32 bias)",
    "dense_mlp": "dense MLP",
    "embeddings": "embeddings + lm_head",
    "norms": "norms + AttnRes vectors",
    "draft": "draft model (bf16)",
}


def render_table(p: MemoryPlan) -> str:
    """The plan as aligned text: weights, cache per token and per request, budget, requests that fit, comm."""
    o, lay = p.options, p.options.layout
    lines = [
        f"tokenspeed plan: {p.model or 'model'} ({p.parameters:,} params), per GPU",
        f"layout: {lay.describe()}",
        f"weights: {o.precision.describe()}" + (f"; draft {o.draft}" if o.draft else ""),
        "",
        f"{'weights per GPU':44s}{'GB':>10s}{'GiB':>10s}",
    ]
    for name, value in p.weights.components.items():
        lines.append(f"  {LABELS.get(name, name):42s}{value / GB:10.3f}{value / GiB:10.3f}")
    lines.append(f"  {'total':42s}{p.weights.total / GB:10.3f}{p.weights.total / GiB:10.3f}")
    t, s = p.cache_token, p.kda_state
    lines += [
        "",
        f"cache per token ({o.kv_cache_dtype}, replicated per attention-TP rank): target {t.target:,} B"
        + (f" + draft {t.draft:,} B" if t.draft else "") + f" = {t.total:,} B ({t.total / KiB:.2f} KiB)",
        (f"KDA state per request ({s.heads} heads/GPU, conv {o.kda_conv_dtype}, recurrent {o.kda_state_dtype}): "
        f"conv {s.conv_per_layer:,} B + recurrent {s.recurrent_per_layer:,} B = {s.per_layer:,} B "
        f"({s.per_layer / KiB:.1f} KiB) per layer; {s.layers} layers = {s.per_request / MB:.1f} MB per copy"),
    ]
    if p.verify:
        v = p.verify
        lines += [
            f"speculative verify workspace ({v.seqs} seqs x {v.positions} positions x {v.layers} KDA layers):",
            f"  per-position snapshots {v.snapshot_bytes / GiB:8.3f} GiB  ({v.positions + 1} rows of {v.snapshot_row:,} B)",
            f"  replay                 {v.replay_bytes / GiB:8.3f} GiB  ({v.replay_token:,} B per token per layer)",
            f"  saved by replay        {(v.snapshot_bytes - v.replay_bytes) / GiB:8.3f} GiB; "
            f"using: {o.verify_mode}" + ("" if o.reserve_verify_workspace else " (inside the activation reserve)"),
        ]
    lines += [
        "",
        f"{'budget per GPU':44s}{'GB':>10s}",
        f"  {'GPU memory':42s}{p.gpu_memory / GB:10.3f}",
        f"  {'weights':42s}{-p.weights.total / GB:10.3f}",
        f"  {'activations, graphs, workspace':42s}{-p.activation / GB:10.3f}",
    ]
    if p.verify_reserved:
        lines.append(f"  {'verify workspace (' + o.verify_mode + ')':42s}{-p.verify_reserved / GB:10.3f}")
    pools, r = p.pools, p.request
    lines += [
        f"  {'left for KV and KDA cache':42s}{p.cache_budget / GB:10.3f}",
        "",
        (f"request of {r.context:,} tokens: {r.total / GB:.3f} GB = MLA {r.mla_bytes / GB:.3f} GB + "
        f"{o.kda_copies} KDA copies {r.kda_bytes / GB:.3f} GB (paged by {pools.page_size}: "
        f"{(-(-r.context // pools.page_size) * pools.bytes_per_page + r.kda_bytes) / GB:.3f} GB)"),
        (f"requests that fit: {p.requests_fit}  (pools: {pools.num_pages:,} pages = {pools.tokens:,} tokens, "
        f"{pools.num_state_slots:,} KDA state slots)"),
    ]
    if p.comm:
        c = p.comm
        lines += [
            "",
            f"communication per MoE layer, {c.local_tokens} local tokens/GPU on {c.gpus} GPUs (bytes sent per GPU):",
            f"  TEP all-reduces (widths {', '.join(map(str, c.tep_widths))}, bf16): {c.tep_bytes / MB:10.3f} MB",
            f"  DEP dispatch {o.dispatch_dtype} + combine bf16 at width {c.dep_width}, top-{c.top_k}:",
            f"    bound (every copy remote)             {c.dep_bound / MB:10.3f} MB",
            f"    expected ({c.expected_remote_ranks:.2f} remote ranks/token) {c.dep_expected / MB:10.3f} MB",
        ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def plan_to_dict(p: MemoryPlan) -> dict[str, Any]:
    """A JSON-ready dict: the plan's fields plus the derived totals (bytes)."""
    out = dataclasses.asdict(p)
    out["weights"]["total"] = p.weights.total
    out["cache_token"]["total"] = p.cache_token.total
    out["kda_state"].update(per_layer=p.kda_state.per_layer, per_request=p.kda_state.per_request)
    if p.verify:
        out["verify"].update(snapshot_bytes=p.verify.snapshot_bytes, replay_bytes=p.verify.replay_bytes)
    out["request"]["total"] = p.request.total
    out["pools"].update(total_bytes=p.pools.total_bytes, tokens=p.pools.tokens)
    if p.comm:
        out["comm"].update(dep_bound=p.comm.dep_bound, dep_expected=p.comm.dep_expected)
    out["requests_fit"] = p.requests_fit
    return out


def render_json(p: MemoryPlan) -> str:
    return json.dumps(plan_to_dict(p), indent=2)
