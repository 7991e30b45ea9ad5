#!/usr/bin/env bash
# One device call for this round of issue 7/8/9 work: GPU parity tests, then the kernel and serving benchmarks.
#   bash benchmarks/h200_session.sh "tests moe spec gemv conv profile prefill decode engine"   (any subset, in this order)
# Env: TESTS (test paths), TESTS_TIMEOUT, GEMV_ARGS, PROFILE_ARGS, GEOMETRIES, SERVING_ARGS.
# Expects $OUT (results folder, comes back) and the fla-core wheel in .whl/ (docs/gpu.md). Each part logs to $OUT.
set -u
parts=" ${1:-tests moe spec prefill decode engine gemv conv} "
source benchmarks/gpu_env.sh
has() { [[ $parts == *" $1 "* ]]; }
if has tests; then
  timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider ${TESTS:-tests/ops tests/executor} \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if has moe; then
  timeout 150 python3 benchmarks/moe_prefill_h200.py --out "$OUT/moe_prefill_h200.json" 2>&1 | tee "$OUT/moe_prefill_h200.log" \
    | tail -30
fi
if has spec; then
  timeout 240 python3 benchmarks/spec_h200.py --out "$OUT" 2>&1 | tee "$OUT/spec_h200.log" | grep -v "^ " | tail -30
fi
if has gemv && [[ -f benchmarks/gemv_h200.py ]]; then
  timeout 300 python3 benchmarks/gemv_h200.py --out "$OUT" --table "$OUT/gemv_table.json" ${GEMV_ARGS:-} 2>&1 \
    | tee "$OUT/gemv_h200.log" | tail -40
fi
if has conv && [[ -f benchmarks/conv_h200.py ]]; then
  timeout 90 python3 benchmarks/conv_h200.py --out "$OUT/conv_h200.json" 2>&1 | tail -15
fi
if has profile; then
  timeout 240 python3 benchmarks/step_profile_h200.py --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | grep -v Warning \
    | tee "$OUT/step_profile_h200.log" | grep -v "^    \[" | tail -40
fi
if has prefill || has decode || has engine; then
  skip="tiny,parity,transformers"
  has engine || skip="$skip,engine"
  has prefill || skip="$skip,prefill"
  has decode || skip="$skip,decode"
  timeout 400 python3 benchmarks/serving_h200.py --out "$OUT" --geometries ${GEOMETRIES:-kimi-linear-48b-a3b} \
    --skip "$skip" ${SERVING_ARGS:-} 2>&1 | tee "$OUT/serving_h200.log" | tail -70
fi
