#!/usr/bin/env bash
# The swe-smith-like sweep (issue 8: TPS/user vs output tok/s/GPU frontier) against a `tokenspeed serve` started
# here, in one call; the server is stopped at the end. Results (JSON, JSONL, frontier PNG) and the server log go to
# $OUT. Settings by environment (defaults: the GPU run):
#   MODEL=kimi-linear-48b-a3b DEVICE=cuda SCALE=0.2 CONC=1,4,16 MAX_NUM_SEQS=32 MAX_LEN=16384 PAGE_SIZE (unset: the
#   server's default; 64 lets MLA decode take the Gluon split kernel on an H200); SESSIONS unset: the
#   spec's sessions per concurrency (4 at 1, 8 at 4, 32 at 16; estimated at ~2 minutes on the H200, not yet run), else that many each;
#   BESIDE (unset: off) caps a prompt's chunk in steps where others decode (--prefill-chunk-beside-decodes)
#   ROUTING=uniform: MoE layers route as a balanced router would (--moe-routing-simulation; random weights send
#   similar tokens to the same few experts, which understates the experts' cost)
#   e.g. CPU check: MODEL=tiny-k3 DEVICE=cpu SCALE=0.005 CONC=1,2 SESSIONS=2 OUT=/tmp/swe bash benchmarks/swe_smith_session.sh
# `--history live`: each turn appends the server's own output (swe-smith semantics), and every stream chunk carries
# its token ids, so per-token timing holds even when a random model's tokens decode to no text.
# The server logs steps slower than 1 s (TOKENSPEED_SLOW_STEP_S) with their shapes; the Triton kernels compiled while
# serving are listed in $OUT/swe_compiled_mid_serve.txt.
# On the GPU machine the carried wheels (.whl/: fla-core, fastapi, uvicorn, pydantic, pyzmq, ...) are installed
# first (benchmarks/gpu_env.sh).
set -u
MODEL=${MODEL:-kimi-linear-48b-a3b}
DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-0.2}
CONC=${CONC:-1,4,16}
sessions=()
[[ -n ${SESSIONS:-} ]] && sessions=(--num-sessions "$SESSIONS")
PORT=${PORT:-8301}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [[ $DEVICE == cuda ]]; then
  source benchmarks/gpu_env.sh
  extra=(--load-format dummy --gpu-memory-utilization 0.9)
else
  export PYTHONPATH=.
  extra=(--cache-memory-gb 0.3)
fi
[[ -n ${PAGE_SIZE:-} ]] && extra+=(--page-size "$PAGE_SIZE")
[[ -n ${BESIDE:-} ]] && extra+=(--prefill-chunk-beside-decodes "$BESIDE")
[[ -n ${ROUTING:-} ]] && extra+=(--moe-routing-simulation "$ROUTING")
python3 -m tokenspeed.cli serve "$MODEL" --device "$DEVICE" --port "$PORT" --max-num-seqs "${MAX_NUM_SEQS:-32}" \
  --max-model-len "${MAX_LEN:-16384}" "${extra[@]}" > "$OUT/swe_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 600); do  # model build, dummy init and graph capture
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited:"; tail -30 "$OUT/swe_server.log"; exit 1; }
  sleep 1
done
started=$(mktemp)  # kernels Triton compiles after this (mid-serve) are listed at the end
vocab=$(python3 -c "from tokenspeed.models import resolve_config as r; print(r('$MODEL')[0].vocab_size)")
python3 -m tokenspeed.cli bench --base-url "http://127.0.0.1:$PORT" --workload swe-smith-like --scale "$SCALE" \
  --concurrency "$CONC" "${sessions[@]}" --vocab-size "$vocab" --result-dir "$OUT" \
  --history live --result-name "swe_smith_${DEVICE}_${MODEL}" 2>&1 | tail -25
# Triton kernels compiled while serving (each a stall of its step) and the engine's slow-step warnings
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
new=$(find "$cache" -newer "$started" -name "*.json" ! -name "__grp__*" 2>/dev/null)
{ for f in $new; do basename "$f"; done | sort | uniq -c
  for f in $new; do  # each variant's specialisation: its entry signature (divisibility hints, constant args)
    echo "== $(basename "$f" .json)"
    python3 -c "import glob, re, sys
for p in sorted(glob.glob(sys.argv[1] + '.tt*ir'))[:1]:
    m = re.search(r'tt.func public @\w+\((.*?)\)\s*(?:attributes|\{)', open(p).read(), re.S)
    args = re.sub(r'loc[(][^()]*([(][^()]*[)])?[)]', '', m.group(1)) if m else '?'
    print(' '.join(args.split())[:1500])" "${f%.json}"
  done; } > "$OUT/swe_compiled_mid_serve.txt"
echo "Triton kernels compiled mid-serve: $(echo $new | wc -w)"; grep -E "^ +[0-9]+ " "$OUT/swe_compiled_mid_serve.txt" | head -20
grep "slow step" "$OUT/swe_server.log" | tail -20
