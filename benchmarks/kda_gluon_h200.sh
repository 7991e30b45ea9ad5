#!/usr/bin/env bash
# The Gluon KDA decode (tokenspeed/ops/triton/kda_decode_gluon.py) on one H200, in one device call:
#   1. GPU tests: ${TESTS} (default: its tests, the Triton KDA decode and norm-epilogue tests, the served-model
#      test and the no-compile-after-start-up test), over pytest-xdist workers (SKIP_TESTS=1: none);
#   2. the decode sweep on [V, K] pools with the fused norm at ${SHAPES}: the variants matching ${ONLY} (default:
#      every -gl variant and the Triton chunked rows of DECODE_TABLE), fla and torch's copy of the same bytes;
#   3. the kimi-linear-48b-a3b decode step, interleaved A/B at 4K: batch 1 under ${B1_CONFIGS} (default: the split
#      kernel of DECODE_TABLE against the Gluon decode with the low-rank gates in it, forced by label), then batches
#      ${AB_BATCHES} under ${AB_CONFIGS} (default: GLUON_DECODE_TABLE against TOKENSPEED_KDA_GLUON=0, DECODE_TABLE's
#      Triton rows). An empty variable skips its part.
# Usage (device machine, fla-core + pytest-xdist + execnet wheels in .whl/): bash benchmarks/kda_gluon_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=$PYTHONPATH:benchmarks
C=${BENCH_COMMIT}
TESTS=${TESTS:-"tests/ops/test_triton_kda_decode_gluon.py tests/ops/test_triton_kda_decode.py tests/ops/test_triton_kda_norm_epilogue.py tests/executor/test_cuda_graphs.py::test_gluon_kda_decode_in_the_served_model_gpu tests/executor/test_cuda_graphs.py::test_no_triton_kernel_compiles_after_start_up_gpu"}
if [ -z "${SKIP_TESTS:-}" ]; then
  python -m pytest -q -n 8 -p no:benchmark $TESTS -k "gpu or cuda" 2>&1 | grep -v Warning | tail -25 \
    | tee "$OUT/gpu_tests_kda_gluon_$C.log"
fi
if [ -n "${SHAPES-96:64,32:64,96:16,32:16,32:8,32:4,32:2,12:64,12:16}" ]; then
  python benchmarks/kda_decode_sweep_h200.py --norm --v-first --no-patterns \
    --shapes "${SHAPES-96:64,32:64,96:16,32:16,32:8,32:4,32:2,12:64,12:16}" \
    --only="${ONLY:--gl,bv8-chunked-w4-s4,bv16-chunked-w4-s4,bv32-chunked-w4-s3}" \
    --out "$OUT/kda_decode_sweep_h200_gluon${TAG:-}_$C.json" 2>&1 \
    | tee "$OUT/kda_decode_sweep_h200_gluon${TAG:-}_$C.log" | grep -A20 "best per shape"
fi
if [ -n "${B1_CONFIGS-1:regs:0;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-chunked-w4-gl;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-chunked-w4-s2-gl}" ]; then
  # batch 1 (32 pairs: DECODE_TABLE's split kernel with the low-rank gates fused) against the Gluon decode with
  # them fused too (the whole head, or a 2-tile ring, in shared memory)
  python benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab 1 --pdl-ctx 4096 --pdl-page 16 \
    --pdl-configs "${B1_CONFIGS-1:regs:0;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-chunked-w4-gl;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-chunked-w4-s2-gl}" \
    --out "$OUT/stepab1" 2>&1 | grep "A/B" | tee "$OUT/step_profile_h200_${C}_kda_gluon_b1_ab.log"
  cp "$OUT/stepab1/step_profile_h200.json" "$OUT/step_profile_h200_${C}_kda_gluon_b1_ab.json" 2>/dev/null
fi
if [ -n "${AB_BATCHES-2,4,16,64}" ]; then
  python benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab "${AB_BATCHES-2,4,16,64}" \
    --pdl-ctx 4096 --pdl-page 16 --pdl-configs "${AB_CONFIGS:-1:regs:0;1:regs:0:table:TOKENSPEED_KDA_GLUON=0}" \
    --out "$OUT/stepab" 2>&1 | grep "A/B" | tee "$OUT/step_profile_h200_${C}_kda_gluon_ab.log"
  cp "$OUT/stepab/step_profile_h200.json" "$OUT/step_profile_h200_${C}_kda_gluon_ab.json" 2>/dev/null
fi
