#!/usr/bin/env bash
# One device call: GPU parity tests, then the serving and MLA-decode benchmarks (issue 7/8 figures).
#   bash benchmarks/h200_suite.sh [tests|serving|mla|all] [extra args for serving_h200.py]
# Expects $OUT (results folder) and the fla-core wheel in .whl/ (see docs/bench.md). Logs go to $OUT.
set -u
what=${1:-all}
shift || true
source benchmarks/gpu_env.sh
if [[ $what == all || $what == tests ]]; then
  timeout 300 python3 -m pytest -q --timeout 240 -p no:cacheprovider \
    tests/ops/test_triton_moe_experts.py tests/ops/test_triton_mla_decode.py tests/executor \
    tests/ops/test_triton_kda_decode.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
if [[ $what == all || $what == mla ]]; then
  timeout 120 python3 benchmarks/mla_decode_h200.py --out "$OUT/mla_decode_h200.json" 2>&1 | tail -40
fi
if [[ $what == all || $what == serving ]]; then
  python3 benchmarks/serving_h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/serving_h200.log" | tail -80
fi
