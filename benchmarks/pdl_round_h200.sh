#!/usr/bin/env bash
# One device call for the PDL / fused-epilogue round (issue 8): GPU parity tests of the changed kernels and the
# CUDA-graph equality tests, then the batch-1/64 step profile with the PDL on/off A/B (bit-equal logits), the MLA
# split-policy sweep, the ragged-tail MLA forms and the GEMV PDL chain. Expects $OUT; logs each part there.
#   bash benchmarks/pdl_round_h200.sh "tests profile mla ragged decode chain"      (any subset)
# (tests are stopped with SIGINT at TESTS_TIMEOUT, so pytest still prints its summary of what failed; TESTS picks
#  the files, TESTS_K a -k expression)
set -u
parts=" ${1:-tests profile mla ragged chain} "
source benchmarks/gpu_env.sh
has() { [[ $parts == *" $1 "* ]]; }
export PYTHONPATH=$PYTHONPATH:benchmarks
if has tests; then
  timeout -s INT ${TESTS_TIMEOUT:-300} python3 -m pytest -v -rfE --tb=short --durations=15 -p no:cacheprovider \
    ${TESTS:-tests/ops tests/executor/test_cuda_graphs.py} ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu_tests.log" 2>&1
  grep -E " PASSED| FAILED| ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -40
fi
if has profile; then
  timeout 200 python3 benchmarks/step_profile_h200.py --out "$OUT" --batches 1,64 --skip prefill,policy \
    --pdl-ab ${PDL_AB:-1,64} ${PROFILE_ARGS:-} 2>&1 | grep -v Warning | grep -v "^    \[" | tail -24
fi
if has mla; then
  timeout 90 python3 benchmarks/mla_decode_h200.py --policies --out "$OUT/mla_decode_policies_h200.json" 2>&1 | tail -30
fi
if has ragged; then
  timeout 90 python3 benchmarks/mla_decode_h200.py --ragged --out "$OUT/mla_ragged_h200.json" 2>&1 | tail -30
fi
if has decode; then
  timeout 300 python3 benchmarks/serving_h200.py --out "$OUT" --geometries kimi-linear-48b-a3b \
    --skip tiny,transformers,engine,prefill,profile ${SERVING_ARGS:-} 2>&1 | tee "$OUT/serving_h200.log" | tail -25
fi
if has chain; then
  timeout 90 python3 benchmarks/gemv_pdl_chain_h200.py --out "$OUT" 2>&1 | tail -25
fi
