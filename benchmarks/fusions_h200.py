"""Issue 8 fusions on one GPU: each fused kernel against the unfused sequence it replaces, at kimi-linear-48b-a3b
shapes (hidden 2304; shared expert I = 1024, gate_up [T, 2048]; dense layer-0 MLP I = 9216, gate_up [T, 18432];
routed experts E 256, top 8, I 1024), T = 1, 64, 8192 tokens, bf16.

    PYTHONPATH=. python benchmarks/fusions_h200.py --out benchmarks/results/fusions_h200.json

Pairs timed (fused vs unfused, both as the model runs them on CUDA before / after the change):
- gated_activation: `ops.gated_activation_merged(gate_up)` (1 Triton launch) vs the torch reference on the chunk
  halves (gate.float(), up.float(), silu, mul, cast: 5 kernels), for I = 1024 and 9216.
- add_rms_norm: the Triton `add_rms_norm(x, residual)` (1 launch) vs `residual + x` (torch) then the Triton
  `rms_norm` (2 launches), hidden 2304.
- moe_add: the Triton `moe_experts(..., add=shared)` vs `moe_experts(...) + shared` (whole op, and the combine
  kernel alone with and without the add vs the combine then a torch add).
Method: parity first (every fused output against the reference: max |diff| / max |ref|, and bit equality with the
unfused path where the fusion promises it), then CUDA-event timing of eager calls (median of 50 after 5 warm-up
calls) and, for T <= 64, the per-call time inside a CUDA graph of 20 calls (how decode runs; median of 20 replays).
"bytes" is the fewest bytes each op must move; "hbm_pct" that over the time, as a % of 4.27 TB/s (the measured
H200 copy rate). The summary scales each saving by the op's calls per forward of the 27-layer model (26 shared
experts + 1 dense MLP activation, 54 residual junctions, 26 shared-expert adds) for T = 1 (a batch-1 decode
step, graph times) and T = 8192 (an 8K prefill chunk, eager times).
Exit status 1 when a parity check fails (the JSON is written first). `--smoke`: tiny shapes on the CPU through
the Triton interpreter (wall-clock times, no graphs), to check the script's plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch
import triton
from graph_timing import events_ms, replay_ms, warm_up  # benchmarks/graph_timing.py (the script folder is on sys.path)

from tokenspeed.ops.reference import activation as ref_act
from tokenspeed.ops.reference import moe as ref_moe
from tokenspeed.ops.reference import norm as ref_norm
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import activation as k_act
from tokenspeed.ops.triton import moe_experts as k_moe
from tokenspeed.ops.triton import norm as k_norm

HBM = 4.27e12  # bytes/s
EPS = 1e-6
SILU = Activation("silu")
FULL = {"tokens": (1, 64, 8192), "hidden": 2304, "shared_i": 1024, "dense_i": 9216, "experts": 256, "top_k": 8,
        "moe_i": 1024}
SMOKE = {"tokens": (1, 5), "hidden": 96, "shared_i": 48, "dense_i": 80, "experts": 8, "top_k": 2, "moe_i": 32}
# calls per forward of kimi-linear-48b-a3b (27 layers: layer 0 dense, 26 MoE with one shared expert)
CALLS = {"gated_activation_shared": 26, "gated_activation_dense": 1, "add_rms_norm": 54, "moe_add": 26}
GRAPH_MAX_T = 64


class Timer:
    """Eager and CUDA-graph per-call times in us (wall clock under the interpreter, no graphs)."""

    def __init__(self, smoke: bool, reps: int = 50, warmup: int = 5, graph_calls: int = 20) -> None:
        self.smoke, self.reps, self.warmup, self.graph_calls = smoke, reps, warmup, graph_calls

    def eager_us(self, fn: Callable[[], object]) -> float:
        if self.smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        return events_ms(fn, self.reps, self.warmup) * 1e3

    def graph_us(self, fn: Callable[[], object]) -> float | None:
        if self.smoke:
            return None
        warm_up(fn, 2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.graph_calls):
                fn()
        us = replay_ms(graph, 20) * 1e3 / self.graph_calls
        del graph
        return us

    def pair(self, fused: Callable[[], object], unfused: Callable[[], object], T: int, nbytes: int) -> dict:
        """Times of the fused and the unfused call (eager; graph for T <= GRAPH_MAX_T) and the fused HBM share."""
        row: dict = {}
        for name, fn in (("fused", fused), ("unfused", unfused)):
            row[f"{name}_eager_us"] = self.eager_us(fn)
            if T <= GRAPH_MAX_T:
                row[f"{name}_graph_us"] = self.graph_us(fn)
        best = row.get("fused_graph_us") or row["fused_eager_us"]
        row["bytes"] = nbytes
        row["hbm_pct"] = None if self.smoke else round(100 * nbytes / (best * 1e-6) / HBM, 1)
        return row


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp64 (NaN in a counts as a failure: inf)."""
    if torch.isnan(a).any():
        return float("inf")
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def randn(*shape: int, dev: str, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)


