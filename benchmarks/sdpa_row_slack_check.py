"""Does a bucketed cuDNN attention call (`ops/cuda/sdpa.py`) touch memory past a sequence's last query / key row?
Run under compute-sanitizer with PyTorch's caching allocator off, so that every tensor is its own allocation and
a read past its end is reported:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python benchmarks/sdpa_row_slack_check.py --slack 0      # exact allocations
    ... --slack 128                                              # the ROW_SLACK the engine allocates

Prints one line per shape; the sanitizer's report (or "ERROR SUMMARY: 0 errors") is the result.
"""

from __future__ import annotations

import argparse

import torch

from tokenspeed.ops.cuda import sdpa

H, DQK, DV = 8, 192, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slack", type=int, default=0)
    ap.add_argument("--shapes", default="1:1,3:3,5:70,129:129,17:1999,300:3001,200:777")
    args = ap.parse_args()
    sdpa.ROW_SLACK = args.slack
    assert sdpa.bucketed_plans()
    for spec in args.shapes.split(","):
        L, S = (int(x) for x in spec.split(":"))
        q = torch.randn(L, H, DQK, device="cuda").bfloat16()
        k = sdpa.padded_rows(S, H, DQK, dtype=torch.bfloat16, device="cuda").normal_()
        v = sdpa.padded_rows(S, H, DV, dtype=torch.bfloat16, device="cuda").normal_()
        out = sdpa.attention_expanded(q, k, v, [0, L], [0, S], DQK ** -0.5)
        torch.cuda.synchronize()
        print(f"L {L} S {S} slack {args.slack}: out finite {bool(out.float().isfinite().all())}", flush=True)


if __name__ == "__main__":
    main()
