#!/usr/bin/env bash
# Device calls for the open issue-7/8 measurements prepared without a GPU (sessions 10-11), any subset of parts:
#   sweep   KDA decode variants at the large shapes, PDL on: the chunked default against -pf (head-state L2
#           prefetch), -hints, fla, torch's copy of the same bytes and in-place copies with the decode's access
#           pattern (kda_decode_sweep_h200.py)
#   vfirst  the large shapes' chunked variants on a [V, K] state pool (--v-first: contiguous 16 KB V tiles) beside
#           the [K, V] pool's, same harness
#   small   the same at batch-1..16 shapes
#   nopdl   the large shapes with TOKENSPEED_PDL=0
#   verify  4-token verify windows (EAGLE3's) at batch 1..64, 32 and 96 heads, [V, K] pools: the variants named by
#           VERIFY_ONLY (default: the plain split, the window loop and the WY chunk form)
#   small2  batch-1..8 shapes with the fused norm: split vs chunked (where DECODE_TABLE switches); small2vf the same
#           on a [V, K] pool (the model's layout)
#   serve   decode of kimi-linear-48b-a3b through CUDA graphs, batch 1 / 4 / 16 / 64 at 4K and 32K (serving_h200.py)
#   stepab  the batch-2 decode step of kimi-linear-48b-a3b: the default (chunked from 64 pairs) vs split forced
#           (TOKENSPEED_KDA_DECODE)
#   sizing  the batch-1 decode step against the graphs' sizing (graph_sizing_h200.py)
#   ctx     the GEMV sweep in context (gemv_h200.py --producer-cycles 20000: after a 10 us PDL producer, whole-slice
#           configs added) on the batch-1 projections of kimi-linear and the K3 baseline shapes, M 1 / 4; its
#           table goes to $OUT (the packaged one is not touched)
#   ctxab   the batch-1 / 4 decode step with that table over the packaged one vs the packaged one (run after ctx)
#   chain   GEMV configs whose whole weight slice is loaded before the PDL wait vs the table's, in the batch-1
#           o_proj -> router -> in_proj chain after a 5 / 10 us producer, and h200-baseline.md's K3 shapes (the
#           issue's GEMV targets) after a 5 us producer (gemv_pdl_chain_h200.py --configs, --geometry k3)
#   k3      only the chain's K3 part (h200-baseline.md's shapes after a 5 us producer)
#   specab  EAGLE3-style verify (spec_h200.py, forced acceptance) at concurrency ${SPEC_CONC:-1} with the default KDA
#           launches (kda_config.MULTI_TABLE) vs TOKENSPEED_KDA_VERIFY=${SPEC_VERIFY:-bv32-split-w4} (the old plain loop)
#   margin  what each op costs inside the batch-1 / 64 decode graph of kimi-linear-48b-a3b (marginal_cost_h200.py)
#   tests   the KDA GPU tests (decode, norm epilogue, replay) over pytest-xdist workers
#   (at 2a12a04 the WY chunk form won from 16 sequences, the window loop below: kda_config.MULTI_TABLE)
#   verifykp  the one-launch WY form vs its two-launch form (KdaConfig(keys_pass=True)) and the window loop, the
#           verify shapes; then the WY GPU tests
#   replaygap the chunked multi-layer replay at each block_v / stage count against split replays, repeated
#           (kda_replay_gap_h200.py: the 2.6e-4 gap of the chunked BV 32 replay seen at 7f91510)
#   bv8     the large decode shapes on [V, K] pools: the BV 8 / 16 chunked variants (stage depth, 2 warps, hints) against
#           the table's BV 16 / 4 stages (84.1% of HBM at 96 x 64 for BV 8 / 4 stages at 3f6f223; target 85%)
#   replaywy  the replay schedules' errors (N 1 / 8) and times at 1 / 4 / 16 / 64 sequences: the WY replay at BV 64 /
#           32 / 16 against the loops; then the replay GPU tests (at 6a0daa4 its streaming tiles won 2.1-2.6x over
#           the tile pass they replaced)
#   nocompile  the no-compile-after-start-up GPU test, then the GEMV / CUDA-graph / replay GPU tests (all passed at
#           61d9710, the n-gram case included)
#   spectest  the speculative engine's GPU tests: prompt tails beside verify windows (CUDA == CPU greedy; written at
#           3ab3082, not yet run on a GPU), the n-gram no-compile case, the graph tests with speculation
#   specgap   the batched verify step as served (spec_host_gap_h200.py at concurrency ${SPEC_CONC:-16}), then
#           spec_h200.py at that concurrency (its TPS/user window now ends when the first request finishes)
#   tailprof  step_profile_h200.py prefill part: 256- and 1300-token tails on a 64K history beside 15 decodes, and
#           a 1300-token tail alone (the swe-smith mixed step): kernel table, host syncs, cProfile
#   tailpolicy  step_profile_h200.py tail_policy at swe-smith tails (256-2048 new tokens on a 64K history, alone and
#           beside 15 decodes): the fused KDA kernel's window loop vs fla's chunked scan, to set FUSED_MAX_TAIL_CUDA
#           (256; last timed with the plain split loop)
#   mlaexp    mla_expanded_h200.py: expansion (cat vs head-major GEMM) and attention (masked SDPA vs split + LSE merge)
#   sdpatest  tests/ops/test_cuda_sdpa.py and the MLA decode GPU tests
#   sdpafirst sdpa_first_call_h200.py (cuDNN plan build per new shape): bucketed plans (warmed and not) vs exact
#   memcheck  sdpa_row_slack_check.py under compute-sanitizer: reads past the last row with and without ROW_SLACK
#   alignab   moe_align_h200.py (torch sort vs multi-program alignment) and the MoE GPU tests
#   tailbv  tail_policy's fused window loop forced to other V tiles (TOKENSPEED_KDA_VERIFY=TAIL_LABELS; the default
#           MULTI_TABLE row below 96 pairs is bv32-split-w4-win): smaller tiles put more programs on the SMs and less
#           work on each token's critical path, which could keep tails past 768 tokens on the fused kernel
#   b1kda   the batch-1 decode step of kimi-linear-48b-a3b with each KDA decode config forced (B1_LABELS), against
#           the table's, interleaved (KDA decode is ~11 us a layer inside the step for ~1 us of state)
#   routing  the decode sweep of kimi-linear-48b-a3b with uniform routing simulated (serving_h200.py
#           --routing-simulation uniform: dummy weights touch ~126 experts a layer at batch 64, a balanced router
#           ~223), then the simulation's GPU test (a CUDA graph) and the real out-of-memory step on a filled device
#   l2side  side-stream L2 prefetch of the next weights during a latency-bound kernel: the producer -> projection
#           micro-benchmark (l2_side_prefetch_h200.py; at accfa73 no gain, and the same prefetch inside the decode
#           step, since removed, cost 1-2%)
#   steptune  kimi-linear's batch-1 projections: the wide in-context GEMV sweep (gemv_h200.py --producer-cycles
#           20000 --ms 1 --sweep wide), then each shape's top configs timed in the whole decode step
#           (gemv_step_tune_h200.py; the kept buckets in $OUT/steptune/step_tune_table.json, for gemv_table_merge.py)
#   stacked  ops.stacked_linear's PDL kernel (KDA's f / g gate up-projections, MLA's W_UK / W_UV on the unfused
#           path; on by default since da2090b) against torch.bmm (TOKENSPEED_STACKED_GEMV=0) in the decode step at
#           batch 1 / 2 / 4 / 8 / 16, interleaved; then its GPU tests and the no-compile-after-start-up test
#   smem    the "smem" GEMV kind (weight rows copied into shared memory before the PDL wait): its GPU tests, the
#           in-context sweep of kimi-linear's batch-1 projections with its configs added, then each shape's top
#           configs timed in the whole batch-1 decode step (gemv_step_tune_h200.py; kept buckets in
#           $OUT/smem/step_tune_table.json)
#   smemk3  the same sweep on h200-baseline.md's K3 TP8 shapes at M 1 / 2 / 4 after a 10 us producer (issue 7's
#           GEMV targets), its table in $OUT/smemk3
#   lowrank  the KDA decode with the low-rank gates' up projections in its kernel (TOKENSPEED_KDA_FUSED_GATES): its
#           GPU tests and the KDA decode ones, the decode step A/B at batch 1..16 (default / never / always fused),
#           the batch-1 step's CUPTI profile, the no-compile-after-start-up test
#   check   the checks left open on 2026-12-02: the no-compile GPU tests (incl. the end-of-context one, never run on
#           a GPU), the KDA GPU tests at the final kernel, and the 96 x 64 / 32 x 64 sweep at the new table row
#   smemdiag  why the smem o_proj loses in the batch-1 step: the step profiled (CUPTI, PDL on) with the packaged table
#           and with o_proj on smem (does the KDA decode before it get slower?), then the step A/B of o_proj smem
#           configs, the heaviest one with its copies delayed (TOKENSPEED_GEMV_SMEM_DELAY SM clocks)
#   rtests  the routing part's GPU tests alone (the simulation in a CUDA graph, the real out-of-memory step)
#   Run from the repository root with carry
#   [".whl"] (the working tree plus a copy under .gpu/ passed the device's 64 MiB carry limit)
# Expects $OUT; at most 8 files come back from a device call.
set -u
parts=" ${1:-tests sweep margin} "
source benchmarks/gpu_env.sh
has() { [[ $parts == *" $1 "* ]]; }
export PYTHONPATH=$PYTHONPATH:benchmarks
big="32:64,96:16,96:64"
only="bv32-chunked"  # the chunked variants (and the default / legacy and fla, always timed)
if has tests; then
  PYTEST_N=${PYTEST_N:-8} TIMEOUT=${TESTS_TIMEOUT:-200} bash benchmarks/gpu_tests_h200.sh -k "kda" | tail -4
