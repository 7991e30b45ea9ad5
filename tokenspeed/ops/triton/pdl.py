"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still running:
as soon as every program of that previous kernel has executed `griddepcontrol.launch_dependents`
(`gdc_launch_dependents()`) or exited. Its own `griddepcontrol.wait` (`gdc_wait()`) then blocks until the previous
kernel has completed and its memory is visible. What a kernel does before its wait overlaps the previous kernel's
tail; at batch 1 a decode step is a chain of ~400 latency-bound kernels, so this hides part of each launch and of
each first DRAM round trip.

The protocol every PDL kernel here follows (a kernel body takes `PDL: tl.constexpr`; the wrapper passes
`PDL=enabled(device)` and `**launch_kwargs(device)`):

1. Before `gdc_wait()` a program may only *read*, and only memory that the launch right before it did not write
   (rule 2 makes everything older complete): weights, state pools written only by this same op in an earlier
   step (KDA recurrent / conv state), routing ids two launches back (the MoE down projection). Never anything the
   previous kernel produces and never a write. Data that some kernel wrote is read through L2 (`.cg`): an SM's L1
   may still hold a line from before that write.
2. `gdc_launch_dependents()` comes after `gdc_wait()`, never before. Then, when any program of kernel N runs,
   kernel N-1 has passed its wait, so kernel N-2 has completed: that is what makes rule 1's "last two" safe, and
   it keeps completion ordered along the stream (the GEMV's shared split-K semaphores rely on that).
3. Every PDL kernel executes `gdc_wait()` on every path before it exits (a program with nothing to do still waits),
   so no later kernel can overtake an earlier one's writes.

Kernels launched without the attribute (torch, cuBLAS) start only after everything before them completed, so
they need nothing. In the Triton interpreter (CPU tests) and before Hopper, `enabled` is False: `PDL=False`
compiles the wait and the trigger away.

`TOKENSPEED_PDL` (read on every call, so a benchmark can flip it between captures): unset or "1", every family;
"0", none; otherwise a comma list of op families (`FAMILIES`): "gemv,moe" enables only those, "-mla,-kda" all but
those. Each wrapper names its family, so PDL can be measured and kept per family.

`kernel_kwargs(device)` gives both keywords from one decision ({"PDL": True, "launch_pdl": True} or
{"PDL": False}), so a launch can never get the attribute without the wait compiled in (a kernel launched as a
dependent that does not wait could read its input before the producer wrote it).
"""

from __future__ import annotations

import os

import torch

_capable: dict[int, bool] = {}
FAMILIES = ("gemv", "norm", "act", "conv", "attn_res", "moe", "mla", "kda")


def family_on(family: str, setting: str) -> bool:
    """Whether `family` is enabled by a TOKENSPEED_PDL value (see the module docstring). Raises ValueError on an
    unknown family name, so a typo in an A/B run cannot silently measure the wrong thing."""
    setting = setting.strip()
    if setting in ("", "1"):
        return True
    if setting == "0":
        return False
    items = [x.strip() for x in setting.split(",") if x.strip()]
    for item in items:
        if item.lstrip("-") not in FAMILIES:
            raise ValueError(f"TOKENSPEED_PDL: unknown family {item!r}; families: {', '.join(FAMILIES)}")
    excluded = {x[1:] for x in items if x.startswith("-")}
    included = {x for x in items if not x.startswith("-")}
    return family not in excluded and (not included or family in included)


def enabled(device: torch.device, family: str = "") -> bool:
    """Whether kernels of `family` on `device` launch as programmatic dependents: CUDA, compute capability >= 9,
    and TOKENSPEED_PDL enables the family ("" = any family: on unless TOKENSPEED_PDL is "0")."""
    if device.type != "cuda":
        return False
    setting = os.environ.get("TOKENSPEED_PDL", "1")
    if setting.strip() == "0" or (family and not family_on(family, setting)):
        return False
    return hopper(device)


def hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability >= 9 (griddepcontrol, bulk L2 prefetch), cached per device."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capable.get(idx)
    if ok is None:
        ok = _capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


L2_PREFETCH_KINDS = ("gate_up", "down")


def l2_prefetch_on(kind: str = "") -> bool:
    """Whether the MoE experts' kernels issue L2 prefetches of their weight rows before their wait: gate_up's of a
    named expert (the folded shared expert's W1 / W3), down's of its experts' W2 rows. TOKENSPEED_L2_PREFETCH: "0"
    or unset, none (the default: on an H200 decode step of kimi-linear-48b-a3b, PDL on, both together made the step
    slower, 3.092 vs 2.905 ms at batch 1 and 18.62 vs 17.29 ms at batch 64,
    benchmarks/results/step_profile_h200_dfb6cb1.json; one at a time each loses too, down x0.965 / 0.939 / 0.941
    and gate_up x0.961 / 0.986 / 0.990 at batch 1 / 4 / 16, step_profile_h200_0260e38_moe_l2_prefetch_ab.json);
    "1", both; "gate_up" or "down", that one only (for A/B).
    `kind` "" asks whether any is on. The GEMV's mode has its own setting (TOKENSPEED_GEMV_PREFETCH). Raises
    ValueError on another value."""
    v = os.environ.get("TOKENSPEED_L2_PREFETCH", "0").strip() or "0"
    if v not in ("0", "1", *L2_PREFETCH_KINDS):
        raise ValueError(f"TOKENSPEED_L2_PREFETCH must be 0, 1, gate_up or down; got {v!r}")
    return v == "1" or (v != "0" and (not kind or v == kind))


def launch_kwargs(device: torch.device, family: str = "") -> dict[str, bool]:
    """The extra launch keyword for a Triton kernel on `device`: {"launch_pdl": True} when `enabled`, else {}."""
    return {"launch_pdl": True} if enabled(device, family) else {}


def kernel_kwargs(device: torch.device, family: str = "") -> dict[str, bool]:
    """The `PDL` constexpr and the launch keyword of a Triton kernel on `device`, from one `enabled` decision:
    {"PDL": True, "launch_pdl": True} or {"PDL": False} (a kernel is never launched as a dependent without its
    wait compiled in)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device, family) else {"PDL": False}
