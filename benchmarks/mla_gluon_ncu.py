"""One `mla_decode` call per form of the Gluon MLA split kernel, for Nsight Compute to profile on one H200: the bf16
cache, the fp8 cache (warp-specialized, bf16 dots) and the fp8 dots (`mla_gluon.FP8_DOTS`), at batch x context.

    ncu --kernel-name regex:_mla_split_gluon --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details \
        python benchmarks/mla_gluon_ncu.py [--batch 64 --ctx 32768]      # PYTHONPATH=.:benchmarks

Each form is called twice (the first compiles); profile the second launch of each (`--launch-skip 1
--launch-count 1` per form, or all and read the even ones). Prints the order of the forms.
"""

from __future__ import annotations

import argparse
import os

import torch
from mla_decode_h200 import DL, V, make_case

from tokenspeed.ops.triton import mla_decode as k_mla
from tokenspeed.ops.triton import mla_gluon

FORMS = (("bf16 cache", torch.bfloat16, "0"), ("fp8 cache", torch.float8_e4m3fn, "0"),
         ("fp8 dots", torch.float8_e4m3fn, "1"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--page", type=int, default=16)
    args = ap.parse_args()
    mla_gluon.SMALL_PAGES = True
    mla_gluon.FP8_CACHE = True
    for name, cache_dtype, f8d in FORMS:
        q, cache, table, kv = make_case([args.ctx] * args.batch, 1, torch.bfloat16, "cuda", page=args.page,
                                        cache_dtype=cache_dtype)
        os.environ[mla_gluon.FP8_DOTS_ENV] = f8d
        for _ in range(2):
            k_mla.mla_decode(q, cache, table, kv, DL ** -0.5, V)
        torch.cuda.synchronize()
        print("form:", name, flush=True)
        del q, cache, table, kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
