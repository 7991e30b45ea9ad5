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
import os
from types import ModuleType

import torch
from torch import Tensor

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


def attn_res_supported(blocks: Tensor, partial: Tensor) -> bool:
    return partial.dim() == 2 and blocks.dim() == 3 and 0 < partial.shape[-1] <= MAX_NORM_DIM \
        and blocks.shape[0] <= 31


def moe_route_supported(router_logits: Tensor, top_k: int, scoring: str) -> bool:
    return router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1] <= MAX_EXPERTS \
        and top_k <= 64 and scoring in ("sigmoid", "softmax")


def kda_decode_supported(qkv: Tensor, conv_weight: Tensor, dt_bias: Tensor) -> bool:
    d = dt_bias.shape[-1]
    return conv_weight.dim() == 2 and conv_weight.shape[1] == 4 and d & (d - 1) == 0 and 16 <= d <= 128 \
        and qkv.stride(-1) == 1


def moe_experts_supported(x: Tensor, w1: Tensor, act) -> bool:
    return x.dim() == 2 and w1.dim() == 3 and act.kind in ("silu", "situ") and x.dtype in (
        torch.bfloat16, torch.float16, torch.float32)


def mla_decode_supported(q: Tensor, cache: Tensor, v_dim: int) -> bool:
    return q.dim() == 4 and cache.dim() == 3 and 0 < v_dim < cache.shape[-1] <= 1024 and q.shape[-1] == cache.shape[-1]
