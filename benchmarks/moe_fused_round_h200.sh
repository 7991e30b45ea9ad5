#!/usr/bin/env bash
# One device call for the fused direct-mode MoE launch (ops/triton/moe_fused.py, issue 8's batch-1 step), any
# subset of parts:
#   tests   the MoE GPU tests (fused, direct, experts) over pytest-xdist workers
#   bench   moe_fused_h200.py: the fused launch against the two launches, T 1 / 2 / 4, tiles and residency caps
#   stepab  the decode step of kimi-linear-48b-a3b at batch 1 / 2 / 4, interleaved, TOKENSPEED_MOE_FUSED 0 vs 1
#           (step_profile_h200.py --pdl-ab; logits compared bit for bit)
#   profile the batch-1 step's CUPTI kernel list with the fused launch on
#   nocompile  the no-compile-after-start-up and graph tests with the fused launch on
#   bash benchmarks/moe_fused_round_h200.sh "tests bench stepab profile nocompile"
set -u
parts=" ${1:-tests bench stepab} "
source benchmarks/gpu_env.sh
has() { [[ $parts == *" $1 "* ]]; }
export PYTHONPATH=$PYTHONPATH:benchmarks
if has tests; then
  timeout -s INT ${TESTS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -n ${PYTEST_N:-8} -rfE --tb=short \
    tests/ops/test_triton_moe_fused.py ${MOE_TESTS-tests/ops/test_triton_moe_direct.py tests/ops/test_triton_moe_experts.py} \
    > "$OUT/moe_fused_tests.log" 2>&1
  grep -E "^E  |passed|failed" "$OUT/moe_fused_tests.log" | cut -c1-300 | tail -8
fi
if has bench; then
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/moe_fused_h200.py --out "$OUT/moe_fused_h200.json" 2>&1 \
    | tee "$OUT/moe_fused_bench.log" | grep -v "^wrote"
fi
if has stepab; then
  timeout ${STEP_TIMEOUT:-300} python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy \
    --pdl-ab "${STEP_BATCHES:-1,2,4}" \
    --pdl-configs "1:regs:0:table:TOKENSPEED_MOE_FUSED=0;1:regs:0:table:TOKENSPEED_MOE_FUSED=1" \
    --out "$OUT" 2>&1 | tee "$OUT/moe_fused_stepab.log" | grep "PDL A/B"
fi
if has profile; then
  mkdir -p "$OUT/fused_profile"
  TOKENSPEED_MOE_FUSED=1 timeout 200 python3 benchmarks/step_profile_h200.py --batches 1 --skip prefill,policy \
    --out "$OUT/fused_profile" 2>&1 | grep -E "graph|_fused_direct|_combine_norm|_moe_gate" | cut -c1-250 | head -12
fi
if has nocompile; then
  TOKENSPEED_MOE_FUSED=1 timeout 240 python3 -m pytest -p no:cacheprovider tests/executor/test_cuda_graphs.py \
    -k "no_triton or end_of_a_context" --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
fi
