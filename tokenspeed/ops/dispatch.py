"""Which implementation a public `tokenspeed.ops` function runs: the Triton kernel or the torch reference.

Rule (decided per call, on the host only: no device synchronisation, so it is safe inside CUDA-graph capture):

- `TOKENSPEED_OPS=reference`: always the reference (`tokenspeed.ops.reference.*`).
- `TOKENSPEED_OPS=triton`: always the Triton kernel when the op has one and the call is in its supported region,
  whatever the device; CPU tensors then need `TRITON_INTERPRET=1` set before Triton is imported (tests use this).
- unset / `auto` (default): the Triton kernel when every tensor argument is on a CUDA device, Triton imports,
  and the call is in the kernel's supported region; otherwise the reference.

Kernel modules are imported on first use, so CPU-only processes never import Triton.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from tokenspeed.ops.kda_layers import LAYER_FIELDS, KdaLayerTable

ENV_VAR = "TOKENSPEED_OPS"
MODES = ("auto", "reference", "triton")

_modules: dict[str, ModuleType] = {}
_triton_ok: bool | None = None


def mode() -> str:
    """The current dispatch mode from TOKENSPEED_OPS ("auto" when unset); raises on an unknown value."""
    m = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV_VAR}={m!r}; expected one of {MODES}")
    return m


def triton_available() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401

            _triton_ok = True
        except Exception:  # pragma: no cover - depends on the install
            _triton_ok = False
    return _triton_ok


def use_triton(*tensors: Tensor | None) -> bool:
    """True when the call should take the Triton path (see the module docstring)."""
    m = mode()
    if m == "reference":
        return False
    if m == "triton":
        return triton_available()
    return all(t.is_cuda for t in tensors if t is not None) and triton_available()


def kernels(name: str) -> ModuleType:
    """The Triton kernel module `tokenspeed.ops.triton.<name>`, imported on first use."""
    mod = _modules.get(name)
    if mod is None:
        mod = importlib.import_module(f"tokenspeed.ops.triton.{name}")
        _modules[name] = mod
    return mod


def cuda_module(name: str) -> ModuleType:
    """The non-Triton CUDA path `tokenspeed.ops.cuda.<name>` (fla-core, fused SDPA), imported on first use."""
    key = f"cuda.{name}"
    mod = _modules.get(key)
    if mod is None:
        mod = importlib.import_module(f"tokenspeed.ops.cuda.{name}")
        _modules[key] = mod
    return mod


_fla_ok: bool | None = None


def fla_available() -> bool:
    global _fla_ok
    if _fla_ok is None:
        _fla_ok = cuda_module("kda_chunk").available()
    return _fla_ok


# Supported regions: calls outside them fall back to the reference even on CUDA.
MAX_NORM_DIM = 32768
MAX_EXPERTS = 8192


def norm_supported(x: Tensor) -> bool:
    return x.dim() >= 1 and 0 < x.shape[-1] <= MAX_NORM_DIM and x.is_floating_point()


def add_norm_supported(x: Tensor, residual: Tensor) -> bool:
    """Triton `add_rms_norm`: `norm_supported(x)` and a residual of x's shape and dtype (torch's `+` would promote
    mixed dtypes; those take the reference)."""
    return norm_supported(x) and residual.shape == x.shape and residual.dtype == x.dtype


ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def activation_supported(gate: Tensor, up: Tensor, act) -> bool:
    """Triton `gated_activation`: SiLU or SiTU, gate and up of one shape (>= 1 dim), 16-bit or fp32."""
    return act.kind in ("silu", "situ") and gate.dim() >= 1 and up.shape == gate.shape \
        and gate.dtype in ACTIVATION_DTYPES and up.dtype in ACTIVATION_DTYPES


def activation_merged_supported(gate_up: Tensor, act) -> bool:
    """Triton `gated_activation_merged`: `activation_supported` for the two halves of an even last dim."""
    return gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0 and activation_supported(gate_up, gate_up, act)


def attn_res_supported(blocks: Tensor, partial: Tensor) -> bool:
    return partial.dim() == 2 and blocks.dim() == 3 and 0 < partial.shape[-1] <= MAX_NORM_DIM \
        and blocks.shape[0] <= 31


def moe_route_supported(router_logits: Tensor, top_k: int, scoring: str) -> bool:
    return router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1] <= MAX_EXPERTS \
        and top_k <= 64 and scoring in ("sigmoid", "softmax")


def kda_decode_supported(qkv: Tensor, conv_weight: Tensor, dt_bias: Tensor) -> bool:
    d = dt_bias.shape[-1]
    return conv_weight.dim() == 2 and conv_weight.shape[1] == 4 and 16 <= d <= 128 \
        and qkv.stride(-1) == 1


def kda_replay_layers_unsupported(table: KdaLayerTable) -> str | None:
    """None when the one-launch Triton `kda_replay_layers` can run over `table`, else why not (the caller then
    launches per layer): uniform layers (an offset table, int64 [L, 8] on the layers' device), layer 0 in
    `kda_decode_supported`'s region, an fp32 contiguous conv weight, contiguous A_log [H] and dt_bias [H, D]."""
    if table.offsets is None:
        return table.reason or "no offset table"
    base = table.base
    if not kda_decode_supported(base.qkv, base.conv_weight, base.dt_bias):
        return "layer 0 is outside kda_decode's supported region"
    if base.conv_weight.dtype != torch.float32 or not base.conv_weight.is_contiguous():
        return "conv_weight must be fp32 and contiguous"
    if not (base.A_log.dim() == 1 and base.A_log.is_contiguous() and base.dt_bias.is_contiguous()):
        return "A_log [H] and dt_bias [H, D] must be contiguous"
    off = table.offsets
    if off.shape != (table.num_layers, len(LAYER_FIELDS)) or off.dtype != torch.int64 \
            or off.device != base.qkv.device or not off.is_contiguous():
        return "the offset table must be a contiguous int64 [L, 8] on the layers' device"
    return None


def moe_experts_supported(x: Tensor, w1: Tensor, act) -> bool:
    return x.dim() == 2 and w1.dim() == 3 and act.kind in ("silu", "situ") and x.dtype in (
        torch.bfloat16, torch.float16, torch.float32)


def mla_cache_supported(cache: Tensor, v_dim: int) -> bool:
    """Triton `mla_decode`'s cache: 3-D fp32 / bf16 / fp8 e4m3, rows <= 1024 wide, 0 < v_dim < row width."""
    return cache.dim() == 3 and 0 < v_dim < cache.shape[-1] <= 1024 and cache.dtype in (
        torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def mla_decode_supported(q: Tensor, cache: Tensor, v_dim: int, *, q_rope: Tensor | None = None,
                         cu_seqlens_q: Tensor | None = None) -> bool:
    """Triton `mla_decode`: a supported cache (`mla_cache_supported`); q 4-D, or 3-D [T, H, .] with cu_seqlens_q
    (ragged) on q's device; q the full row (or, with q_rope, q the first v_dim columns and q_rope the rest, of q's
    leading shape and dtype, on q's device)."""
    if not (q.dim() == (4 if cu_seqlens_q is None else 3) and mla_cache_supported(cache, v_dim)):
        return False
    if cu_seqlens_q is not None and cu_seqlens_q.device != q.device:
        return False
    if q_rope is None:
        return q.shape[-1] == cache.shape[-1]
    return q.shape[-1] == v_dim and q_rope.dim() == q.dim() and q_rope.shape[:-1] == q.shape[:-1] \
        and v_dim + q_rope.shape[-1] == cache.shape[-1] and q_rope.dtype == q.dtype and q_rope.device == q.device


def mla_norm_store_supported(kv_c: Tensor, k_pe: Tensor, weight: Tensor, cache: Tensor, slot_mapping: Tensor) -> bool:
    """Triton `mla_norm_store_latent`: 2-D kv_c / k_pe of one float dtype and row count with unit last strides, a
    [R] weight, a 3-D fp32 / bf16 / fp16 / fp8 e4m3 cache of rows R + DR with unit last stride, a [T] slot_mapping on
    the cache's device, R <= MAX_NORM_DIM."""
    return kv_c.dim() == 2 and k_pe.dim() == 2 and k_pe.shape[0] == kv_c.shape[0] and kv_c.dtype == k_pe.dtype \
        and kv_c.is_floating_point() and kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 \
        and 0 < kv_c.shape[1] <= MAX_NORM_DIM and weight.shape == (kv_c.shape[1],) and cache.dim() == 3 \
        and cache.shape[-1] == kv_c.shape[1] + k_pe.shape[1] and cache.stride(-1) == 1 \
        and cache.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn) \
        and slot_mapping.shape == (kv_c.shape[0],) and slot_mapping.device == cache.device


# Projections (`ops.linear`): the Triton GEMV (`tokenspeed.ops.triton.gemv`) only where the committed routing table
# says it beat torch (F.linear -> cuBLAS) on that shape; written by benchmarks/gemv_h200.py from cold-L2 timings.
LINEAR_TABLE_PATH = Path(__file__).with_name("gemv_table.json")
LINEAR_MAX_M = 16  # the GEMV kernel's limit (tokenspeed.ops.triton.gemv.MAX_M)
_LINEAR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class LinearTable:
    """The parsed routing table. routes[(N, K)]: ((m_bucket, launch config, or None for torch), ...) by m_bucket.

    An M is served by the smallest bucket >= M of its (N, K); no such bucket, or no (N, K) entry: torch.
    The table applies to the dtypes it was measured for (`dtypes`), other dtypes take torch.
    """

    dtypes: frozenset = frozenset()
    routes: dict = field(default_factory=dict)

    @property
    def max_m(self) -> int:
        return max((b[-1][0] for b in self.routes.values() if b), default=0)


def parse_linear_table(raw: dict[str, Any]) -> LinearTable:
    """Parse the JSON form: {"dtypes": [...], "entries": {"N,K": {"M": {"kernel": "triton"|"torch", ...}}}}.

    A "triton" entry's launch fields (kind, block_n, block_k, split_k, num_warps, num_stages, and reduce and
    programs_per_sm where present) become the config; other fields (timings) are ignored. Raises ValueError on a
    malformed key or kernel name.
    """
    launch = ("kind", "block_n", "block_k", "split_k", "num_warps", "num_stages", "reduce", "programs_per_sm")
    routes: dict[tuple[int, int], tuple] = {}
    for nk, per_m in raw.get("entries", {}).items():
        n, k = (int(v) for v in nk.split(","))
        buckets = []
        for m, e in per_m.items():
            if e.get("kernel") not in ("triton", "torch"):
                raise ValueError(f"gemv table {nk} M={m}: kernel must be 'triton' or 'torch'; got {e.get('kernel')!r}")
            cfg = {f: e[f] for f in launch if f in e} if e["kernel"] == "triton" else None
            buckets.append((int(m), cfg))
        routes[(n, k)] = tuple(sorted(buckets, key=lambda b: b[0]))
    dtypes = frozenset(_LINEAR_DTYPES[d] for d in raw.get("dtypes", ("bfloat16", "float16")))
    return LinearTable(dtypes, routes)


_linear_table: LinearTable | None = None


def linear_table() -> LinearTable:
    """The routing table, read once from LINEAR_TABLE_PATH (missing file: empty table, i.e. always torch)."""
    global _linear_table
    if _linear_table is None:
        raw = json.loads(LINEAR_TABLE_PATH.read_text()) if LINEAR_TABLE_PATH.is_file() else {}
        _linear_table = parse_linear_table(raw)
    return _linear_table


def set_linear_table(table: LinearTable | dict[str, Any] | None) -> None:
    """Replace the routing table in this process (a dict is parsed); None re-reads the packaged file on next use."""
    global _linear_table
    _linear_table = parse_linear_table(table) if isinstance(table, dict) else table


def linear_route(M: int, N: int, K: int, dtype: torch.dtype, table: LinearTable | None = None
                 ) -> dict[str, Any] | None:
    """The Triton launch config for an [M, K] x [N, K]^T projection, or None for torch (host-only lookup)."""
    table = linear_table() if table is None else table
    if dtype not in table.dtypes:
        return None
    for bucket, cfg in table.routes.get((N, K), ()):
        if M <= bucket:
            return cfg
    return None


def linear_supported(x: Tensor, weight: Tensor) -> bool:
    return x.dim() >= 2 and weight.dim() == 2 and x.shape[-1] == weight.shape[1] > 0 and weight.shape[0] > 0 \
        and x.dtype == weight.dtype and weight.stride(1) == 1 and x.device == weight.device


def linear_widens(x: Tensor, out_dtype: torch.dtype | None) -> bool:
    """True for a widening projection: fp32 output of 16-bit inputs (`ops.linear(..., out_dtype=torch.float32)`)."""
    return out_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)