fi
if has sweep; then
  timeout 240 python3 benchmarks/kda_decode_sweep_h200.py --shapes "$big" --only "$only" \
    --out "$OUT/kda_decode_sweep_h200.json" 2>&1 | tee "$OUT/kda_sweep.log" | grep -A12 "best per shape"
fi
if has vfirst; then
  for lay in "" "--v-first"; do
    timeout 240 python3 benchmarks/kda_decode_sweep_h200.py --shapes "$big" --only "chunked" $lay \
      --out "$OUT/kda_decode_sweep_h200_kv${lay:+_vfirst}.json" 2>&1 | tee "$OUT/kda_sweep_kv${lay:+_vfirst}.log" \
      | grep -A4 "best per shape"
  done
fi
if has small; then
  timeout 200 python3 benchmarks/kda_decode_sweep_h200.py --shapes "32:1,96:1,32:4,32:16" --only "bv32-chunked-w4-s3" \
    --out "$OUT/kda_decode_sweep_h200_small.json" 2>&1 | tee "$OUT/kda_sweep_small.log" | grep -A12 "best per shape"
fi
if has small2; then
  timeout 200 python3 benchmarks/kda_decode_sweep_h200.py --norm --shapes "32:1,12:1,96:1,32:2,32:4,32:8" \
    --only "bv64-split,bv32-split-w4,bv32-chunked-w4-s3" --out "$OUT/kda_decode_sweep_h200_small2.json" 2>&1 \
    | tee "$OUT/kda_sweep_small2.log" | grep -A12 "best per shape"
