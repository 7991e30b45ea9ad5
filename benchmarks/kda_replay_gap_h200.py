"""The multi-layer KDA replay of kimi-linear's shapes (32 heads x 128, bf16 inputs, fp32 pools, 4-token windows) on
the H200: each schedule's state against per-layer plain split replays of the same inputs, repeated (a race shows
as errors that vary between repeats, a schedule bug as a fixed error at one configuration only), and (--time) each
schedule's speed against the state read + write floor.

Written for the chunked-replay gap seen at 7f91510 (`test_multi_layer_replay_graph_gpu[chunked-bv32]`, 2.6e-4):
at 29c02e9 every chunked schedule matched the plain split within 1.7e-7, and the test's then reference, the window
loop, was the one 2.6e-4 away; with fp32 inputs (--fp32) 2.4e-7, so the gap is the window loop's conv expression
rounding a few bf16 conv outputs the other way. The WY replay (kda_replay_wy.py) is in both lists.

    PYTHONPATH=. python benchmarks/kda_replay_gap_h200.py [--layers 20] [--seqs 1,8] [--repeats 3] [--out JSON]
        [--fp32]              # fp32 inputs: no bf16 rounding of the conv outputs (a rounding gap vanishes)
        [--time 16,64]        # also time each schedule's replay at these batch sizes (every sequence replays
                              # --accept tokens), median of CUDA events, against the state read + write floor
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/kda_replay_gap_h200.py --smoke   # plumbing on the CPU
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import events_ms

from tests.ops.test_triton_kda_decode import make
from tests.ops.triton_env import rel_err
from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors
from tokenspeed.ops.triton.kda_decode import KdaConfig, kda_decode, kda_replay_layers

LOWER, K = -5.0, 4
H, D, DEV, DTYPE = 32, 128, "cuda", torch.bfloat16  # --smoke: 2, 32, "cpu", fp32


def case(L: int, N: int) -> tuple[list[dict], list[dict], torch.Tensor, list[int]]:
    """(layers, their per-layer split replays, accepted counts, slots): fresh inputs."""
    slots = list(range(1, N + 1))
    acc = torch.tensor([(n % (K + 1)) for n in range(N)] if N > 1 else [3], device=DEV)
    layers = [make([K] * N, H, D, DTYPE, DEV, slots=slots, num_slots=2 * N + 3, seed=l) for l in range(L)]
    want = [dict(x, conv_state=x["conv_state"].clone(), state=x["state"].clone()) for x in layers]
    for x in want:
        kda_decode(**x, lower_bound=LOWER, scale=1.0, update_state=True, seq_lens=acc, config=KdaConfig(D // 4))
    return layers, want, acc, slots


def errors(layers: list[dict], want: list[dict], acc: torch.Tensor, slots: list[int], cfg: KdaConfig) -> dict:
    """Max over layers of the state's relative error and whether every conv state matched, for one replay."""
    xs = [dict(x, conv_state=x["conv_state"].clone(), state=x["state"].clone()) for x in layers]
    table = KdaLayerTable.build([KdaLayerTensors(*(x[k] for k in KdaLayerTensors._fields)) for x in xs], strict=True)
    kda_replay_layers(table, xs[0]["state_indices"], xs[0]["cu_seqlens"], acc, lower_bound=LOWER, config=cfg,
                      max_seq_tokens=K)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return {"state_rel": max(rel_err(x["state"][slots], w["state"][slots]) for x, w in zip(xs, want)),
            "conv_equal": all(torch.equal(x["conv_state"][slots], w["conv_state"][slots]) for x, w in zip(xs, want))}


# The replay schedules timed (--time): the default's split form (window, BV 16 from 1024 programs), other split
# forms, and the chunked schedule (one program per head, the tiles pipelined; every token re-streams the state).
# The WY replay (two launches, kda_replay_wy.py; keys_pass makes no difference to it) at three tile widths.
TIMED = [KdaConfig(16, window=True), KdaConfig(32, window=True), KdaConfig(32), KdaConfig(32, chunked=True,
         num_stages=3), KdaConfig(16, chunked=True, num_stages=4), KdaConfig(8, chunked=True, num_stages=4),
         KdaConfig(64, wy=True), KdaConfig(32, wy=True), KdaConfig(16, wy=True)]


def time_replay(L: int, N: int, accept: int, cfg: KdaConfig, iters: int = 20) -> dict:
    """Median us of one multi-layer replay launch (N sequences, every one replaying `accept` of K tokens, L layers)
    and its share of the state floor (each replayed head's state read and written once, at 4.27 TB/s)."""
    layers = [make([K] * N, H, D, DTYPE, DEV, slots=list(range(1, N + 1)), num_slots=N + 2, seed=l)
              for l in range(L)]
    table = KdaLayerTable.build([KdaLayerTensors(*(x[k] for k in KdaLayerTensors._fields)) for x in layers],
                                strict=True)
    acc = torch.full((N,), accept, device=DEV)
    us = 1e3 * events_ms(lambda: kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], acc,
                                                   lower_bound=LOWER, config=cfg, state_v_first=True,
                                                   max_seq_tokens=K), reps=iters)
    floor = 2 * N * H * L * D * D * 4 / 4.27e12 * 1e6
    print(f"replay N={N:2d} L={L} accept {accept} {cfg.label:24s} {us:9.1f} us  floor {floor:7.1f} us "
          f"({100 * floor / us:5.1f}% of HBM)", flush=True)
    return {"N": N, "L": L, "accept": accept, "config": cfg.label, "us": us, "floor_us": floor}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU (Triton interpreter)")
    ap.add_argument("--fp32", action="store_true", help="fp32 inputs (conv outputs not rounded to bf16)")
    ap.add_argument("--time", default="", help="comma-separated batch sizes to time the replay schedules at")
    ap.add_argument("--accept", type=int, default=3, help="tokens every sequence replays in the timed runs")
    args = ap.parse_args()
    global H, D, DEV, DTYPE
    if args.fp32:
        DTYPE = torch.float32
    if args.smoke:
        H, D, DEV, DTYPE = 2, 32, "cpu", torch.float32
        args.layers, args.seqs, args.repeats = 2, "1", 1
    # the split replay itself (control), the window loop (its conv is summed in another expression form: on the GPU
    # an fp32 contraction difference can flip a bf16-rounded conv output), then the chunked schedules
    configs = [KdaConfig(D // 4), KdaConfig(D // 4, window=True)]
    configs += [KdaConfig(D // r, chunked=True, num_stages=s) for r in (2, 4, 8) for s in (1, 2, 3)]
    configs += [KdaConfig(D // 8, wy=True), KdaConfig(D // 4, wy=True)]  # the WY replay (another summation order)
    rows = []
    for N in (int(x) for x in args.seqs.split(",")):
        layers, want, acc, slots = case(args.layers, N)
        for cfg in configs:
            runs = [errors(layers, want, acc, slots, cfg) for _ in range(args.repeats)]
            rows.append({"N": N, "L": args.layers, "config": cfg.label, "runs": runs})
            rels = " ".join(f"{r['state_rel']:.1e}{'' if r['conv_equal'] else '!'}" for r in runs)
            print(f"N={N:2d} {cfg.label:24s} state rel err per repeat: {rels}", flush=True)
    timed = [time_replay(args.layers, int(n), args.accept, cfg) for n in args.time.split(",") if n
             for cfg in TIMED]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": str(DTYPE), "errors": rows, "timed": timed}, f, indent=1)


if __name__ == "__main__":
    main()
