# Sourced by the H200 suite scripts: $OUT, the carried fla-core wheel on PYTHONPATH, the commit label, the GPU line.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