fi
if has small2vf; then
  timeout 200 python3 benchmarks/kda_decode_sweep_h200.py --norm --v-first --shapes "32:1,12:1,96:1,32:2,32:4,32:8" \
    --only "bv64-split,bv32-split-w4,bv32-chunked-w4-s3,bv16-split" --out "$OUT/kda_decode_sweep_h200_small2vf.json" \
    2>&1 | tee "$OUT/kda_sweep_small2vf.log" | grep -A12 "best per shape"
fi
if has serve; then
  timeout 420 python3 benchmarks/serving_h200.py --geometries kimi-linear-48b-a3b \
    --skip tiny,transformers,engine,prefill,profile,parity --out "$OUT" 2>&1 | tail -14
fi
if has stepab; then
  timeout 200 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab 2 \
    --pdl-configs "1:regs:0;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-split-w4" --out "$OUT" 2>&1 | grep "PDL A/B"
fi
if has l2side; then  # side-stream L2 prefetch of o_proj / router / shared expert during the latency-bound kernels
  mkdir -p "$OUT/l2side"
  timeout 150 python3 benchmarks/l2_side_prefetch_h200.py --out "$OUT/l2side" 2>&1 | grep -E "spin|Error|error" \
    | cut -c1-300 | head -20
fi
if has steptune; then  # configs that win a projection alone have lost in the step: choose them in the step
  mkdir -p "$OUT/steptune"
  timeout 200 python3 benchmarks/gemv_h200.py --producer-cycles 20000 --ms 1 --sweep wide --budget-s 170 \
    --shapes "${TUNE_SHAPES:-12576x2304,6720x2304,2304x4096,18432x2304,2304x9216,163840x2304}" \
    --table "$OUT/steptune/ctx_table.json" --out "$OUT/steptune" 2>&1 | grep -iE "done in|wrote|error" | cut -c1-200
  timeout 330 python3 benchmarks/gemv_step_tune_h200.py --sweep "$OUT/steptune/gemv_h200.json" --out "$OUT/steptune" \
    2>&1 | grep -vE "^\s*$" | cut -c1-400 | tail -12
  rm -f "$OUT"/steptune/cand_*.json
