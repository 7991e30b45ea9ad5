"""Memory and capacity planner: weight, cache and state bytes per GPU from a model config (no weights needed).

    from tokenspeed.models import resolve_config
    from tokenspeed.plan import ParallelLayout, PlanOptions, WeightPrecision, plan, render_table
    config, _ = resolve_config("kimi-k3")
    p = plan(config, PlanOptions(ParallelLayout(attn_dp=16, moe_ep=16), WeightPrecision.parse("nvfp4")))
    print(render_table(p))

The engine sizes its cache pools with `plan_cache_pools` (one source of truth). Formulas: docs/plan.md.
"""

from tokenspeed.plan.cache import (
    KdaStateBytes,
    MlaTokenBytes,
    RequestCache,
    VerifyWorkspace,
    kda_state_bytes,
    mla_bytes_per_token,
    replay_bytes_per_token,
    request_cache_bytes,
    verify_workspace,
)
from tokenspeed.plan.comm import LayerComm, expected_remote_ranks, layer_comm
from tokenspeed.plan.draft import Eagle3Draft, draft_spec
from tokenspeed.plan.layout import ParallelLayout
from tokenspeed.plan.planner import CachePools, MemoryPlan, PlanOptions, plan, plan_cache_pools
from tokenspeed.plan.precision import WEIGHT_FORMATS, WeightFormat
from tokenspeed.plan.render import plan_to_dict, render_json, render_table
from tokenspeed.plan.weights import (
    PRECISION_PRESETS,
    TensorSpec,
    WeightBreakdown,
    WeightPrecision,
    parameter_count,
    weight_bytes,
    weight_tensors,
)

__all__ = [
    "PRECISION_PRESETS",
    "WEIGHT_FORMATS",
    "CachePools",
    "Eagle3Draft",
    "KdaStateBytes",
    "LayerComm",
    "MemoryPlan",
    "MlaTokenBytes",
    "ParallelLayout",
    "PlanOptions",
    "RequestCache",
    "TensorSpec",
    "VerifyWorkspace",
    "WeightBreakdown",
    "WeightFormat",
    "WeightPrecision",
    "draft_spec",
    "expected_remote_ranks",
    "kda_state_bytes",
    "layer_comm",
    "mla_bytes_per_token",
    "parameter_count",
    "plan",
    "plan_cache_pools",
    "plan_to_dict",
    "render_json",
    "render_table",
    "replay_bytes_per_token",
    "request_cache_bytes",
    "verify_workspace",
    "weight_bytes",
    "weight_tensors",
]
