#!/usr/bin/env bash
# One device call for the MLA decode round (issue 7): the Gluon candidate kernel checked and timed against
# mla_decode, balanced vs uniform splits with UNIFORM_PLAN off / on, the key-loop forms, the MLA GPU tests (both
# orientations, UNIFORM_PLAN bit-equality), the decode sweep. Expects $OUT; logs each part there.
#   bash benchmarks/mla_round_h200.sh "gluon plan loops tests decode"      (any subset)
set -u
parts=" ${1:-gluon plan loops tests} "
source benchmarks/gpu_env.sh
has() { [[ $parts == *" $1 "* ]]; }
export PYTHONPATH=$PYTHONPATH:benchmarks
if has gluon; then
  timeout 150 python3 benchmarks/mla_gluon_h200.py --out "$OUT/mla_gluon_h200.json" 2>&1 | tee "$OUT/mla_gluon.log" \
    | tail -14
fi
if has plan; then
  for u in "" --uniform-plan; do
    timeout 90 python3 benchmarks/mla_decode_h200.py $u --out "$OUT/mla_decode_h200${u:+_uniform_plan}.json" 2>&1 \
      | tail -10
  done
fi
if has loops; then
  timeout 150 python3 benchmarks/mla_decode_h200.py --loops --out "$OUT/mla_loops_h200.json" 2>&1 \
    | tee "$OUT/mla_loops.log" | grep -v "^b\|^mixed" | tail -14
fi
if has tests; then
  timeout -s INT ${TESTS_TIMEOUT:-200} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    tests/ops/test_triton_mla_decode.py tests/ops/test_triton_mla_fused.py -k gpu > "$OUT/gpu_tests.log" 2>&1
  tail -8 "$OUT/gpu_tests.log"
fi
if has decode; then
  timeout 120 python3 benchmarks/serving_h200.py --out "$OUT" --geometries kimi-linear-48b-a3b \
    --skip tiny,transformers,engine,prefill,profile,parity ${SERVING_ARGS:-} 2>&1 | grep "ctx\|errors"
fi