fi
if has stacked; then  # a cuBLAS bmm between two PDL kernels breaks the chain twice per KDA layer
  timeout 240 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab "${STACKED_BATCHES:-1,2,4,8,16}" \
    --pdl-configs "1:regs:0;1:regs:0:table:TOKENSPEED_STACKED_GEMV=0" --out "$OUT" 2>&1 | grep "PDL A/B"
  timeout 120 python3 -m pytest -p no:cacheprovider tests/ops/test_triton_stacked_gemv.py -rfE --tb=short 2>&1 \
    | grep -E "^E  |passed|failed" | cut -c1-400
  # with it on, the start-up warm-up must still leave nothing to compile mid-serve
  timeout 240 python3 -m pytest -p no:cacheprovider tests/executor/test_cuda_graphs.py \
    -k no_triton --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
fi
if has smem; then
  mkdir -p "$OUT/smem"
  timeout 150 python3 -m pytest -p no:cacheprovider -n 8 tests/ops/test_triton_gemv_smem.py -rfE --tb=short 2>&1 \
    | grep -E "^E  |passed|failed" | cut -c1-300 | tail -8
  timeout 160 python3 benchmarks/gemv_h200.py --producer-cycles 20000 --ms 1 --budget-s 140 \
    --shapes "${TUNE_SHAPES:-12576x2304,6720x2304,2304x4096,18432x2304,2304x9216}" \
    --table "$OUT/smem/ctx_table.json" --out "$OUT/smem" 2>&1 | grep -iE "x[0-9]+ +[0-9.]+ +1 \||wrote|rror" | cut -c1-220
  timeout 260 python3 benchmarks/gemv_step_tune_h200.py --sweep "$OUT/smem/gemv_h200.json" --top 3 --out "$OUT/smem" \
    2>&1 | grep -vE "^\s*$" | cut -c1-300 | tail -14
  rm -f "$OUT"/smem/cand_*.json "$OUT"/smem/gemv_h200.png
fi
if has smemk3; then
  mkdir -p "$OUT/smemk3"
  timeout 280 python3 benchmarks/gemv_h200.py --producer-cycles 20000 --ms 1,2,4 --budget-s 250 --shapes k3-tp8 \
    --table "$OUT/smemk3/ctx_table.json" --out "$OUT/smemk3" 2>&1 | grep -iE "x[0-9]+ +[0-9.]+ +[124] \||wrote|rror" \
    | cut -c1-220
fi
if has smemdiag; then
  d="$OUT/smemdiag"; mkdir -p "$d"/packaged "$d"/smem
  for c in "a 8 3 1" "b 4 1 0" "c 8 1 1"; do
    set -- $c
    printf '{"entries": {"2304,4096": {"1": {"kernel": "triton", "kind": "smem", "block_n": %s, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": %s, "programs_per_sm": %s}}}}\n' \
      "$2" "$3" "$4" > "$d/oproj_$1.json"
  done
  cfgs="1:regs:0;1:regs:0:table=$d/oproj_a.json"
  for cyc in 2000 5000 10000; do cfgs="$cfgs;1:regs:0:table=$d/oproj_a.json:TOKENSPEED_GEMV_SMEM_DELAY=$cyc"; done
  cfgs="$cfgs;1:regs:0:table=$d/oproj_b.json;1:regs:0:table=$d/oproj_c.json"
  timeout 300 python3 benchmarks/step_profile_h200.py --batches 1 --skip prefill,policy --pdl-ab 1 --pdl-configs "$cfgs" \
    --out "$d/packaged" 2>&1 | grep -E "PDL A/B|graph" | cut -c1-250
  cp tokenspeed/ops/gemv_table.json "$d/table.bak"
  python3 benchmarks/gemv_table_merge.py "$d/oproj_a.json" --source smemdiag >/dev/null
  timeout 200 python3 benchmarks/step_profile_h200.py --batches 1 --skip prefill,policy --out "$d/smem" 2>&1 \
    | grep -E "graph" | cut -c1-250
  cp "$d/table.bak" tokenspeed/ops/gemv_table.json && rm "$d/table.bak"
  python3 - "$d" <<'PY'
