"""What every Triton kernel test module shares. Import it before anything that imports Triton.

Without CUDA it turns on the Triton CPU interpreter (fp32 only; it must be set before the first `import triton`),
and it skips the importing module when Triton is missing.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INTERP = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERP, reason="needs the Triton CPU interpreter (set before triton import)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp64; NaN anywhere in `a` (an output element left unwritten) fails."""
    assert not torch.isnan(a).any(), "output element not written (NaN poison left)"
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
