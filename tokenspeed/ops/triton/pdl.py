"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still running:
as soon as every program of that previous kernel has executed `griddepcontrol.launch_dependents`
(`gdc_launch_dependents()`) or exited. Its own `griddepcontrol.wait` (`gdc_wait()`) then blocks until the previous
kernel has completed and its memory is visible. What a kernel does before its wait overlaps the previous kernel's
tail; at batch 1 a decode step is a chain of ~400 latency-bound kernels, so this hides part of each launch and of
each first DRAM round trip.

The protocol every PDL kernel here follows (a kernel body takes `PDL: tl.constexpr`; the wrapper passes
`PDL=enabled(device)` and `**launch_kwargs(device)`):

1. Before `gdc_wait()` a program may only *read*, and only memory that no kernel of the last two launches wrote:
   weights, and state pools written only by this same op in an earlier step (KDA recurrent / conv state). Never
   anything the previous kernel produces (activations, routing ids, lengths copied in by a host-to-device copy
   just before) and never a write.
2. `gdc_launch_dependents()` comes after `gdc_wait()`, never before. Then, when any program of kernel N runs,
   kernel N-1 has passed its wait, so kernel N-2 has completed: that is what makes rule 1's "last two" safe, and
   it keeps completion ordered along the stream (the GEMV's shared split-K semaphores rely on that).
3. Every PDL kernel executes `gdc_wait()` on every path before it exits (a program with nothing to do still waits),
   so no later kernel can overtake an earlier one's writes.

Kernels launched without the attribute (torch, cuBLAS) start only after everything before them completed, so
they need nothing. In the Triton interpreter (CPU tests) and before Hopper, `enabled` is False: `PDL=False`
compiles the wait and the trigger away. `TOKENSPEED_PDL=0` turns PDL off everywhere (for A/B timing).

`kernel_kwargs(device)` gives both keywords from one decision ({"PDL": True, "launch_pdl": True} or
{"PDL": False}), so a launch can never get the attribute without the wait compiled in (a kernel launched as a
dependent that does not wait could read its input before the producer wrote it).
"""

from __future__ import annotations

import os

import torch

_capable: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: CUDA, compute capability >= 9, and
    TOKENSPEED_PDL not "0" (read on every call, so a benchmark can flip it between runs)."""
    if device.type != "cuda" or os.environ.get("TOKENSPEED_PDL", "1") == "0":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capable.get(idx)
    if ok is None:
        ok = _capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


def launch_kwargs(device: torch.device) -> dict[str, bool]:
    """The extra launch keyword for a Triton kernel on `device`: {"launch_pdl": True} when `enabled`, else {}."""
    return {"launch_pdl": True} if enabled(device) else {}


def kernel_kwargs(device: torch.device) -> dict[str, bool]:
    """The `PDL` constexpr and the launch keyword of a Triton kernel on `device`, from one `enabled` decision:
    {"PDL": True, "launch_pdl": True} or {"PDL": False} (a kernel is never launched as a dependent without its
    wait compiled in)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