def linear_config(x: Tensor, weight: Tensor, out_dtype: torch.dtype | None = None) -> dict[str, Any] | None:
    """The launch config when `ops.linear(x, weight, out_dtype=out_dtype)` should run the Triton GEMV, else None
    (host-only). Same-dtype output: the routing table decides. Widening (`linear_widens`, the MoE routers): the
    table's entry for (M bucket, N, K) where there is one (measured with 16-bit outputs; the kernel's fp32 store
    of M x N values costs the same), else `{}`, i.e. the GEMV's `default_config`. The torch alternative, cuBLAS
    with fp32 output, is not in the table; in a kimi-linear decode step it took 5.5 us for the [256, 2304] router
    (1.2 MB), against ~4 us for the table's bf16 GEMV of that shape (benchmarks/gemv_h200.py times the pair)."""
    if not (use_triton(x, weight) and linear_supported(x, weight)):
        return None
    M = x.numel() // x.shape[-1]
    if not 1 <= M <= LINEAR_MAX_M:
        return None
    N, K = weight.shape
    if out_dtype is None or out_dtype == x.dtype:
        return linear_route(M, N, K, x.dtype)
    if not linear_widens(x, out_dtype):
        return None
    table = linear_table()
    measured = x.dtype in table.dtypes and any(M <= b for b, _ in table.routes.get((N, K), ()))
    return linear_route(M, N, K, x.dtype, table) if measured else {}


def conv_supported(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor, cu_seqlens: Tensor,
                   activation: str | None) -> bool:
    """Triton `causal_conv1d` region: 2-D float x with unit column stride, 1 <= W <= 4, activation silu / None,
    and the index tensors on x's device (the kernel reads them there)."""
    return x.dim() == 2 and x.stride(1) == 1 and x.is_floating_point() and weight.dim() == 2 \
        and 1 <= weight.shape[1] <= 4 and conv_state.dim() == 3 and activation in ("silu", None) \
        and state_indices.device == x.device and cu_seqlens.device == x.device


def kda_fused_chunk_supported(v: Tensor, lower_bound: float | None) -> bool:
    """fla's fused-gate chunk path: half-precision serving dtypes only (fp32 runs are for validation and keep the
    composed fp32 path), head dims fla's fused kernels were checked at (32..256, multiples of 16), and a bounded
    gate inside fla's safe range [-5, 0)."""
    d = v.shape[-1]
    return (v.dtype in (torch.bfloat16, torch.float16) and 32 <= d <= 256 and d % 16 == 0
            and (lower_bound is None or -5.0 <= lower_bound < 0.0))