import json, statistics, sys
d = sys.argv[1]
for k in ("packaged", "smem"):
    r = json.load(open(f"{d}/{k}/step_profile_h200.json"))["decode"][0]
    ks = r["all_graph_kernels"]
    print(k, "step", round(r["graph_step_ms"], 4), "ms,", len(ks), "kernels")
    at = [i for i, (n, _) in enumerate(ks) if n == "_kda_decode_kernel"]
    for off, what in ((0, "KDA decode"), (1, "o_proj"), (2, "MoE gate"), (3, "experts gate_up")):
        ts = [ks[i + off][1] for i in at if i + off < len(ks)]
        names = sorted({ks[i + off][0] for i in at if i + off < len(ks)})
        print(f"  {what:16} median {statistics.median(ts):7.2f} us  sum {sum(ts):8.1f}  {names}")
PY
fi
if has lowrank; then  # the low-rank gates' up projections inside the KDA decode kernel: one launch fewer a layer
  timeout 200 python3 -m pytest -p no:cacheprovider -n 8 tests/ops/test_triton_kda_low_rank.py \
    tests/ops/test_triton_kda_decode.py tests/ops/test_triton_kda_norm_epilogue.py -rfE --tb=short 2>&1 \
    | grep -E "^E  |passed|failed" | cut -c1-300 | tail -8
  timeout 300 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab "${LOWRANK_BATCHES:-1,2,4,8,16}" \
    --pdl-configs "1:regs:0;1:regs:0:table:TOKENSPEED_KDA_FUSED_GATES=0;1:regs:0:table:TOKENSPEED_KDA_FUSED_GATES=1" \
    --out "$OUT" 2>&1 | grep "PDL A/B"
  mkdir -p "$OUT/lowrank_w8" "$OUT/lowrank_w8c"  # the fused variants on 8 warps (fewer registers a thread)
  timeout 200 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab 1 \
    --pdl-configs "1:regs:0;1:regs:0:table:TOKENSPEED_KDA_FUSED_GATES=0;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-split-w8" \
    --out "$OUT/lowrank_w8" 2>&1 | grep "PDL A/B"
  timeout 200 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab 2,4 \
    --pdl-configs "1:regs:0;1:regs:0:table:TOKENSPEED_KDA_FUSED_GATES=0;1:regs:0:table:TOKENSPEED_KDA_DECODE=bv32-chunked-w8-s3" \
    --out "$OUT/lowrank_w8c" 2>&1 | grep "PDL A/B"
  mkdir -p "$OUT/lowrank_profile"
  timeout 200 python3 benchmarks/step_profile_h200.py --batches 1 --skip prefill,policy --out "$OUT/lowrank_profile" \
    2>&1 | grep -E "graph|_kda_decode|stacked" | cut -c1-250 | head -12
  if [[ -z ${LOWRANK_QUICK:-} ]]; then
    timeout 240 python3 -m pytest -p no:cacheprovider tests/executor/test_cuda_graphs.py \
      -k no_triton --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
  fi
fi
if has check; then  # the checks left open on 2026-12-02: the GPU tests the last changes touch, then 96 x 64 again
  timeout 240 python3 -m pytest -p no:cacheprovider tests/executor/test_cuda_graphs.py \
    -k "no_triton or end_of_a_context" -rfE --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
  timeout 150 python3 -m pytest -p no:cacheprovider -n 8 tests/ops/test_triton_kda_decode.py \
    tests/ops/test_triton_kda_norm_epilogue.py tests/ops/test_triton_kda_replay.py -k "cuda or gpu" -rfE \
    --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-300 | tail -6
  timeout 150 python3 benchmarks/kda_decode_sweep_h200.py --shapes 96:64,32:64 --v-first --no-fla --reps 100 \
    --only=bv16-chunked-w4-s4 --out "$OUT/kda_decode_sweep_h200_check.json" 2>&1 \
    | tee "$OUT/kda_sweep_check.log" | grep -E "^== |  D  |best per|H= "
