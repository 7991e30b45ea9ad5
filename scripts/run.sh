#!/usr/bin/env bash
# Set up, then serve the built-in default model (OpenAI-compatible, http://127.0.0.1:8000). Extra arguments go
# to `tokenspeed serve`, e.g. `scripts/run.sh --port 9000` or `scripts/run.sh tiny-kimi-linear`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/tokenspeed serve "$@"
