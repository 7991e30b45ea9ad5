#!/usr/bin/env bash
# The Gluon KDA decode (tokenspeed/ops/triton/kda_decode_gluon.py) on one H200, in one device call:
#   1. its GPU tests and the Triton KDA decode GPU tests (pytest-xdist);
#   2. the decode sweep on [V, K] pools with the fused norm: every -gl variant against the Triton chunked rows of
#      DECODE_TABLE, fla and torch's copy of the same bytes (kda_decode_sweep_h200.py);
#   3. the kimi-linear-48b-a3b decode step, interleaved A/B: DECODE_TABLE vs the sweep's best -gl label at 32 x 64
#      forced for every decode launch (TOKENSPEED_KDA_DECODE), batches ${AB_BATCHES:-4,16,64} at 4K.
# Usage (device machine, fla-core + pytest-xdist + execnet wheels in .whl/): bash benchmarks/kda_gluon_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=$PYTHONPATH:benchmarks
C=${BENCH_COMMIT}
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q -n 8 -m gpu tests/ops/test_triton_kda_decode_gluon.py tests/ops/test_triton_kda_decode.py \
  tests/ops/test_triton_kda_norm_epilogue.py 2>&1 | tail -25 | tee "$OUT/gpu_tests_kda_gluon_$C.log"
python benchmarks/kda_decode_sweep_h200.py --norm --v-first --no-patterns \
  --shapes ${SHAPES:-96:64,32:64,96:16,32:16,32:8,32:4,32:2} \
  --only="-gl,bv8-chunked-w4-s4,bv16-chunked-w4-s4,bv32-chunked-w4-s3" \
  --out "$OUT/kda_decode_sweep_h200_gluon_$C.json" 2>&1 | tee "$OUT/kda_decode_sweep_h200_gluon_$C.log" | tail -40
BEST=$(python - "$OUT/kda_decode_sweep_h200_gluon_$C.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
row = next(r for r in rows if (r["H"], r["N"]) == (32, 64))
ok = [v for v in row["variants"] if v["label"].endswith("-gl-vfirst") and v.get("parity_ok") and v.get("us")]
print(min(ok, key=lambda v: v["us"])["label"].removesuffix("-vfirst") if ok else "")
PY
)
echo "best gluon label at 32 x 64: $BEST"
if [ -n "$BEST" ] && [ -n "${AB_BATCHES:-4,16,64}" ]; then
  python benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab ${AB_BATCHES:-4,16,64} \
    --pdl-ctx 4096 --pdl-page 16 --pdl-configs "1:regs:0;1:regs:0:table:TOKENSPEED_KDA_DECODE=$BEST" \
    --out "$OUT/stepab" 2>&1 | tail -30 | tee "$OUT/step_profile_h200_${C}_kda_gluon_ab.log"
  cp "$OUT/stepab/step_profile_h200.json" "$OUT/step_profile_h200_${C}_kda_gluon_ab.json" 2>/dev/null
fi
