"""What the Gluon kernels (`mla_gluon`, `gemv_smem`) share: the Triton releases their Gluon code was built and
measured with, the check that a device can run them, and the wait-then-trigger step of the PDL protocol of
`tokenspeed.ops.triton.pdl` as inline PTX (Gluon has no `gdc_wait` of its own)."""

from __future__ import annotations

import torch
import triton

try:  # Gluon's API changes between Triton releases: `hopper` is False outside TRITON_VERSIONS (and off CUDA)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

# Triton releases the Gluon kernels were built and measured with (major.minor): the GPU machine's 3.6, torch 2.11's
# pin. Triton 3.9 renamed `thread_barrier` and removed `async_copy_global_to_shared`; elsewhere the callers keep
# their Triton kernels.
TRITON_VERSIONS = ("3.6",)

_HOPPER: dict[int, bool] = {}


def hopper(device: torch.device) -> bool:
    """Gluon of TRITON_VERSIONS importable and `device` an sm_90 GPU (wgmma and the kernels' layouts), cached per
    device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _HOPPER.get(idx)
    if ok is None:
        ok = _HOPPER[idx] = (gluon is not None and triton.__version__.rsplit(".", 1)[0] in TRITON_VERSIONS
                             and torch.cuda.get_device_capability(idx) == (9, 0))
    return ok


if gluon is not None:

    @gluon.jit
    def grid_dependency(x):
        """griddepcontrol.wait (the previous kernel completed, its memory visible), then launch_dependents
        (x: any scalar, the asm's dummy operand)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [x], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [x], dtype=gl.int32,
                                  is_pure=False, pack=1)