fi
if has rtests; then
  timeout 180 python3 -m pytest -p no:cacheprovider tests/ops/test_moe_simulate_routing.py \
    tests/engine/test_step_failure.py -rfE --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
fi
if has b1kda; then  # the batch-1 step (32 (sequence, head) pairs) with each KDA decode launch config, interleaved
  cfgs="1:regs:0"
  for label in ${B1_LABELS:-bv16-split-w4 bv32-split-w4 bv64-split-w4 bv32-chunked-w4-s3 bv16-chunked-w4-s3}; do
    cfgs="$cfgs;1:regs:0:table:TOKENSPEED_KDA_DECODE=$label"
  done
  timeout 300 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab 1 \
    --pdl-configs "$cfgs" --out "$OUT" 2>&1 | grep "PDL A/B"
fi
if has verify; then
  timeout 240 python3 benchmarks/kda_decode_sweep_h200.py --verify 4 --norm --v-first \
    --shapes "${VERIFY_SHAPES:-32:1,32:4,32:16,32:64,96:16,96:64}" \
    --only "${VERIFY_ONLY:-split,win,wy}" --out "$OUT/kda_decode_sweep_h200_verify.json" 2>&1 \
    | tee "$OUT/kda_sweep_verify.log" | grep -A12 "best per shape"
fi
if has verifykp; then
  timeout 240 python3 benchmarks/kda_decode_sweep_h200.py --verify 4 --norm --v-first \
    --shapes "${VERIFY_SHAPES:-32:1,32:4,32:16,32:64,96:16,96:64}" --only "bv32-split-w4-win,wy" \
    --out "$OUT/kda_decode_sweep_h200_verifykp.json" 2>&1 | tee "$OUT/kda_sweep_verifykp.log" | grep -A12 "best per shape"
  PYTEST_N=${PYTEST_N:-8} TIMEOUT=200 bash benchmarks/gpu_tests_h200.sh -k "wy" | tail -3
fi
if has bv8; then
  timeout 200 python3 benchmarks/kda_decode_sweep_h200.py --shapes "$big" --v-first --only "bv8-chunked,bv16-chunked" \
    --out "$OUT/kda_decode_sweep_h200_bv8.json" 2>&1 | tee "$OUT/kda_sweep_bv8.log" | grep -A4 "best per shape"
fi
if has replaygap; then
  timeout 200 python3 benchmarks/kda_replay_gap_h200.py --out "$OUT/kda_replay_gap_h200.json" 2>&1 \
    | tee "$OUT/kda_replay_gap.log" | tail -24
fi
if has replaywy; then
  timeout 240 python3 benchmarks/kda_replay_gap_h200.py --repeats 1 --time 1,4,16,64 \
    --out "$OUT/kda_replay_wy.json" 2>&1 | tee "$OUT/kda_replay_wy.log" | grep -E "wy|win |replay N"
  timeout 200 python3 -m pytest -n "${PYTEST_N:-8}" tests/ops/test_triton_kda_replay.py -k gpu -rfEp --tb=short \
    -p no:cacheprovider 2>&1 | tail -3
fi
if has nocompile; then
  timeout 200 python3 -m pytest -p no:cacheprovider tests/executor/test_cuda_graphs.py -k no_triton --tb=short \
    2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
  timeout 300 python3 -m pytest -n "${PYTEST_N:-8}" -p no:cacheprovider tests/executor/test_cuda_graphs.py \
    tests/ops/test_triton_kda_replay.py tests/ops/test_triton_gemv.py tests/ops/test_triton_gemv_fused.py \
    -k "(gpu or graphs or cuda) and not no_triton and not second_engine" -rfE --tb=line 2>&1 | tail -4
fi
if has spectest; then
  timeout 300 python3 -m pytest -n "${PYTEST_N:-4}" -p no:cacheprovider tests/executor/test_cuda_graphs.py \
    -k "prompt_tails_beside or (no_triton and ngram) or (graphs_capture and (verify or eagle3))" -rfE --tb=short \
    2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
fi
if has specgap; then
  timeout 300 python3 benchmarks/spec_host_gap_h200.py --concurrency "${SPEC_CONC:-16}" --out "$OUT" 2>&1 \
    | grep -E '"(step_ms_median|verify_gpu_ms_median|replay_gpu_ms_median|gpu_idle_ms_per_step)"'
  mkdir -p "$OUT/spec"
  timeout 240 python3 benchmarks/spec_h200.py --concurrency "${SPEC_CONC:-16}" --out "$OUT/spec" 2>&1 \
    | grep -E "^\{'model'" | cut -c1-400
