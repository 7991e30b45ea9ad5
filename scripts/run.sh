#!/usr/bin/env bash
# Set up, then run the main job. Until `tokenspeed serve` lands, the main job is a greedy generation through
# the engine-style forward (prefill + cached decode) on the built-in tiny-k3 model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/tokenspeed inspect tiny-k3
.venv/bin/tokenspeed generate tiny-k3 --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 16 "$@"
