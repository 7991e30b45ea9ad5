#!/usr/bin/env bash
# Set up, then run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The GPU machine's Triton (3.6) beside the venv, for the offline sm_90 compile test of the Gluon kernel
# (tests/ops/test_gluon_sm90_compile.py; it skips when this is missing, e.g. without network).
[ -d .sm90/triton36/triton ] || .venv/bin/python -m pip install -q --no-deps --target .sm90/triton36 "triton==3.6.0" \
  || echo "note: Triton 3.6 not installed in .sm90/; the sm_90 compile test will skip"
.venv/bin/python -m pytest "$@"
