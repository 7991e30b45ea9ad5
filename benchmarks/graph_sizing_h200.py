"""Does a decode step's time depend on how its CUDA graphs were sized (max batch, max context)?

    PYTHONPATH=.:benchmarks python benchmarks/graph_sizing_h200.py --sizes 1x4096,64x4096,1x32768,64x32768

The same batch (`--batch` sequences at `--ctx` tokens of history) is replayed through `DecodeGraphs` built for
each (max_batch_size x max_context) of --sizes over their own cache buffers, timed interleaved (`--rounds`
rounds of CUDA-event medians over 20 replays). The engine sizes its graphs from --max-num-seqs and
--max-model-len, so a difference here is one every served step pays. The kernels of the first and the last
sizing (torch.profiler, one replay) are compared by name: the rows whose summed time differs most are printed.
Writes one JSON (command, commit, GPU, per sizing the step times, the kernel diff).
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch
from graph_timing import events_ms, write_result
from serving_h200 import decode_batch, decode_setup
from step_profile_h200 import kernels_of

from tokenspeed.executor.cuda_graphs import DecodeGraphs
from tokenspeed.models.loader import load_model


def by_name(kernels: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    """kernel name (first 90 characters) -> (launches, summed us)."""
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        row = out[name[:90]]
        row[0] += 1
        row[1] += us
    return {k: (n, us) for k, (n, us) in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="kimi-linear-48b-a3b")
    ap.add_argument("--sizes", default="1x4096,64x4096,1x32768,64x32768", help="max_batch x max_context, comma list")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/graph_sizing_h200.json")
    args = ap.parse_args()
    model = load_model(args.geometry, torch.bfloat16, "cuda", load_format="dummy", seed=0)
    page = 64
    runs = {}
    with torch.no_grad():
        for s in args.sizes.split(","):
            mb, mc = (int(v) for v in s.split("x"))
            buf, pps = decode_setup(model, mb, mc, page)
            g = DecodeGraphs(model, buf, mb, pps, scratch_page=mb * pps)
            g.sizes = sorted({args.batch, mb})  # this batch's bucket (and the largest, as the engine has it)
            g.capture()
            runs[s] = (g, decode_batch(args.batch, args.ctx, pps, page))
        times: dict[str, list[float]] = {s: [] for s in runs}
        for _ in range(args.rounds):
            for s, (g, fb) in runs.items():
                times[s].append(events_ms(lambda g=g, fb=fb: g.run(fb), 20, 3))
        names = list(runs)
        first, last = names[0], names[-1]
        ka, kb = (by_name(kernels_of(lambda s=s: runs[s][0].run(runs[s][1]))) for s in (first, last))
    rows = {s: {"step_ms": statistics.median(v), "all_ms": v} for s, v in times.items()}
    for s, r in rows.items():
        print(f"batch {args.batch} ctx {args.ctx}, graphs sized {s:>10}: {r['step_ms']:.3f} ms")
    diff = sorted(((kb.get(k, (0, 0.0))[1] - ka.get(k, (0, 0.0))[1], k) for k in set(ka) | set(kb)), reverse=True)
    table = [{"kernel": k, "us_delta": d, first: ka.get(k), last: kb.get(k)} for d, k in diff if abs(d) > 2.0]
    print(f"kernels, {last} minus {first} (us summed over one step, launches):")
    for r in table[:25]:
        print(f"  {r['us_delta']:+8.1f}  {r['kernel']}  {r[first]} -> {r[last]}")
    write_result(args.out, {"sizes": rows, "kernel_diff": table}, geometry=args.geometry, batch=args.batch,
                 ctx=args.ctx)


if __name__ == "__main__":
    main()
