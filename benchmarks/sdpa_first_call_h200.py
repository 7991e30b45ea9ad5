"""First-call cost of the expanded MLA attention at new shapes (what serving sees: every turn's tail and history
length is new), on one H200: the masked SDPA call against the split cuDNN calls (`ops/cuda/sdpa.py`), wall time
of the first call at a shape vs a repeat at the same shape.

    PYTHONPATH=. python benchmarks/sdpa_first_call_h200.py --out benchmarks/results [--layout bhsd|bshd]
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 PYTHONPATH=. python benchmarks/sdpa_first_call_h200.py --layout bshd ...

--layout: keys / values as views of head-major [H, S, d] tensors (what the model builds by default) or of [S, H, d]
ones (PyTorch's avoid-recompile path takes only that layout). The JSON is named by layout and that variable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from graph_timing import write_result

from tokenspeed.ops.cuda import sdpa

H, DQK, DV = 32, 192, 128


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def masked(q, k, v, scale):
    L, S = q.shape[2], k.shape[2]
    pos = torch.arange(L, device=q.device)[:, None] + (S - L)
    mask = torch.arange(S, device=q.device)[None, :] <= pos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default="800:50000,813:50813,1300:52113,1311:53424,4:53428,8192:40960,7344:49152")
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.layout == "bhsd":
        kbig = torch.randn(1, H, 70000, DQK, device="cuda", generator=g).bfloat16()
        vbig = torch.randn(1, H, 70000, DV, device="cuda", generator=g).bfloat16()
    else:  # [1, H, S, d] views of [1, S, H, d] storage
        kbig = torch.randn(1, 70000, H, DQK, device="cuda", generator=g).bfloat16().transpose(1, 2)
        vbig = torch.randn(1, 70000, H, DV, device="cuda", generator=g).bfloat16().transpose(1, 2)
    rows = []
    with torch.no_grad():
        for spec in args.shapes.split(","):
            L, S = (int(x) for x in spec.split(":"))
            q = torch.randn(1, H, L, DQK, device="cuda", generator=g).bfloat16()
            k, v = kbig[:, :, :S], vbig[:, :, :S]
            row = {"L": L, "S": S}
            for name, fn in (("masked", lambda q=q, k=k, v=v: masked(q, k, v, DQK ** -0.5)),
                             ("split", lambda q=q, k=k, v=v: sdpa.attend_split(q, k, v, DQK ** -0.5))):
                row[f"{name}_first_ms"] = wall_ms(fn)
                row[f"{name}_repeat_ms"] = statistics.median(wall_ms(fn) for _ in range(3))
            print(row, flush=True)
            rows.append(row)
    avoid = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "0")
    write_result(os.path.join(args.out, f"sdpa_first_call_h200_{args.layout}_avoid{avoid}.json"), {"rows": rows},
                 layout=args.layout, avoid_recompile=avoid)


if __name__ == "__main__":
    main()
