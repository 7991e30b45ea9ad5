"""Sizing the cache pools from a byte budget (CPU) or the free device memory (GPU), and logging the plan."""

from __future__ import annotations

import gc
import logging

import torch

from tokenspeed.cache import CachePlan
from tokenspeed.config import CacheConfig, SchedulerConfig
from tokenspeed.errors import ConfigError
from tokenspeed.models import KimiConfig
from tokenspeed.plan.planner import plan_cache_pools

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The model dtype: "auto" is float32 on the CPU and bfloat16 on a GPU."""
    if name == "auto":
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    return _DTYPES[name]


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    return _DTYPES[name]


def _plan_name(dtype: torch.dtype) -> str:
    """The planner's dtype name of a torch dtype (fp8 e4m3, bf16, fp32; fp16 counts as bf16: same bytes)."""
    return {torch.float8_e4m3fn: "fp8", torch.float32: "fp32"}.get(dtype, "bf16")


def _budget_bytes(cache: CacheConfig, device: str) -> int:
    if str(device).startswith("cuda"):
        # Memory an engine deleted earlier in this process left in torch's caching allocator is free to us, but
        # the driver counts it as used until it is handed back.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        return int(total * cache.gpu_memory_utilization) - used
    return int(cache.cache_memory_gb * 2**30)


def plan_cache(
    config: KimiConfig,
    cache: CacheConfig,
    sched: SchedulerConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: str,
) -> CachePlan:
    """Live slots for max_num_seqs, checkpoint slots (default 2 per sequence), the rest of the budget in pages.

    The split is the planner's (`tokenspeed.plan.plan_cache_pools`), so `tokenspeed plan` and the engine agree.
    """
    needs_state = bool(config.kda_layers)
    checkpoints = cache.num_checkpoint_slots if cache.num_checkpoint_slots is not None else 2 * sched.max_num_seqs
    num_slots = (sched.max_num_seqs + checkpoints) if needs_state else 0
    budget = _budget_bytes(cache, device)
    pools = plan_cache_pools(
        config, budget, cache.page_size, state_slots=num_slots, kv_cache_dtype=_plan_name(kv_dtype),
        kda_conv_dtype=_plan_name(dtype), kda_state_dtype="fp32",
    )
    per_page, per_slot = pools.bytes_per_page, pools.bytes_per_state_slot
    num_pages = pools.num_pages
    if cache.num_pages is not None:
        num_pages = cache.num_pages
    chunk = min(sched.chunked_prefill_size, sched.max_num_batched_tokens)
    min_pages = -(-chunk // cache.page_size) + 1
    if num_pages < min_pages:
        if cache.num_pages is not None:
            where = f"num_pages={cache.num_pages} is"
            fix = "raise num_pages"
        else:
            where = (f"the cache budget ({budget / 2**30:.3f} GiB) leaves {max(num_pages, 0)} pages after "
                     f"{num_slots} KDA state slots of {per_slot / 2**20:.1f} MiB,")
            fix = "raise cache_memory_gb / gpu_memory_utilization, lower max_num_seqs / num_checkpoint_slots"
        raise ConfigError(
            f"{where} fewer than one {chunk}-token prefill chunk needs ({min_pages} pages of {cache.page_size} "
            f"tokens); {fix}, or lower chunked_prefill_size / max_num_batched_tokens"
        )
    plan = CachePlan(int(num_pages), cache.page_size, num_slots, cache.enable_prefix_caching, needs_state)
    logger.info(
        "cache plan: %d pages x %d tokens = %d tokens (%.1f KiB/token), %d sequences, %d checkpoints (%.1f MiB/slot)",
        plan.num_pages, plan.page_size, plan.num_pages * plan.page_size, per_page / plan.page_size / 1024,
        sched.max_num_seqs, checkpoints if needs_state else 0, per_slot / 2**20,
    )
    return plan
