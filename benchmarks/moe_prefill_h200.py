"""Routed experts at prefill sizes on one H200: our Triton grouped kernels (default tiles, a few full-op tiles, and a
per-kernel sweep of the prefill variants of `ExpertsConfig`) vs the grouped-GEMM path (`torch._grouped_mm`,
`tokenspeed.ops.cuda.moe_grouped`) vs the matmul rate measured in the run.

    PYTHONPATH=. python benchmarks/moe_prefill_h200.py [--out benchmarks/results/moe_prefill_h200.json]
        [--geometries kimi-linear-48b-a3b,k3-slice] [--tokens 8192] [--skip REGEX] [--only REGEX] [--no-sweep]

Geometries: kimi-linear-48b-a3b (E 256, top-8, D 2304, I 1024, SiLU) and k3-slice (E 64, top-16 in the 3584 latent,
I 3072, SiTU), bf16, T = 8192 tokens by default, router ids from a seeded random softmax (roughly balanced, as dummy
weights give). FLOPs = 6 * T * k * D * I (gate, up, down; gate/up 4/6 of them, down 2/6). Times: CUDA events
around 4 back-to-back eager calls, per call, median of 5 after a warm-up (the host side of a launch overlaps the
previous call's kernels).

Full-op paths (`paths`): the default config, the grouped GEMM and five tile choices, each against the default
(max relative error = max |a - b| / max |b|, and relative L2); the default against the torch reference too.

Sweep (`sweep`): gate/up variants (`GATE_UP`) and down variants (`DOWN`), each a whole `ExpertsConfig`; each one's
full op is first checked against the default on the GPU (a variant failing to compile or launch, or off by more than
2e-2, is recorded with its error and not timed), then the kernel it varies is timed alone on a prepared alignment
(`gather_ms` separately for the pre-gathered x, `gate_up_ms` / `down_ms`). Per M-block size the fastest gate/up and
down variants are then combined into one config (`best`), whose full op is checked and timed with its stage split.
JSON is rewritten after every variant, so a run that dies (a launch error poisons the CUDA context) keeps what it
measured; `--skip` the culprit and run again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import asdict, replace

import torch
from graph_timing import events_ms

from tokenspeed.models import resolve_config
from tokenspeed.ops.cuda import moe_grouped
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts
from tokenspeed.ops.triton import moe_experts as tk
from tokenspeed.ops.triton.moe_align import align_pairs

TILES = {  # (block_m, bn1, bk1, warps1, stages1, bn2, bk2, warps2, stages2): full-op runs, as measured before
    "m64n128k64": (64, 128, 64, 8, 3, 128, 64, 4, 4),
    "m128n128k64": (128, 128, 64, 8, 3, 128, 64, 8, 3),
    "m128n64k64": (128, 64, 64, 8, 3, 128, 64, 8, 3),
    "m128n128k64s4": (128, 128, 64, 8, 4, 128, 64, 8, 4),
    "m64n256k64": (64, 256, 64, 8, 3, 256, 64, 8, 3),
}

# The two measured prefill defaults; every variant below changes one kernel's fields of one of them.
B64 = tk.ExpertsConfig(64, 256, 64, 8, 3, 256, 64, 8, 3)  # kimi-linear default (<= 256 rows per expert)
B128 = tk.ExpertsConfig(128, 128, 64, 8, 4, 128, 64, 8, 4)  # k3-slice default
# Shared memory per stage (bf16, BK 64): gate/up (BM + 2 BN) * 128 B, down (BM + BN) * 128 B; sm_90 has 227 KB.
GATE_UP = {  # g<BM>[_n<BN>][_s<stages>]_g<group>[_gx][_tma][_tail]
    "g64": B64,
    "g64_g8": replace(B64, group_m1=8),
    "g64_g8_tma": replace(B64, group_m1=8, tma1=True),
    "g64_g8_gx": replace(B64, group_m1=8, gather_x=True),
    "g64_g8_gx_tma": replace(B64, group_m1=8, gather_x=True, tma1=True),
    "g64_n128_s4_g8_tma": replace(B64, block_n1=128, num_stages1=4, group_m1=8, tma1=True),
    "g128": B128,
    "g128_g8": replace(B128, group_m1=8),
    "g128_g8_tail": replace(B128, group_m1=8, tail_m1=True),
    "g128_g8_tma": replace(B128, group_m1=8, tma1=True),
    "g128_g8_tma_tail": replace(B128, group_m1=8, tma1=True, tail_m1=True),
    "g128_g16_tma_tail": replace(B128, group_m1=16, tma1=True, tail_m1=True),
    "g128_g8_gx_tma": replace(B128, group_m1=8, gather_x=True, tma1=True),
    "g128_g8_gx_tma_tail": replace(B128, group_m1=8, gather_x=True, tma1=True, tail_m1=True),
}
DOWN = {  # d<BM>[_m<BM2>][_n<BN>][_w<warps>][_s<stages>]_g<group>[_tma][_tail]
    "d64": B64,
    "d64_g8": replace(B64, group_m2=8),
    "d64_g8_tma": replace(B64, group_m2=8, tma2=True),
    "d64_s4_g8_tma": replace(B64, num_stages2=4, group_m2=8, tma2=True),
    "d64_n128_w4_s4_g8_tma": replace(B64, block_n2=128, num_warps2=4, num_stages2=4, group_m2=8, tma2=True),
    "d128": B128,
    "d128_g8": replace(B128, group_m2=8),
    "d128_g8_tma": replace(B128, group_m2=8, tma2=True),
    "d128_g8_tma_tail": replace(B128, group_m2=8, tma2=True, tail_m2=True),
    "d128_n256_s3_g8_tma": replace(B128, block_n2=256, num_stages2=3, group_m2=8, tma2=True),
    "d128_n256_s3_g8_tma_tail": replace(B128, block_n2=256, num_stages2=3, group_m2=8, tma2=True, tail_m2=True),
    "d128_m64_n256_s3_g8_tma": replace(B128, block_m2=64, block_n2=256, num_stages2=3, group_m2=8, tma2=True),
}
TILE_CONFIGS = {tag: tk.ExpertsConfig(*t) for tag, t in TILES.items()}
GATE_UP_FIELDS = ("block_n1", "block_k1", "num_warps1", "num_stages1", "group_m1", "gather_x", "tma1", "tail_m1")
DOWN_FIELDS = ("block_n2", "block_k2", "num_warps2", "num_stages2", "group_m2", "block_m2", "tma2", "tail_m2")
MAX_REL_OK = 2e-2
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU dry run (interpreter, fp32) patches these


def per_call_ms(fn, reps: int = 5, warmup: int = 1, calls: int = 4) -> float:
    """Median over `reps` of the CUDA-event time of `calls` back-to-back calls, per call: the host work of a launch
    (descriptor encoding included) overlaps the previous call's kernels, so it is not counted as GPU time."""
    def many():
        for _ in range(calls):
            fn()
    return events_ms(many, reps=reps, warmup=warmup) / calls


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = events_ms(lambda: a @ b, reps=20)
    return 2 * 8192**3 / ms / 1e9


def errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    y, ref = y.float(), ref.float()
    if torch.isnan(y).any():
        return {"max_rel": float("nan"), "rel_l2": float("nan")}
    return {"max_rel": ((y - ref).abs().max() / ref.abs().max()).item(),
            "rel_l2": ((y - ref).norm() / ref.norm()).item()}


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


class Case:
    """One geometry's inputs, and the stage-by-stage calls of the op for a config."""

    def __init__(self, name: str, T: int):
        cfg, _ = resolve_config(name)
        self.E, self.k, self.I = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
        self.D = cfg.routed_expert_hidden_size or cfg.hidden_size
        self.act = Activation(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.name, self.T = name, T
        g = torch.Generator(device=DEVICE).manual_seed(0)
        dt = DTYPE
        E, D, I = self.E, self.D, self.I
        self.x = torch.randn(T, D, device=DEVICE, dtype=dt, generator=g)
        self.w1 = torch.randn(E, I, D, device=DEVICE, dtype=dt, generator=g) * D**-0.5
        self.w3 = torch.randn(E, I, D, device=DEVICE, dtype=dt, generator=g) * D**-0.5
        self.w2 = torch.randn(E, D, I, device=DEVICE, dtype=dt, generator=g) * I**-0.5
        logits = torch.randn(T, E, device=DEVICE, generator=g)
        self.tw, self.ids = torch.softmax(logits, -1).topk(self.k, -1)
        self.P = T * self.k
        self.flops = 6 * self.P * D * I
        self._align = {}

    def op(self, cfg: tk.ExpertsConfig | None = None) -> torch.Tensor:
        return tk.moe_experts(self.x, self.w1, self.w3, self.w2, self.tw, self.ids, self.act, config=cfg)

    def align(self, bm: int):
        if bm not in self._align:
            self._align[bm] = align_pairs(self.ids, self.E, bm)
        return self._align[bm]

    def stages(self, cfg: tk.ExpertsConfig, which: tuple[str, ...]) -> dict:
        """Median ms of each listed stage alone, on inputs prepared by the earlier stages."""
        sp, be = self.align(cfg.block_m)
        out = {}
        if "align" in which:
            out["align_ms"] = per_call_ms(lambda: align_pairs(self.ids, self.E, cfg.block_m))
        xs = None
        if cfg.gather_x:
            def gather():
                return tk.gather_sorted_x(self.x, sp, be, self.k, self.E, cfg.block_m)
            xs = gather()
            if "gate_up" in which:
                out["gather_ms"] = per_call_ms(gather)
        def gate_up():
            return tk.gate_up(self.x, self.w1, self.w3, sp, be, self.k, self.act, cfg, xs=xs)
        h = gate_up()
        if "gate_up" in which:
            out["gate_up_ms"] = per_call_ms(gate_up)
            fl = 4 * self.P * self.D * self.I
            out["gate_up_tflops"] = fl / (out["gate_up_ms"] + out.get("gather_ms", 0.0)) / 1e9
        if "down" in which:
            out["down_ms"] = per_call_ms(lambda: tk.down(h, self.w2, sp, be, self.P, cfg))
            out["down_tflops"] = 2 * self.P * self.D * self.I / out["down_ms"] / 1e9
        return out


def log(case: Case, tag: str, rec: dict) -> None:
    if "error" in rec:
        print(f"{case.name} T={case.T} {tag:>28}: {rec['error']}", flush=True)
        return
    parts = [f"{k} {v:.3f}" for k, v in rec.items() if k == "ms" or k.endswith(("_ms", "tflops", "pct_matmul"))]
    parts += [f"max_rel {rec['max_rel']:.1e}"] if "max_rel" in rec else []
    print(f"{case.name} T={case.T} {tag:>28}: " + "  ".join(parts), flush=True)


def full_paths(case: Case, ref: torch.Tensor, peak: float, res: dict, save) -> None:
    paths = {"triton_default": lambda: case.op(),
             "grouped_mm": lambda: moe_grouped.moe_experts(case.x, case.w1, case.w3, case.w2, case.tw, case.ids,
                                                            case.act)}
    for tag, c in TILE_CONFIGS.items():
        paths[f"triton_{tag}"] = lambda c=c: case.op(c)
    for tag, fn in paths.items():
        try:
            err = errors(fn(), ref)
            ms = per_call_ms(fn)
            res[tag] = {"ms": ms, "tflops": case.flops / ms / 1e9, "pct_matmul": 100 * case.flops / ms / 1e9 / peak,
                        **err}
        except Exception as e:  # noqa: BLE001 - a tile that does not fit shared memory: record and go on
            res[tag] = {"error": short(e)}
        log(case, tag, res[tag])
        save()


def fastest(sw: dict, kind: str, key: str, bm: int) -> str | None:
    """The sweep entry of this kind and M-block with the least time (gather included), if any ran."""
    cands = [(r[key] + r.get("gather_ms", 0.0), t) for t, r in sw.items()
             if r["kind"] == kind and "error" not in r and r["config"]["block_m"] == bm]
    return min(cands)[1] if cands else None


def sweep(case: Case, ref: torch.Tensor, res: dict, save, keep) -> None:
    sw = res.setdefault("sweep", {})
    items = [("gate_up", t, c) for t, c in GATE_UP.items()] + [("down", t, c) for t, c in DOWN.items()]
    items.sort(key=lambda it: it[2].tma1 or it[2].tma2)  # TMA last: a bad launch there poisons the CUDA context
    for kind, tag, cfg in items:
        if not keep(tag):
            continue
        rec = {"config": asdict(cfg), "kind": kind}
        try:
            err = errors(case.op(cfg), ref)
            rec.update(err)
            if not err["max_rel"] <= MAX_REL_OK:
                raise AssertionError(f"output off the default: max_rel {err['max_rel']:.2e}")
            rec.update(case.stages(cfg, (kind,)))
        except Exception as e:  # noqa: BLE001 - compile / launch / parity failure: record it, time nothing
            rec["error"] = short(e)
        sw[tag] = rec
        log(case, tag, rec)
        save()
    best = res.setdefault("best", {})
    for bm in sorted({c.block_m for c in list(GATE_UP.values()) + list(DOWN.values())}):
        g, d = fastest(sw, "gate_up", "gate_up_ms", bm), fastest(sw, "down", "down_ms", bm)
        if g is None or d is None:
            continue
        cfg = replace(GATE_UP[g], **{f: getattr(DOWN[d], f) for f in DOWN_FIELDS})
        rec = {"gate_up": g, "down": d, "config": asdict(cfg)}
        try:
            rec.update(errors(case.op(cfg), ref))
            rec["ms"] = per_call_ms(lambda c=cfg: case.op(c))
            rec["tflops"] = case.flops / rec["ms"] / 1e9
            rec.update(case.stages(cfg, ("align", "gate_up", "down")))
        except Exception as e:  # noqa: BLE001 - recorded like a variant's failure
            rec["error"] = short(e)
        best[f"bm{bm}"] = rec
        log(case, f"best bm{bm} {g}+{d}", rec)
        save()
    base = res["default_stages"]
    base_ms = base["gate_up_ms"] + base.get("gather_ms", 0.0) + base["down_ms"]
    for tag, rec in best.items():
        if "error" not in rec:
            ms = rec["gate_up_ms"] + rec.get("gather_ms", 0.0) + rec["down_ms"]
            rec["gemm_speedup_vs_default"] = base_ms / ms
            print(f"{case.name} T={case.T} {tag}: GEMMs {ms:.3f} ms vs default {base_ms:.3f} ms "
                  f"({base_ms / ms:.2f}x); full op {rec['ms']:.3f} ms", flush=True)
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe_prefill_h200.json")
    ap.add_argument("--geometries", default="kimi-linear-48b-a3b,k3-slice")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--skip", default="", help="regex of sweep variant names to leave out")
    ap.add_argument("--only", default="", help="regex: sweep only the variants it matches")
    ap.add_argument("--no-sweep", action="store_true", help="only the full-op paths")
    args = ap.parse_args()

    def keep(tag: str) -> bool:
        return not (args.skip and re.search(args.skip, tag)) and (not args.only or re.search(args.only, tag))

    t0 = time.time()
    peak = matmul_tflops()
    print(f"matmul bf16 8192^3: {peak:.1f} TFLOP/s", flush=True)
    res = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__,
                   "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d")},
           "matmul_tflops": peak, "cases": []}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save() -> None:
        res["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    with torch.no_grad():
        for name in args.geometries.split(","):
            for T in (int(t) for t in args.tokens.split(",")):
                case = Case(name, T)
                c = {"geometry": name, "T": T, "E": case.E, "k": case.k, "D": case.D, "I": case.I,
                     "act": case.act.kind, "gflop": case.flops / 1e9, "default_config": asdict(
                         tk.default_config(T, case.k, case.E, case.D, case.I))}
                res["cases"].append(c)
                ref = case.op().float()
                c["default_vs_reference"] = errors(
                    ref, ref_experts(case.x, case.w1, case.w3, case.w2, case.tw, case.ids, case.act))
                c["default_stages"] = case.stages(tk.default_config(T, case.k, case.E, case.D, case.I),
                                                  ("align", "gate_up", "down"))
                log(case, "default stages", c["default_stages"])
                full_paths(case, ref, peak, c, save)
                if not args.no_sweep:
                    sweep(case, ref, c, save, keep)
                del case
                torch.cuda.empty_cache()
    save()
    print(f"wall {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