fi
if has tailprof; then  # a swe-smith turn's tail on a 64K history, beside 15 decodes and alone: kernels + host
  mkdir -p "$OUT/tail15" "$OUT/tail0"
  timeout 330 python3 benchmarks/step_profile_h200.py --skip decode,policy --history 65536 --tails 256,1300 \
    --beside 15 --out "$OUT/tail15" 2>&1 | grep -vE "^\s*$" | cut -c1-220 | head -150
  timeout 200 python3 benchmarks/step_profile_h200.py --skip decode,policy --history 65536 --tails 1300 \
    --out "$OUT/tail0" 2>&1 | grep -E "^prefill" | cut -c1-300
fi
if has routing; then  # decode with the experts a balanced router would touch, against the dummy weights' own routing
  mkdir -p "$OUT/routing"
  timeout 420 python3 benchmarks/serving_h200.py --geometries kimi-linear-48b-a3b --routing-simulation uniform \
    --skip tiny,transformers,engine,prefill,profile,parity --out "$OUT/routing" 2>&1 | tail -14
  timeout 240 python3 -m pytest -v -p no:cacheprovider tests/ops/test_moe_simulate_routing.py \
    tests/engine/test_step_failure.py -rfE --tb=short 2>&1 | tee "$OUT/routing/tests.log" \
    | grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" | cut -c1-400
fi
if has tailbv; then  # the fused kernel's window loop on long tails at other V tiles (more programs, less per token)
  for label in ${TAIL_LABELS:-bv32-split-w4-win bv16-split-w4-win bv8-split-w4-win bv16-split-w2-win}; do
    mkdir -p "$OUT/tailbv_$label"
    echo "== TOKENSPEED_KDA_VERIFY=$label"
    TOKENSPEED_KDA_VERIFY=$label timeout 200 python3 benchmarks/step_profile_h200.py --skip decode,prefill \
      --history 65536 --policy-tails "${POLICY_TAILS:-512,1300,2048}" --out "$OUT/tailbv_$label" 2>&1 \
      | grep -E "^\{" | cut -c1-300
  done
fi
if has tailpolicy; then  # swe-smith-sized tails: fused KDA kernel (window loop) vs fla's chunked scan, each eager
  mkdir -p "$OUT/policy"
  timeout 400 python3 benchmarks/step_profile_h200.py --skip decode,prefill --history 65536 \
    --policy-tails "${POLICY_TAILS:-256,512,800,1300,2048}" --out "$OUT/policy" 2>&1 | grep -E "^\{" | cut -c1-400
fi
if has mlaexp; then  # MLA expanded prefill over a long history: expansion and attention variants
  timeout 300 python3 benchmarks/mla_expanded_h200.py --out "$OUT" 2>&1 | grep -vE "^\s*$" | cut -c1-1500 | tail -12
fi
if has sdpatest; then  # the split expanded attention and the per-head expansion against their references
  timeout 200 python3 -m pytest -n "${PYTEST_N:-4}" -p no:cacheprovider tests/ops/test_cuda_sdpa.py \
    tests/ops/test_triton_mla_decode.py tests/ops/test_triton_mla_gluon.py -k "gpu or cuda" -rfE --tb=short \
    2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
fi
if has sdpafirst; then  # cuDNN's first call at a new (query, key) shape against a repeat: bucketed vs exact plans
  for cfg in ${SDPA_CFGS:-"bshd:1:--warm" "bshd:1:" "bshd:0:" "bhsd:0:"}; do
    IFS=: read -r layout avoid warm <<< "$cfg"
    echo "== layout $layout TORCH_CUDNN_SDPA_AVOID_RECOMPILE=$avoid $warm"
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=$avoid timeout 150 python3 benchmarks/sdpa_first_call_h200.py --out "$OUT" \
      --layout $layout $warm 2>&1 | grep -E "^\{|Error|error" | cut -c1-400
  done
