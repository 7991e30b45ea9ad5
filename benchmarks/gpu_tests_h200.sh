#!/usr/bin/env bash
# Every GPU test in one device call, over $PYTEST_N pytest-xdist workers sharing the GPU (pytest-xdist and execnet
# carried in .whl/; most of the time is Triton compiling and fla autotuning, which the workers do in parallel):
#   1. the tests marked `gpu`;
#   2. the files whose CUDA tests are not marked but skip without a device (CUDA graphs of the served models, fla's
#      chunked KDA, the KDA replay, the fused MLA decode, PDL), their CPU tests included;
#   3. serially, the test that reads the whole device's free memory (it skips under xdist).
# Log: $OUT/gpu_tests_all.log (every passed test listed, the 15 slowest timed).
#   PYTEST_N=12 TIMEOUT=420 bash benchmarks/gpu_tests_h200.sh [extra pytest args for 1 and 2, e.g. -k mla]
set -u
source benchmarks/gpu_env.sh
log="$OUT/gpu_tests_all.log"
python3 -c "import openai" 2>/dev/null || set -- --ignore=tests/e2e/test_server.py "$@"  # no openai wheel carried
UNMARKED=(tests/executor/test_cuda_graphs.py tests/ops/test_kda_prefill.py tests/ops/test_kda.py
          tests/ops/test_triton_kda_replay.py tests/ops/test_triton_mla_fused.py tests/ops/test_triton_pdl.py)
run() { timeout -s INT "$1" python3 -m pytest "${@:2}" -rfEp --tb=short -p no:cacheprovider >> "$log" 2>&1; }
: > "$log"
run "${TIMEOUT:-420}" -n "${PYTEST_N:-12}" --durations=15 -m gpu tests "$@"
run 240 -n "${PYTEST_N:-12}" -m "not gpu" "${UNMARKED[@]}" "$@"
run 120 tests/executor/test_cuda_graphs.py -k second_engine  # these two read or fill the whole device: alone
run 120 tests/engine/test_step_failure.py -k real_out_of_memory
grep -E "^(FAILED|ERROR)" "$log" | head -20
grep -E "[0-9]+ (passed|failed|skipped|deselected)|no tests ran" "$log"
