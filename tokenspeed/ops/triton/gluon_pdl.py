"""Programmatic dependent launch for the Gluon kernels (`mla_gluon`, `gemv_smem`): the wait-then-trigger step of
the protocol in `tokenspeed.ops.triton.pdl`, as inline PTX (Gluon has no `gdc_wait` of its own)."""

from __future__ import annotations

try:  # Gluon's API changes between Triton releases; its users check the version before launching
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

if gluon is not None:

    @gluon.jit
    def grid_dependency(x):
        """griddepcontrol.wait (the previous kernel completed, its memory visible), then launch_dependents
        (x: any scalar, the asm's dummy operand)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [x], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [x], dtype=gl.int32,
                                  is_pure=False, pack=1)
