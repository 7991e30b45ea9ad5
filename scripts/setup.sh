#!/usr/bin/env bash
# Create .venv and install TokenSpeed with its test dependencies (idempotent).
# torch is pinned to 2.13.0 first: on this project's machines that is the local CPU build (a bare `torch`
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
