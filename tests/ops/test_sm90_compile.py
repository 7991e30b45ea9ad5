"""Our GPU kernels compiled for sm_90 on this CPU host with the Triton the GPU machine runs (3.6, which
`scripts/test.sh` installs beside the venv in `.sm90/`; Triton 3.9's Gluon API differs). The numbers are checked on
the GPU; these catch, without one, an edit that breaks a build, makes it spill or breaks the PDL protocol.

- The Gluon MLA split kernel (`tokenspeed/ops/triton/mla_gluon.py`): every variant the model and K3 launch
  (`benchmarks/mla_gluon_h200.COMPILE_VARIANTS`: decode, verify, 12 to 96 heads, 64-row tiles, W_UV partials, small
  pages, fp8) builds, fits an H200's 227 KB of shared memory per block, and its main loop reloads nothing from the
  spill stack.
- The Gluon "smem" GEMV (`tokenspeed/ops/triton/gemv_smem.py`, `benchmarks/gemv_smem_compile_sm90.py`): every
  config the in-context sweep tries at kimi-linear's K (M 1, 2, 4) and K3's (M 1) builds within a block's shared
  memory, without spill reloads in its loop, with the weight copies before the PDL wait and x's loads after it.
- The Gluon KDA decode (`tokenspeed/ops/triton/kda_decode_gluon.py`, `benchmarks/kda_gluon_compile_sm90.py`): every
  tile width / buffer depth it is swept at builds within a block's shared memory, without spills, with the state
  copies before the PDL wait and the projections' loads after it.
- The Triton kernels, through the offline compile scripts in `benchmarks/` (each exits 1 when a variant fails to
  compile or a check fails: the PDL wait before any read and the trigger after it, the MLA loops' spill reloads,
  the MoE variants).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_36 = ROOT / ".sm90" / "triton36"
SMEM_PER_BLOCK = 232448  # sm_90: 227 KB of dynamic shared memory per block


needs_triton_36 = pytest.mark.skipif(not (TRITON_36 / "triton").is_dir(),
                                     reason="Triton 3.6 not in .sm90/ (scripts/test.sh installs it)")


def _run(script: str, *args: str, cache: Path) -> subprocess.CompletedProcess:
    """benchmarks/<script> under Triton 3.6 (first on the path), compiled for real (not the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON_36), str(ROOT / "benchmarks"), str(ROOT)])
    env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], check=False, env=env,
                          capture_output=True, text=True, timeout=900)


@needs_triton_36
def test_gluon_mla_split_compiles_for_sm90_without_spills(tmp_path):
    report_path = tmp_path / "report.json"
    run = _run("mla_gluon_h200.py", "--compile-sm90", "--compile-json", str(report_path), cache=tmp_path / "cache")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert "decode H32" in report and "decode H32, fp8 cache" in report and len(report) >= 10
    for name, usage in report.items():
        assert usage["shared"] <= SMEM_PER_BLOCK, (name, usage)
        assert usage["loop_ins"] > 0, (name, usage)  # the 64-key loop was found in the SASS
        # the warp-specialized fp8 kernel reloads a few scalars (barrier addresses, bounds) once an iteration
        assert usage["loop_reloads"] <= (8 if "warp-specialized" in name else 0), (name, usage)


@needs_triton_36
@pytest.mark.parametrize("script", ["mla_compile_sm90.py", "mla_ragged_compile_sm90.py", "kda_compile_sm90.py",
                                    "moe_compile_sm90.py", "moe_gate_compile_sm90.py", "pdl_compile_sm90.py",
                                    "gemv_smem_compile_sm90.py", "kda_gluon_compile_sm90.py"])
def test_triton_kernels_compile_for_sm90(tmp_path, script):
    run = _run(script, cache=tmp_path / "cache")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert re.search(r"^0 failed$", run.stdout, re.MULTILINE), run.stdout[-4000:]  # every variant was reported
