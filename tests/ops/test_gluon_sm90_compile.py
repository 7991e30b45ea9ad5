"""The Gluon MLA split kernel (`tokenspeed/ops/triton/mla_gluon.py`) compiled for sm_90 on this CPU host with the
Triton the GPU machine runs (3.6, which `scripts/test.sh` installs beside the venv in `.sm90/`; Triton 3.9's Gluon
API differs): every variant the model and K3 launch (`benchmarks/mla_gluon_h200.COMPILE_VARIANTS`: decode, verify,
12 to 96 heads, 64-row tiles, W_UV partials, small pages, fp8) builds, fits an H200's 227 KB of shared memory per
block, and its main loop reloads nothing from the spill stack. The numbers are checked on the GPU
(tests/ops/test_triton_mla_gluon.py); this catches, without one, an edit that breaks the build or makes it spill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_36 = ROOT / ".sm90" / "triton36"
SMEM_PER_BLOCK = 232448  # sm_90: 227 KB of dynamic shared memory per block


@pytest.mark.skipif(not (TRITON_36 / "triton").is_dir(), reason="Triton 3.6 not in .sm90/ (scripts/test.sh installs it)")
def test_gluon_mla_split_compiles_for_sm90_without_spills(tmp_path):
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON_36), str(ROOT / "benchmarks"), str(ROOT)])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mla_gluon_h200.py"), "--compile-sm90",
                          "--compile-json", str(report_path)], check=False, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert "decode H32" in report and "decode H32, fp8 cache" in report and len(report) >= 10
    for name, usage in report.items():
        assert usage["shared"] <= SMEM_PER_BLOCK, (name, usage)
        assert usage["loop_ins"] > 0, (name, usage)  # the 64-key loop was found in the SASS
        assert usage["loop_reloads"] == 0, (name, usage)