# ----------------------------------------------------------------------------- gated activation
def bench_activation(T: int, inter: int, dev: str, dtype: torch.dtype, timer: Timer) -> dict:
    gu = randn(T, 2 * inter, dev=dev, dtype=dtype, scale=3.0, seed=T + inter)
    fused = k_act.gated_activation_merged(gu, SILU)
    ref = ref_act.gated_activation_merged(gu, SILU)  # == the unfused model path (chunk halves, 5 kernels)
    parity = {"rel_err": rel(fused, ref), "unequal_frac": (fused != ref).double().mean().item()}
    parity["ok"] = parity["rel_err"] < (1e-2 if dtype != torch.float32 else 1e-5)
    elt = gu.element_size()
    row = timer.pair(lambda: k_act.gated_activation_merged(gu, SILU),
                     lambda: ref_act.gated_activation(*gu.chunk(2, dim=-1), SILU), T, 3 * T * inter * elt)
    return {"op": "gated_activation", "T": T, "I": inter, "parity": parity, **row}


# ----------------------------------------------------------------------------- residual add + RMSNorm
def bench_add_norm(T: int, d: int, dev: str, dtype: torch.dtype, timer: Timer) -> dict:
    x = randn(T, d, dev=dev, dtype=dtype, seed=1)
    r = randn(T, d, dev=dev, dtype=dtype, scale=4.0, seed=2)
    w = randn(d, dev=dev, dtype=dtype, scale=0.3, seed=3) + 1
    normed, summed = k_norm.add_rms_norm(x, r, w, EPS)
    ref_n, ref_s = ref_norm.add_rms_norm(x, r, w, EPS)
    parity = {"rel_err": rel(normed, ref_n), "summed_equal": bool(torch.equal(summed, ref_s)),
              "equal_to_unfused_triton": bool(torch.equal(normed, k_norm.rms_norm(r + x, w, EPS)))}
    parity["ok"] = parity["rel_err"] < (1e-2 if dtype != torch.float32 else 1e-5) and parity["summed_equal"]
    elt = x.element_size()
    row = timer.pair(lambda: k_norm.add_rms_norm(x, r, w, EPS), lambda: k_norm.rms_norm(r + x, w, EPS), T,
                     4 * T * d * elt + d * elt)
    return {"op": "add_rms_norm", "T": T, "D": d, "parity": parity, **row}


# ----------------------------------------------------------------------------- shared-expert add in the combine
def moe_inputs(T: int, cfg: dict, dev: str, dtype: torch.dtype) -> dict:
    E, k, D, DI = cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["moe_i"]
    g = torch.Generator(device="cpu").manual_seed(T)
    w = torch.rand(T, k, generator=g) + 0.1
    return {
        "x": randn(T, D, dev=dev, dtype=dtype, seed=4),
        "w1": randn(E, DI, D, dev=dev, dtype=dtype, scale=D ** -0.5, seed=5),
        "w3": randn(E, DI, D, dev=dev, dtype=dtype, scale=D ** -0.5, seed=6),
        "w2": randn(E, D, DI, dev=dev, dtype=dtype, scale=DI ** -0.5, seed=7),
        "tw": (w / w.sum(-1, keepdim=True) * 2.446).to(dev),  # kimi-linear's routed scaling
        "ids": torch.rand(T, E, generator=g).argsort(-1)[:, :k].to(dev),
        "s": randn(T, D, dev=dev, dtype=dtype, scale=0.5, seed=8),
    }


def combine(buf: torch.Tensor, tw: torch.Tensor, k: int, add: torch.Tensor | None) -> torch.Tensor:
    """The experts' combine kernel alone over a per-pair buffer [T*k, D] (with `add`: fused)."""
    T, D = buf.shape[0] // k, buf.shape[1]
    out = torch.empty(T, D, dtype=buf.dtype, device=buf.device)
    block_d = min(1024, triton.next_power_of_2(D))
    k_moe._combine_kernel[(T, triton.cdiv(D, block_d))](
        buf, tw, out, out if add is None else add, D, 0 if add is None else add.stride(0),
        TOP_K=k, BLOCK_D=block_d, HAS_ADD=add is not None, num_warps=4)
    return out


