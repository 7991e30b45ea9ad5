"""Deterministic workload generators of workloads.md, the ideal prefix hit of a trace, Mooncake JSONL in and out.

    trace = build("swe-smith-like", scale=0.01)            # or agentx-like, random, shared-prefix
    ideal_hit(trace, "live").ratio()                         # block-level, infinite cache
    export_jsonl(trace, "t.jsonl"); import_jsonl("t.jsonl")
"""

from __future__ import annotations

import gc
from dataclasses import fields, replace
from typing import Any

import numpy as np

from tokenspeed.bench.workloads import agentx, simple, swe_smith
from tokenspeed.bench.workloads.mooncake import export_jsonl, import_jsonl
from tokenspeed.bench.workloads.prefix import PrefixTrie, ideal_hit
from tokenspeed.bench.workloads.synth import TokenSynth
from tokenspeed.bench.workloads.trace import Conversation, Session, Spawn, Trace, Turn, prompt_lengths

WORKLOADS: dict[str, tuple[type, Any]] = {
    "swe-smith-like": (swe_smith.SweSmithParams, swe_smith.generate),
    "agentx-like": (agentx.AgentXParams, agentx.generate),
    "random": (simple.RandomParams, simple.generate_random),
    "shared-prefix": (simple.SharedPrefixParams, simple.generate_shared_prefix),
}

__all__ = ["WORKLOADS", "build", "default_params", "describe", "export_jsonl", "import_jsonl", "ideal_hit",
           "PrefixTrie", "TokenSynth", "Trace", "Session", "Conversation", "Turn", "Spawn", "prompt_lengths"]


def default_params(name: str):
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name][0]()


def build(name: str, scale: float = 1.0, **overrides: Any) -> Trace:
    """Generate a workload; `overrides` replace fields of its parameter dataclass (None values are ignored)."""
    params = default_params(name)
    known = {f.name for f in fields(params)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"{name} has no parameter(s) {sorted(unknown)}")
    params = replace(params, **{k: v for k, v in overrides.items() if v is not None})
    if scale <= 0:
        raise ValueError(f"--scale must be > 0, not {scale}")
    enabled = gc.isenabled()
    gc.disable()  # hundreds of thousands of small frozen objects, no cycles: the cyclic GC only costs time here
    try:
        return WORKLOADS[name][1](params, scale)
    finally:
        if enabled:
            gc.enable()


def describe(trace: Trace, with_ideal: bool = True) -> dict:
    """Request counts by kind, prompt/output lengths (tokens, replay history), spawn counts, ideal hits."""
    isl, osl, kinds = [], [], {}
    spawn_events = spawns = blocking = 0
    for s in trace.sessions:
        for conv in s.convs:
            isl += prompt_lengths(conv)
            for t in conv.turns:
                osl.append(t.output_len)
                kinds[t.kind] = kinds.get(t.kind, 0) + 1
                sub = [sp for sp in t.spawns if sp.at_end]
                spawn_events += bool(sub)
                spawns += len(sub)
                blocking += bool(sub) and sub[0].blocking
    isl_a, osl_a = np.asarray(isl or [0]), np.asarray(osl or [0])
    out = {"workload": trace.name, "scale": trace.scale, "seed": trace.seed, "block_size": trace.block_size,
           "sessions": len(trace.sessions), "requests": len(isl), "requests_by_kind": kinds,
           "root_turns_mean": float(np.mean([len(s.root.turns) for s in trace.sessions])) if trace.sessions else 0.0,
           "isl_mean": float(isl_a.mean()), "isl_p50": float(np.median(isl_a)), "isl_max": int(isl_a.max()),
           "osl_mean": float(osl_a.mean()), "osl_max": int(osl_a.max()),
           "spawn_events": spawn_events, "subagents": spawns, "blocking_spawn_events": blocking}
    if with_ideal:
        out["ideal_hit_replay"] = ideal_hit(trace, "replay").as_dict()
        out["ideal_hit_live"] = ideal_hit(trace, "live").as_dict()
    return out