fi
if has memcheck; then  # do bucketed cuDNN calls read past a sequence's last row? (exact allocations vs ROW_SLACK)
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$cs" ]; then cs=$(find / -name compute-sanitizer -type f 2>/dev/null | head -1); fi
  if [ -z "$cs" ]; then echo "memcheck: no compute-sanitizer on this machine"; fi
  for slack in 0 128; do
    [ -n "$cs" ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 "$cs" --tool memcheck python3 \
      benchmarks/sdpa_row_slack_check.py --slack $slack 2>&1 | grep -E "^L |ERROR SUMMARY|Invalid|is out of bounds" \
      | sort | uniq -c | head -12
  done
fi
if has alignab; then  # the MoE alignment of prefill-sized calls: torch sort vs the multi-program kernels
  timeout 200 python3 benchmarks/moe_align_h200.py --out "$OUT" 2>&1 | grep -E "^\{" | cut -c1-400
  timeout 200 python3 -m pytest -p no:cacheprovider tests/ops/test_triton_moe_experts.py -k "gpu" -rfE \
    --tb=short 2>&1 | grep -E "^E  |passed|failed" | cut -c1-400
fi
if has nopdl; then
  timeout 240 python3 benchmarks/kda_decode_sweep_h200.py --shapes "$big" --only "$only" --pdl off \
    --out "$OUT/kda_decode_sweep_h200_nopdl.json" 2>&1 | tee "$OUT/kda_sweep_nopdl.log" | grep -A12 "best per shape"
fi
if has sizing; then
  timeout 200 python3 benchmarks/graph_sizing_h200.py --out "$OUT/graph_sizing_h200.json" 2>&1 | tail -32
fi
if has chain; then
  # one stage: the whole slice is the peeled first step; more stages only reserve shared memory (160 KB at 3)
  cfgs="o_proj=dot:64:256:16:4:1;o_proj=dot:32:512:8:4:1;o_proj=dot:64:512:8:8:1;o_proj=dot:128:256:16:8:1"
  cfgs="$cfgs;in_proj=dot:64:256:9:4:1;in_proj=dot:32:256:9:4:1"
  for cyc in 10000 20000; do
    timeout 150 python3 benchmarks/gemv_pdl_chain_h200.py --producer-cycles $cyc --configs "$cfgs" \
      --out "$OUT/chain_$cyc" 2>&1 | grep -B1 -A24 "^pdl prefetch"
  done
fi
if has chain || has k3; then
  k3="down_tp8=dot:64:256:28:4:1;down_tp8=dot:32:512:14:4:1;shared_gate_up_tp8=dot:64:256:28:4:1"
  k3="$k3;shared_gate_up_tp8=dot:32:512:14:4:1;down_full=dot:32:512:14:4:1;kda_in_tp8=dot:32:512:14:4:1"
  timeout 200 python3 benchmarks/gemv_pdl_chain_h200.py --geometry k3 --configs "$k3" --out "$OUT/chain_k3" 2>&1 \
    | grep -B1 -A24 "^pdl prefetch"
fi
if has ctx; then
  timeout 300 python3 benchmarks/gemv_h200.py --producer-cycles 20000 --ms 1,4 --budget-s 240 \
    --shapes "2304x4096,256x2304,12576x2304,6720x2304,448x7168,1536x7168,3584x7168,6284x7168" \
    --out "$OUT/gemv_ctx" --table "$OUT/gemv_ctx/gemv_table_ctx.json" 2>&1 | grep -A30 "N x K"
fi
if has ctxab; then
  timeout 240 python3 benchmarks/step_profile_h200.py --skip decode,prefill,policy --pdl-ab 1,4 \
    --pdl-configs "1:regs:0;1:regs:0:table=$OUT/gemv_ctx/gemv_table_ctx.json" --out "$OUT" 2>&1 | grep "PDL A/B"
fi
if has specab; then
  for lab in "" "${SPEC_VERIFY:-bv32-split-w4}"; do
    mkdir -p "$OUT/spec${lab:+_$lab}"
    TOKENSPEED_KDA_VERIFY="$lab" timeout 240 python3 benchmarks/spec_h200.py --concurrency "${SPEC_CONC:-1}" \
      --out "$OUT/spec${lab:+_$lab}" 2>&1 | grep -iE "TPS|replay|verify" | head -8
  done
fi
if has margin; then
  timeout 300 python3 benchmarks/marginal_cost_h200.py --batches "${MARGIN_BATCHES:-1,64}" \
    --out "$OUT/marginal_cost_h200.json" 2>&1 | tail -30
fi
