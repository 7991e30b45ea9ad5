#!/usr/bin/env bash
# Set up, then run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest "$@"
