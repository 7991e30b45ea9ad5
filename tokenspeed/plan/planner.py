"""The memory plan of one GPU: weights, reserves, the cache budget, and the cache pools it buys.

    budget = GPU memory - weights (target + draft) - activation reserve - verify workspace (if reserved)
    request = ceil(context / page) pages x page bytes + kda_copies x KDA state copy
    requests that fit = floor(budget / request)

`plan_cache_pools` is the one function that turns a byte budget into MLA pages and KDA state slots. `plan` uses
it for the CLI; the engine must size its own cache pools with it too, so the plan is what the server does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.errors import ConfigError
from tokenspeed.models.config import KimiConfig
from tokenspeed.plan.cache import (
    KdaStateBytes,
    MlaTokenBytes,
    RequestCache,
    VerifyWorkspace,
    kda_state_bytes,
    mla_bytes_per_token,
    request_cache_bytes,
    verify_workspace,
)
from tokenspeed.plan.comm import LayerComm, layer_comm
from tokenspeed.plan.draft import Eagle3Draft, draft_spec
from tokenspeed.plan.layout import ParallelLayout
from tokenspeed.plan.precision import GB, KDA_STATE_DTYPES, KV_CACHE_DTYPES
from tokenspeed.plan.weights import WeightBreakdown, WeightPrecision, parameter_count, weight_bytes

VERIFY_MODES = ("replay", "snapshot")


@dataclass(frozen=True)
class PlanOptions:
    """Everything `plan` needs besides the model config. Sizes in GB are decimal (1e9 bytes)."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    precision: WeightPrecision = field(default_factory=WeightPrecision)
    gpu_memory_gb: float = 288.0
    activation_gb: float = 40.0  # activations, CUDA graphs and other workspace
    kv_cache_dtype: str = "bf16"
    kda_conv_dtype: str = "bf16"
    kda_state_dtype: str = "fp32"
    kda_copies: int = 2  # KDA state copies per request (live page + checkpoint)
    draft: str | None = None  # "eagle3" or None
    spec_positions: int = 4  # tokens verified per request per step (with a draft)
    max_num_seqs: int = 64  # requests decoded together (verify workspace, default comm batch)
    context: int = 200_000  # tokens per request for "requests that fit"
    page_size: int = 128
    verify_mode: str = "replay"
    reserve_verify_workspace: bool = True  # False: the activation reserve already covers it
    local_tokens: int | None = None  # tokens per GPU per forward for comm; None: max_num_seqs x positions
    dispatch_dtype: str = "nvfp4"  # EP dispatch transport
    a_log_width: int | None = None  # stored A_log length (128 for the K3 checkpoint); None: one per head

    def __post_init__(self) -> None:
        checks = [
            (self.kv_cache_dtype in KV_CACHE_DTYPES, f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}"),
            (self.kda_state_dtype in KDA_STATE_DTYPES, f"--kda-state-dtype must be one of {KDA_STATE_DTYPES}"),
            (self.verify_mode in VERIFY_MODES, f"--verify-mode must be one of {VERIFY_MODES}"),
            (self.gpu_memory_gb > 0, "--gpu-memory-gb must be > 0"),
            (self.activation_gb >= 0, "--activation-gb must be >= 0"),
            (self.spec_positions >= 1, "--spec-positions must be >= 1 (the tokens verified per step)"),
            (self.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
            (self.context >= 1, "--context must be >= 1 token"),
            (self.page_size >= 1, "--page-size must be >= 1"),
            (self.kda_copies >= 1, "--kda-copies must be >= 1 (the live state)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        draft_spec(self.draft)

    @property
    def verify_positions(self) -> int:
        """Tokens verified per request per step: spec_positions with a draft, else 1 (plain decode)."""
        return self.spec_positions if self.draft else 1


@dataclass(frozen=True)
class CachePools:
    """Cache pools of one GPU: MLA latent pages (target and draft layers share page ids) and KDA state slots."""

    page_size: int
    num_pages: int
    num_state_slots: int  # one slot = one copy of every KDA layer's conv + recurrent state
    requests: int  # requests of `context` tokens (with kda_copies slots each) the pools hold
    context: int
    bytes_per_page: int
    bytes_per_state_slot: int

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_state_slots * self.bytes_per_state_slot

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size


def plan_cache_pools(
    config: KimiConfig,
    budget_bytes: int,
    page_size: int = 128,
    *,
    state_slots: int | None = None,
    context: int | None = None,
    kda_copies: int = 2,
    attn_tp: int = 1,
    kv_cache_dtype: str = "bf16",
    kda_conv_dtype: str = "bf16",
    kda_state_dtype: str = "fp32",
    draft: Eagle3Draft | None = None,
) -> CachePools:
    """Split a byte budget of one GPU into MLA pages and KDA state slots.

    - `state_slots` given (the engine: max_num_seqs live slots + checkpoint slots): those slots first, the rest
      of the budget in pages.
    - otherwise `context` tokens per request: as many whole requests as fit (ceil(context / page_size) pages and
      `kda_copies` slots each), the bytes left after the last one in extra pages.
    `requests` is how many `context`-token requests the pools hold (0 without a context). A model without KDA
    layers gets no slots. A negative budget gives empty pools.
    """
    if state_slots is None and context is None:
        raise ConfigError("plan_cache_pools needs state_slots (engine sizing) or context (requests that fit)")
    token = mla_bytes_per_token(config, kv_cache_dtype, draft).total
    slot = kda_state_bytes(config, attn_tp, kda_conv_dtype, kda_state_dtype).per_request
    page = page_size * token
    copies = kda_copies if slot else 0
    budget = max(int(budget_bytes), 0)
    pages_per_request = -(-context // page_size) if context else 0
    if state_slots is None:
        per_request = pages_per_request * page + copies * slot
        slots = (budget // per_request if per_request else 0) * copies
    else:
        slots = state_slots if slot else 0
    pages = max(budget - slots * slot, 0) // page if page else 0
    requests = 0
    if context:
        requests = pages // pages_per_request
        if copies:
            requests = min(requests, slots // copies)
    return CachePools(page_size, pages, slots, requests, context or 0, page, slot)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan for one GPU (bytes unless stated)."""

    model: str
    options: PlanOptions
    parameters: int  # whole text model (not per GPU)
    weights: WeightBreakdown  # per GPU, by component ('draft' included)
    cache_token: MlaTokenBytes
    kda_state: KdaStateBytes
    verify: VerifyWorkspace | None  # None without a draft
    request: RequestCache  # exact (unpaged) bytes of one request of `context` tokens
    gpu_memory: int
    activation: int
    verify_reserved: int
    cache_budget: int  # may be negative: the weights do not fit
    pools: CachePools
    comm: LayerComm | None  # None for a model without routed experts
    notes: tuple[str, ...] = ()

    @property
    def requests_fit(self) -> int:
        return self.pools.requests


def plan(config: KimiConfig, options: PlanOptions | None = None, model: str = "") -> MemoryPlan:
    """Plan one GPU of `config` under `options` (see the module docstring)."""
    o = options or PlanOptions()
    lay = o.layout
    draft = draft_spec(o.draft)
    weights = weight_bytes(config, lay, o.precision, a_log_width=o.a_log_width,
                           extra=draft.tensors(config) if draft else None)
    token = mla_bytes_per_token(config, o.kv_cache_dtype, draft)
    state = kda_state_bytes(config, lay.attn_tp, o.kda_conv_dtype, o.kda_state_dtype)
    verify = (verify_workspace(config, lay.attn_tp, o.max_num_seqs, o.spec_positions, o.kda_conv_dtype,
                               o.kda_state_dtype) if draft else None)
    reserved = verify.bytes(o.verify_mode) if verify and o.reserve_verify_workspace else 0
    gpu, act = round(o.gpu_memory_gb * GB), round(o.activation_gb * GB)
    budget = gpu - weights.total - act - reserved
    pools = plan_cache_pools(config, budget, o.page_size, context=o.context, attn_tp=lay.attn_tp,
                             kv_cache_dtype=o.kv_cache_dtype, kda_conv_dtype=o.kda_conv_dtype,
                             kda_state_dtype=o.kda_state_dtype, kda_copies=o.kda_copies, draft=draft)
    comm = None
    if config.num_experts is not None:
        tokens = o.local_tokens or o.max_num_seqs * o.verify_positions
        comm = layer_comm(config, tokens, lay.world_size, o.dispatch_dtype)
    notes = []
    if budget < 0:
        notes.append(f"does not fit: weights and reserves exceed the GPU by {-budget / GB:.2f} GB; shard the "
                     "experts wider (--moe-ep/--moe-tp), quantize (--weights-dtype nvfp4), or use --tp-subgroup")
    elif pools.requests == 0:
        notes.append(f"the {budget / GB:.2f} GB left cannot hold one {o.context:,}-token request")
    return MemoryPlan(
        model=model, options=o, parameters=parameter_count(config, o.a_log_width), weights=weights,
        cache_token=token, kda_state=state, verify=verify,
        request=request_cache_bytes(o.context, token, state, o.kda_copies), gpu_memory=gpu, activation=act,
        verify_reserved=reserved, cache_budget=budget, pools=pools, comm=comm, notes=tuple(notes),
    )