def bench_moe_add(T: int, cfg: dict, dev: str, dtype: torch.dtype, timer: Timer) -> list[dict]:
    m = moe_inputs(T, cfg, dev, dtype)
    args = (m["x"], m["w1"], m["w3"], m["w2"], m["tw"], m["ids"], SILU)
    fused = k_moe.moe_experts(*args, add=m["s"])
    unfused = k_moe.moe_experts(*args) + m["s"]
    parity = {"rel_err": rel(fused, ref_moe.moe_experts(*args, add=m["s"])),
              "equal_to_unfused": bool(torch.equal(fused, unfused))}
    parity["ok"] = parity["rel_err"] < (1e-2 if dtype != torch.float32 else 1e-5) and parity["equal_to_unfused"]
    D, k, elt = cfg["hidden"], cfg["top_k"], m["x"].element_size()
    whole = timer.pair(lambda: k_moe.moe_experts(*args, add=m["s"]), lambda: k_moe.moe_experts(*args) + m["s"],
                       T, 0)
    whole.pop("hbm_pct")
    whole.pop("bytes")
    buf = randn(T * k, D, dev=dev, dtype=dtype, seed=9)
    tw = m["tw"].reshape(-1).contiguous()
    alone = timer.pair(lambda: combine(buf, tw, k, m["s"]), lambda: combine(buf, tw, k, None) + m["s"], T,
                       (T * k * D + 2 * T * D) * elt + T * k * 4)
    return [{"op": "moe_experts_add", "T": T, "parity": parity, **whole},
            {"op": "moe_combine_add", "T": T, **alone}]


# ----------------------------------------------------------------------------- summary
def saving_us(rows: list[dict], op: str, T: int, graph: bool, **match) -> float | None:
    for r in rows:
        if r["op"] == op and r["T"] == T and all(r.get(k) == v for k, v in match.items()):
            key = "graph_us" if graph and r.get("fused_graph_us") is not None else "eager_us"
            return r[f"unfused_{key}"] - r[f"fused_{key}"]
    return None


def summarize(rows: list[dict], cfg: dict) -> dict:
    """Saved time per forward of the whole model: per-call savings times CALLS (decode T = 1 from graph times,
    prefill T = 8192 from eager times; the moe add from the combine kernel alone, the least noisy measure)."""
    out = {}
    for T, graph in ((cfg["tokens"][0], True), (cfg["tokens"][-1], False)):
        parts = {
            "gated_activation": CALLS["gated_activation_shared"] * (saving_us(rows, "gated_activation", T, graph,
                                                                              I=cfg["shared_i"]) or 0)
            + CALLS["gated_activation_dense"] * (saving_us(rows, "gated_activation", T, graph, I=cfg["dense_i"]) or 0),
            "add_rms_norm": CALLS["add_rms_norm"] * (saving_us(rows, "add_rms_norm", T, graph) or 0),
            "moe_add": CALLS["moe_add"] * (saving_us(rows, "moe_combine_add", T, graph) or 0),
        }
        parts["total"] = sum(parts.values())
        out[f"T={T}"] = {"timing": "graph" if graph else "eager", "saved_us_per_forward": parts,
                         "kernels_removed_per_forward": 4 * (CALLS["gated_activation_shared"]
                                                             + CALLS["gated_activation_dense"])
                         + CALLS["add_rms_norm"] + CALLS["moe_add"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/fusions_h200.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (plumbing only)")
    args = ap.parse_args()
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    cfg = SMOKE if smoke else FULL
    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    timer = Timer(smoke)
    rows: list[dict] = []
    for T in cfg["tokens"]:
        new = [bench_activation(T, inter, dev, dtype, timer) for inter in (cfg["shared_i"], cfg["dense_i"])]
        new.append(bench_add_norm(T, cfg["hidden"], dev, dtype, timer))
        new.extend(bench_moe_add(T, cfg, dev, dtype, timer))
        for r in new:
            print(json.dumps(r), flush=True)
        rows.extend(new)
    result = {
        "device": torch.cuda.get_device_name(0) if not smoke else "cpu (Triton interpreter, smoke)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "dtype": str(dtype), "shapes": cfg, "calls_per_forward": CALLS, "rows": rows,
        "summary": summarize(rows, cfg),
    }
    ok = all(r["parity"]["ok"] for r in rows if "parity" in r)
    result["parity_ok"] = ok
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    print(f"parity {'ok' if ok else 'FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
