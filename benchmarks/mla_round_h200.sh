#!/usr/bin/env bash
# One device call for an MLA decode round (issues 7 / 8): the Gluon split kernel against the Triton one through
# mla_decode, balanced vs uniform splits with UNIFORM_PLAN off / on, the key-loop forms, the MLA GPU tests (kernel
# parity, Gluon == Triton, UNIFORM_PLAN bit-equality, CUDA graphs), the model's CUDA-graph tests, the decode sweep
# with the Gluon kernel off then on. Expects $OUT; logs each part there (at most 8 files come back).
# "pages" / "fp8": the Gluon kernel over page-16 caches (mla_gluon.SMALL_PAGES) / fp8 caches (FP8_CACHE), their GPU
# tests and timing. "ws": the warp-specialized fp8 path (mla_gluon.WS_FP8): every Gluon GPU test, then the fp8 cases
# at page 16 and 64 against the one-warpgroup fp8 path and against the same cases over a bf16 cache.
#   bash benchmarks/mla_round_h200.sh "gluon pages fp8 ws plan loops tests models decode"      (any subset)
set -u
parts=" ${1:-gluon plan loops tests} "
source benchmarks/gpu_env.sh
has() { [[ $parts == *" $1 "* ]]; }
# PYTEST_N=8: the GPU tests over 8 xdist workers sharing the GPU (pytest-xdist carried in .whl): compiles in parallel
XDIST=${PYTEST_N:+-n $PYTEST_N}
export PYTHONPATH=$PYTHONPATH:benchmarks
if has gluon; then
  timeout 150 python3 benchmarks/mla_gluon_h200.py --out "$OUT/mla_gluon_h200.json" 2>&1 | tee "$OUT/mla_gluon.log" \
    | tail -14
fi
if has pages; then  # mla_gluon.SMALL_PAGES (page 16, a page per key row): tests first, then timing
  timeout -s INT ${PAGES_TIMEOUT:-200} python3 -m pytest $XDIST -rfEp --tb=short -p no:cacheprovider \
    tests/ops/test_triton_mla_gluon.py -k small_pages > "$OUT/gpu_tests_pages.log" 2>&1
  tail -4 "$OUT/gpu_tests_pages.log"
  timeout 150 python3 benchmarks/mla_gluon_h200.py --page 16 --out "$OUT/mla_gluon_h200_page16.json" 2>&1 \
    | tee "$OUT/mla_gluon_page16.log" | tail -20
fi
if has fp8; then  # mla_gluon.FP8_CACHE (fp8 tiles staged to bf16 in shared memory): tests first, then timing
  timeout -s INT ${FP8_TIMEOUT:-150} python3 -m pytest $XDIST -rfEp --tb=short -p no:cacheprovider \
    tests/ops/test_triton_mla_gluon.py -k fp8_cache > "$OUT/gpu_tests_fp8.log" 2>&1
  tail -4 "$OUT/gpu_tests_fp8.log"
  timeout 150 python3 benchmarks/mla_gluon_h200.py --fp8 --cases b64,b16,mixed,b1_4k \
    --out "$OUT/mla_gluon_h200_fp8.json" 2>&1 | tee "$OUT/mla_gluon_fp8.log" | tail -12
fi
if has ws; then
  timeout -s INT ${WS_TIMEOUT:-200} python3 -m pytest $XDIST -rfEp --tb=short -p no:cacheprovider \
    tests/ops/test_triton_mla_gluon.py > "$OUT/gpu_tests_ws.log" 2>&1
  tail -6 "$OUT/gpu_tests_ws.log"
  for page in 16 64; do
    timeout 150 python3 benchmarks/mla_gluon_h200.py --fp8 --ws-ab --no-triton --page $page \
      --cases ${WS_CASES:-b64,b16,b4_32k,mixed,b1_4k,k3tp8_b64,verify4_b1} --out "$OUT/mla_gluon_h200_ws_page$page.json" \
      2>&1 | tee "$OUT/mla_gluon_ws_page$page.log" | tail -12
  done
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
  timeout -s INT ${TESTS_TIMEOUT:-200} python3 -m pytest $XDIST -rfEp --tb=short -p no:cacheprovider \
    tests/ops/test_triton_mla_decode.py tests/ops/test_triton_mla_fused.py tests/ops/test_triton_mla_gluon.py \
    -k gpu > "$OUT/gpu_tests.log" 2>&1
  tail -8 "$OUT/gpu_tests.log"
fi
if has models; then
  timeout -s INT ${MODELS_TIMEOUT:-240} python3 -m pytest $XDIST -rfEp --tb=short -p no:cacheprovider \
    tests/executor/test_cuda_graphs.py -k "graphs or gpu" >> "$OUT/gpu_tests.log" 2>&1  # incl. the Gluon model test
  tail -4 "$OUT/gpu_tests.log"
fi
if has decode; then  # the Triton split kernel, then the Gluon one where it applies (the default)
  for g in 0 1; do
    mkdir -p "$OUT/gluon$g"
    TOKENSPEED_MLA_GLUON=$g timeout 150 python3 benchmarks/serving_h200.py --out "$OUT/gluon$g" \
      --geometries kimi-linear-48b-a3b --skip tiny,transformers,engine,prefill,profile,parity ${SERVING_ARGS:-} 2>&1 \
      | grep "ctx\|errors"
  done
fi
