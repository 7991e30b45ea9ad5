"""`mla_decode`'s Gluon split kernel (`tokenspeed/ops/triton/mla_gluon.py`, explicit cp.async double buffering)
against its Triton keys-major split kernel, on one H200: both through `mla_decode` (the same combine), the Gluon
one switched by `mla_gluon.ENABLED`.

    PYTHONPATH=.:benchmarks python benchmarks/mla_gluon_h200.py [--out JSON]
    PYTHONPATH=DIR:.:benchmarks python benchmarks/mla_gluon_h200.py --compile-sm90   # no GPU; DIR: Triton 3.6

Per case (batch x context as `mla_decode_h200.py --loops`, the mixed batch, ragged ends): the max relative error
of the Gluon path against the Triton one, then split + combine time from a CUDA graph of 20 calls after
L2-clearing memsets (`mla_decode_h200.graph_us`) for both, and the HBM share. --compile-sm90: shared memory,
registers, spill stack and the main loop's instructions / spill reloads of the sm_90 compile, per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton
from mla_decode_h200 import DL, HBM, PAGE, H, V, graph_us, make_case, rel

from tokenspeed.ops.triton import mla_decode as k_mla
from tokenspeed.ops.triton import mla_gluon


WS_KNOBS = ("WS_FP8", "WS_MIN_SEQS", "WS_MAXNREG")


def gluon_decode(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                 on: bool, wide: bool = True, ws: bool | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """`mla_decode` (split + combine, each path's default split count) with its Gluon split kernel on or off (and
    its 64-row tiles on or off; ws: the warp-specialized fp8 kernel forced on (at any batch, with `maxnreg`) or
    off, None: the defaults); q [N, Q, H, 576] bf16."""
    prev = mla_gluon.ENABLED, mla_gluon.WIDE_ROWS, {k: getattr(mla_gluon, k) for k in WS_KNOBS if hasattr(mla_gluon, k)}
    mla_gluon.ENABLED, mla_gluon.WIDE_ROWS = on, wide
    if ws is not None:  # (a tree before the warp-specialized kernel ignores these)
        mla_gluon.WS_FP8, mla_gluon.WS_MIN_SEQS, mla_gluon.WS_MAXNREG = ws, 1, maxnreg
    try:
        return k_mla.mla_decode(q, cache, table, kv_lens, scale, V)
    finally:
        mla_gluon.ENABLED, mla_gluon.WIDE_ROWS = prev[:2]
        for k in WS_KNOBS:
            if k in prev[2]:
                setattr(mla_gluon, k, prev[2][k])
            elif hasattr(mla_gluon, k):
                delattr(mla_gluon, k)


CASES = [(f"b{b}_{c // 1024}k", [c] * b) for c in (4096, 32768) for b in (1, 4, 16, 64)]
CASES += [("mixed_b16", [65536, 16384, 4096, 1024] * 4), ("equal_1x64k", [65536]), ("ragged_ends", [4097, 100, 64, 1])]
CASES += [("b1_128k", [131072]), ("b16_64k", [65536] * 16)]  # the agentic histories
# around mla_gluon.WS_MIN_SEQS: 8 sequences, and 16 / 32 sequences with short histories (few keys a split)
CASES += [("b8_4k", [4096] * 8), ("b8_32k", [32768] * 8), ("b16_1k", [1024] * 16), ("b32_1k", [1024] * 32)]
CASES = [(name, lens, 1, H) for name, lens in CASES]
# verify steps (4 query tokens: EAGLE3 with 3 drafts) and K3's head counts (12 a rank at TP8, 96 attention-DP)
CASES += [("verify4_b16_32k", [32768] * 16, 4, H), ("verify4_b1_4k", [4096], 4, H),
          ("k3tp8_b64_32k", [32768] * 64, 1, 12), ("k3tp8_verify4_b16_32k", [32768] * 16, 4, 12),
          ("k3dp_b16_32k", [32768] * 16, 1, 96), ("k3dp_b64_4k", [4096] * 64, 1, 96),
          ("verify4_b64_4k", [4096] * 64, 4, H)]


# The variants --compile-sm90 builds (keyword arguments of `compile_sm90`): what the model and K3 launch.
COMPILE_VARIANTS = {
    "decode H32": {}, "decode H32 BLOCK_SEQ 64": {"block_seq": 64}, "decode H32 ALL_PARTIAL": {"all_partial": True},
    "decode H16": {"heads": 16, "block_h": 16}, "decode H12 (K3 TP8)": {"heads": 12, "block_h": 16},
    "decode H96 (K3)": {"heads": 96}, "verify Q4 H32": {"qn": 4}, "verify Q4 H12": {"qn": 4, "heads": 12, "block_h": 16},
    "verify Q4 H32, 64 rows": {"qn": 4, "block_h": 64},
    "verify Q4 H32, 64 rows, ALL_PARTIAL": {"qn": 4, "block_h": 64, "all_partial": True},
    "decode H96, 64 rows": {"heads": 96, "block_h": 64}, "decode H64, 64 rows": {"heads": 64, "block_h": 64},
    "decode H32, page 16": {"page": 16}, "verify Q4 H32, 64 rows, page 16": {"qn": 4, "block_h": 64, "page": 16},
    "decode H32, fp8 cache": {"fp8": True}, "verify Q4 H32, 64 rows, fp8 cache": {"qn": 4, "block_h": 64, "fp8": True},
    "decode H16, fp8, page 16": {"heads": 16, "block_h": 16, "fp8": True, "page": 16},
    "decode H32, fp8, warp-specialized": {"fp8": True, "ws": True},
    "decode H32, fp8, page 16, warp-specialized": {"fp8": True, "page": 16, "ws": True},
    "decode H12, fp8, page 16, warp-specialized": {"heads": 12, "block_h": 16, "fp8": True, "page": 16, "ws": True},
    "verify Q4 H32, fp8, page 16, warp-specialized": {"qn": 4, "fp8": True, "page": 16, "ws": True},
}
# (each with `mla_gluon.LAZY_SUM` as set; the per-tile softmax sum, TOKENSPEED_MLA_GLUON_LAZY_SUM=0, in two of them)
COMPILE_VARIANTS.update({"decode H32, page 16, per-tile sum": {"page": 16, "lazy": False},
                         "decode H32, fp8, page 16, warp-specialized, per-tile sum": {"fp8": True, "page": 16,
                                                                                       "ws": True, "lazy": False}})
# the fp8 dots (`mla_gluon.FP8_DOTS`) of the warp-specialized kernel
COMPILE_VARIANTS.update({
    "decode H32, fp8, page 16, warp-specialized, fp8 dots": {"fp8": True, "page": 16, "ws": True, "f8d": True},
    "decode H32, fp8, warp-specialized, fp8 dots": {"fp8": True, "ws": True, "f8d": True},
    "decode H12, fp8, page 16, warp-specialized, fp8 dots": {"heads": 12, "block_h": 16, "fp8": True, "page": 16,
                                                             "ws": True, "f8d": True},
    "verify Q4 H32, fp8, page 16, warp-specialized, fp8 dots": {"qn": 4, "fp8": True, "page": 16, "ws": True,
                                                                "f8d": True}})


def compile_sm90(block_seq: int = 16, heads: int = H, all_partial: bool = False, use_pdl: bool = True, qn: int = 1,
                 block_h: int = 32, page: int = PAGE, fp8: bool = False, ws: bool = False,
                 lazy: bool | None = None, f8d: bool = False) -> dict:
    """Compile the Gluon split kernel for sm_90 without a GPU (`sm90_compile`'s target and Triton's own ptxas /
    cuobjdump): shared memory, registers, spill stack and main-loop instructions / spill reloads. lazy: the
    LAZY_L constexpr (None: `mla_gluon.LAZY_SUM`); f8d: the fp8 dots (F8D, with ws)."""
    from sm90_compile import TARGET, cubin_usage, loop_usage
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = mla_gluon._mla_split_gluon_kernel
    ptrs = {"Qp": "*bf16", "QR": "*bf16", "CACHE": "*fp8e4nv" if fp8 else "*bf16", "PT": "*i32", "KV_LENS": "*i64", "O": "*bf16",
            "PART": "*fp32", "LSE": "*fp32"}
    strides = ("stride_qn", "stride_qj", "stride_qh", "stride_rn", "stride_rj", "stride_rh", "stride_cp")
    consts = {"QN": qn, "H": heads, "PAGE": page, "DV": V, "ROW": DL, "BLOCK_H": block_h, "BLOCK_N": mla_gluon.BLOCK_N,
              "BLOCK_SEQ": block_seq, "ALL_PARTIAL": all_partial, "KV_BYTES": 1 if fp8 else 2, "WS": ws,
              "WS_REGS": mla_gluon.WS_PRODUCER_REGS, "PDL": use_pdl,
              "LAZY_L": mla_gluon.LAZY_SUM if lazy is None else lazy, "F8D": f8d, "P_SCALE": mla_gluon.P_SCALE}
    sig = {**ptrs, **dict.fromkeys(strides, "i64"), "stride_pt": "i64", "N": "i32", "MAX_SPLITS": "i32", "min_chunk": "i32",
           "sm_scale_log2": "fp32", "kv_scale": "fp32", **dict.fromkeys(consts, "constexpr")}
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in (*ptrs, *strides)}  # as the JIT derives
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=TARGET,
                            options={"num_warps": 4 * triton.cdiv(block_h, 32)})
    return {"shared": kernel.metadata.shared, **cubin_usage(kernel), **loop_usage(kernel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mla_gluon_h200.json")
    ap.add_argument("--compile-sm90", action="store_true", help="only compile for sm_90 (no GPU) and report")
    ap.add_argument("--compile-json", help="with --compile-sm90: also write the report (per variant) to this JSON")
    ap.add_argument("--cases", default="", help="comma list of substrings: only the cases whose name has one")
    ap.add_argument("--fp8", action="store_true", help="an fp8 e4m3 cache (turns mla_gluon.FP8_CACHE on)")
    ap.add_argument("--page", type=int, default=PAGE,
                    help="cache page size; not a multiple of 64 turns mla_gluon.SMALL_PAGES on (a page per key row)")
    ap.add_argument("--ws-ab", action="store_true",
                    help="with --fp8: time the warp-specialized fp8 path against the one-warpgroup one and against "
                         "the same case over a bf16 cache, and check the two fp8 paths bit for bit")
    ap.add_argument("--ws-maxnreg", type=int, default=0,
                    help="with --ws-ab: also time the warp-specialized kernel launched with this maxnreg")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton kernel's timing (slow over fp8)")
    ap.add_argument("--f8d-ab", action="store_true",
                    help="with --fp8: the warp-specialized kernel (forced at every batch) with bf16 dots and with the "
                         "fp8 dots (mla_gluon.FP8_DOTS) against each other")
    ap.add_argument("--lazy-ab", action="store_true",
                    help="also time the kernel with the softmax sum kept per key lane (mla_gluon.LAZY_SUM_ENV=1) "
                         "against the default, and compare their outputs")
    args = ap.parse_args()
    if args.compile_sm90:
        report = {}
        for name, kw in COMPILE_VARIANTS.items():
            report[name] = {**kw, **compile_sm90(**kw)}
            print(f"{name}: {report[name]}", flush=True)
        if args.compile_json:
            with open(args.compile_json, "w") as f:
                json.dump(report, f, indent=1)
        return
    t0, rows = time.time(), []
    picks = [c for c in args.cases.split(",") if c]
    mla_gluon.SMALL_PAGES = args.page % mla_gluon.BLOCK_N != 0
    mla_gluon.FP8_CACHE = args.fp8
    cache_dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    for name, lens, qn, heads in CASES:
        if picks and not any(p in name for p in picks):
            continue
        q, cache, table, kv = make_case(lens, qn, torch.bfloat16, "cuda", heads=heads, page=args.page,
                                        cache_dtype=cache_dtype)
        scale = DL ** -0.5
        row = {"case": name, "batch": len(lens), "ctx": max(lens), "q_len": qn, "heads": heads}
        try:
            got = gluon_decode(q, cache, table, kv, scale, True)
        except Exception as e:  # noqa: BLE001 - the prototype failing to build or launch is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(name, row["error"], flush=True)
            rows.append(row)
            continue
        want = gluon_decode(q, cache, table, kv, scale, False)
        row["max_rel_err_vs_triton"] = rel(got, want)
        nbytes = sum(lens) * DL * cache.element_size()
        args_ = (q, cache, table, kv, scale)
        forms = [] if args.no_triton else [("triton", lambda a=args_: gluon_decode(*a, False))]
        forms.append(("gluon", lambda a=args_: gluon_decode(*a, True)))
        if qn * heads > 32:  # the 64-row tiles against 32-row ones
            forms.append(("gluon32", lambda a=args_: gluon_decode(*a, True, False)))
        if args.fp8 and args.ws_ab:
            one = gluon_decode(q, cache, table, kv, scale, True, ws=False)
            two = gluon_decode(q, cache, table, kv, scale, True, ws=True)
            row["ws_bit_equal"] = bool(torch.equal(two, one))
            row["ws_max_rel_err"] = rel(two, one)
            cache16 = cache.to(torch.bfloat16)  # the same values (fp8 -> bf16 is exact), twice the bytes
            row["bf16_max_rel_err"] = rel(gluon_decode(q, cache16, table, kv, scale, True), got)
            forms.append(("gluon_ws", lambda a=args_: gluon_decode(*a, True, ws=True)))
            if args.ws_maxnreg:
                forms.append((f"gluon_ws{args.ws_maxnreg}",
                              lambda a=args_: gluon_decode(*a, True, ws=True, maxnreg=args.ws_maxnreg)))
            forms.append(("gluon_1wg", lambda a=args_: gluon_decode(*a, True, ws=False)))
            forms.append(("gluon_bf16", lambda a=(q, cache16, table, kv, scale): gluon_decode(*a, True)))
        if args.fp8 and args.f8d_ab:
            def f8d(a=args_):
                os.environ[mla_gluon.FP8_DOTS_ENV] = "1"
                try:
                    return gluon_decode(*a, True, ws=True)
                finally:
                    os.environ.pop(mla_gluon.FP8_DOTS_ENV)
            out = f8d()
            row["f8d_max_rel_err"] = rel(out, got)  # against the bf16 dots (the fp8 -> bf16 tiles are exact)
            row["f8d_nan"] = bool(out.isnan().any())
            forms.append(("gluon_ws", lambda a=args_: gluon_decode(*a, True, ws=True)))
            forms.append(("gluon_f8d", f8d))
        if args.lazy_ab:
            def lazy(a=args_):
                os.environ[mla_gluon.LAZY_SUM_ENV] = "1"
                try:
                    return gluon_decode(*a, True)
                finally:
                    os.environ.pop(mla_gluon.LAZY_SUM_ENV)
            row["lazy_max_rel_err"] = rel(lazy(), got)
            forms.append(("gluon_lazy", lazy))
        for form, fn in forms:
            t = graph_us(fn, n=20)
            row[f"{form}_us"] = t
            nb = sum(lens) * DL * 2 if form == "gluon_bf16" else nbytes
            row[f"{form}_hbm"] = nb / (t * 1e-6) / HBM if math.isfinite(t) and t > 0 else None
        rows.append(row)
        print(f"{name:22s} err {row['max_rel_err_vs_triton']:.2e}  "
              + "  ".join(f"{form} {row[form + '_us']:8.2f} us ({100 * (row[form + '_hbm'] or 0):4.1f}%)"
                          for form, _ in forms)
              + (f"  ws bit-equal {row['ws_bit_equal']}" if "ws_bit_equal" in row else ""), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"), "page": args.page,
            "cache_dtype": str(cache_dtype),
            "timing": "CUDA graph of 20 calls after 256 MiB memsets, memsets subtracted, median of 10",
            "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
