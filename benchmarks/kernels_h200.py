"""Issue 7 kernels on one GPU: each Triton kernel vs its torch reference vs the peer vs the memory roofline.

    PYTHONPATH=. python benchmarks/kernels_h200.py --out benchmarks/results

Kernels: rms_norm, gated_rms_norm, attn_res_mix_rms_norm (split / online / tile schedules), moe_route, kda_decode
(decode q_len 1 and verify q_len 4; peer: fla-core `fused_recurrent_kda` with the K3 flags, which does the gate,
L2 norm and beta sigmoid in-kernel but not the short conv). Times are `triton.testing.do_bench` medians, which
clear the L2 cache before every call (cold L2), as in shared/docs/h200-baseline.md, but at these sizes they
measure the host launch, not the kernel; so the headline numbers are per-call times from CUDA-graph replay (how
the engine runs decode) with a cold L2 (a memset before each call inside the graph, subtracted). Roofline = the
fewest bytes the op must move / 4.27 TB/s (the measured copy rate of the baseline; re-measured here too).
Also checks each timed shape against the reference once (max relative error recorded in the JSON).
Writes kernels_h200.json and kernels_h200.png to --out, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch  # noqa: E402
import triton  # noqa: E402
from graph_timing import replay_ms, warm_up  # benchmarks/graph_timing.py (the script's own folder is on sys.path)
from triton.testing import do_bench  # noqa: E402

from tokenspeed import ops as public_ops
from tokenspeed.ops.reference import attn_res as ref_attn_res
from tokenspeed.ops.reference import moe as ref_moe
from tokenspeed.ops.reference import norm as ref_norm
from tokenspeed.ops.triton import attn_res as k_attn_res
from tokenspeed.ops.triton import kda_decode as k_kda
from tokenspeed.ops.triton import moe_route as k_moe
from tokenspeed.ops.triton import norm as k_norm

HBM = 4.27e12  # bytes/s, shared/docs/h200-baseline.md
DEV = "cuda"
BF = torch.bfloat16
ROWS: list[dict] = []
SMOKE = False  # --smoke: tiny shapes on the CPU (Triton interpreter) to check the script's plumbing only


def pick(full, smoke):
    return smoke if SMOKE else full


def us(fn, rep=100) -> float:
    """Eager call: do_bench median (L2 cleared before each call; includes what the host launch costs the GPU)."""
    if SMOKE:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


_FLUSH = None


def graph_us(fn, cold=True, n=20, reps=15) -> float:
    """Per-call GPU time of `fn` replayed from a CUDA graph of n calls (how the engine runs decode).

    cold: each call is preceded by a 128 MiB memset (L2 is 60 MB) inside the graph, and a graph of the memsets
    alone is subtracted, so the call runs with a cold L2. Median over `reps` replays."""
    global _FLUSH
    if SMOKE:
        return us(fn)
    if _FLUSH is None:
        _FLUSH = torch.empty(128 << 20, dtype=torch.int8, device=DEV)
    warm_up(fn, 2)

    def capture(with_fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                if cold:
                    _FLUSH.zero_()
                if with_fn:
                    fn()
        return g

    def median_ms(g):
        return replay_ms(g, reps)

    try:
        total = median_ms(capture(True))
        base = median_ms(capture(False)) if cold else 0.0
    except Exception as e:  # reported, not fatal
        print("graph timing failed:", type(e).__name__, e)
        return float("nan")
    return max(total - base, 0.0) / n * 1e3


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def record(kernel, shape, nbytes, ours, ref=None, peer=None, peer_name=None, err=None, **extra):
    """ours / peer: cold-L2 graph-replay us; ref: the reference's time (graph if capturable, see ref_mode)."""
    roof = nbytes / HBM * 1e6
    row = dict(kernel=kernel, shape=shape, bytes=nbytes, ours_us=ours, ref_us=ref, peer_us=peer, peer=peer_name,
               roofline_us=roof, eff=roof / ours if ours else None,
               speedup_vs_ref=(ref / ours) if ref and ours else None,
               speedup_vs_peer=(peer / ours) if peer and ours else None, max_rel_err=err, **extra)
    ROWS.append(row)
    print(f"{kernel:28s} {shape:30s} ours {ours:8.2f} us  ref {ref or float('nan'):9.1f}  "
          f"peer {peer or float('nan'):7.1f}  roof {roof:8.2f}  eff {100 * roof / max(ours, 1e-9):5.1f}%  "
          f"eager {extra.get('ours_eager_us') or float('nan'):7.1f}  err {err}", flush=True)
    return row


def both(fn, rep=100):
    """(cold graph us, warm graph us, eager us) of our kernel."""
    return graph_us(fn, cold=True), graph_us(fn, cold=False), us(fn, rep)


def measure_copy() -> float:
    if SMOKE:
        return HBM
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), rep=200, return_mode="median") * 1e-3
    del a, b
    return 2 * n / t


def bench_norms(quick: bool):
    d = pick(7168, 96)
    for M in pick([1, 4, 64, 4096], [1, 3]):
        x = torch.randn(M, d, device=DEV, dtype=BF)
        w = torch.randn(d, device=DEV, dtype=BF)
        err = rel(k_norm.rms_norm(x, w, 1e-5), ref_norm.rms_norm(x, w, 1e-5))
        cold, warm, eager = both(lambda: k_norm.rms_norm(x, w, 1e-5))
        record("rms_norm", f"[{M}, {d}] bf16", 2 * x.numel() * 2 + d * 2, cold,
               graph_us(lambda: ref_norm.rms_norm(x, w, 1e-5)), err=err, ours_warm_us=warm, ours_eager_us=eager,
               ref_mode="graph")
    for T in pick([1, 64, 4096], [2]):
        x = torch.randn(T, 12, 128, device=DEV, dtype=BF)
        g = torch.randn(T, 12, 128, device=DEV, dtype=BF)
        w = torch.randn(128, device=DEV)
        err = rel(k_norm.gated_rms_norm(x, g, w, 1e-5), ref_norm.gated_rms_norm(x, g, w, 1e-5))
        cold, warm, eager = both(lambda: k_norm.gated_rms_norm(x, g, w, 1e-5))
        record("gated_rms_norm", f"[{T}, 12, 128] bf16", 3 * x.numel() * 2, cold,
               graph_us(lambda: ref_norm.gated_rms_norm(x, g, w, 1e-5)), err=err, ours_warm_us=warm,
               ours_eager_us=eager, ref_mode="graph")


def bench_attn_res(quick: bool):
    D = pick(7168, 80)
    for n in pick([7, 11], [3]):
        for T in pick([1, 4, 16, 64, 512, 4096], [2]):
            blocks = torch.randn(n, T, D, device=DEV, dtype=BF)
            partial = torch.randn(T, D, device=DEV, dtype=BF)
            q = torch.randn(D, device=DEV) * 0.05
            nw = torch.randn(D, device=DEV, dtype=BF)
            ref = ref_attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5)
            t_ref = graph_us(lambda: ref_attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5), n=5)
            nbytes = (n + 2) * T * D * 2
            auto = k_attn_res.choose_schedule(T, D, n, torch.device(DEV))
            scheds = ["online"] + (["tile"] if T <= 64 else [])
            if DEV == "cuda" and T * triton.cdiv(D, k_attn_res.SPLIT_SLICE) <= k_attn_res._num_sms(
                    torch.device(DEV)):
                scheds.insert(0, "split")
            for sched in scheds:
                out = k_attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5, schedule=sched)
                fn = lambda: k_attn_res.attn_res_mix_rms_norm(  # noqa: E731
                    blocks, partial, q, 1e-6, nw, 1e-5, schedule=sched)
                if sched == auto:
                    cold, warm, eager = both(fn)
                else:
                    cold, warm, eager = graph_us(fn), None, None
                record(f"attn_res_mix_rms_norm/{sched}", f"{n + 1} cand, [{T}, {D}] bf16", nbytes, cold, t_ref,
                       err=rel(out, ref), default=sched == auto, schedule=sched, ours_warm_us=warm,
                       ours_eager_us=eager, ref_mode="graph")


def bench_router(quick: bool):
    for E, k in pick([(896, 16), (256, 8)], [(40, 4)]):
        for T in pick([1, 64, 4096], [2]):
            logits = torch.randn(T, E, device=DEV, dtype=BF)
            bias = torch.randn(E, device=DEV) * 0.1
            w, ids = k_moe.moe_route(logits, bias, k)
            wr, ir = ref_moe.moe_route(logits, bias, k)
            same = (ids == ir).all(1)
            cold, warm, eager = both(lambda: k_moe.moe_route(logits, bias, k))
            record("moe_route", f"E={E} k={k} T={T} bf16", T * E * 2 + E * 4 + T * k * 12, cold,
                   graph_us(lambda: ref_moe.moe_route(logits, bias, k)), err=rel(w[same], wr[same]),
                   ids_equal_frac=same.double().mean().item(), ours_warm_us=warm, ours_eager_us=eager,
                   ref_mode="graph")


def kda_inputs(N, L, H, D, slots_total=None):
    T = N * L
    C = 3 * H * D
    S = slots_total or N
    merged = torch.randn(T, C + 2 * D + H, device=DEV, dtype=BF)
    return dict(
        qkv=merged[:, :C], f=torch.randn(T, H * D, device=DEV, dtype=BF), b=merged[:, C + 2 * D:],
        conv_weight=torch.randn(C, 4, device=DEV) * 0.5, conv_state=torch.randn(S, C, 3, device=DEV, dtype=BF),
        A_log=torch.randn(H, device=DEV) * 0.5, dt_bias=torch.randn(H, D, device=DEV) * 0.5,
        state=torch.randn(S, H, D, D, device=DEV) * 0.3,
        state_indices=torch.randperm(S, device=DEV)[:N],
        cu_seqlens=torch.arange(0, T + 1, L, device=DEV, dtype=torch.int64),
    )


def fla_peer(inp, N, L, H, D=128):
    """fla-core fused_recurrent_kda on the conv output, K3 flags; returns a callable or None."""
    if SMOKE:
        return None
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception as e:  # pragma: no cover
        print("fla-core unavailable:", e)
        return None
    T = N * L
    q = torch.randn(N, L, H, D, device=DEV, dtype=BF)
    k = torch.randn(N, L, H, D, device=DEV, dtype=BF)
    v = torch.randn(N, L, H, D, device=DEV, dtype=BF)
    g = torch.randn(N, L, H, D, device=DEV, dtype=BF)
    beta = torch.randn(N, L, H, device=DEV, dtype=torch.float32)
    h0 = inp["state"][inp["state_indices"]].clone()
    del T

    def run():
        return fused_recurrent_kda(q, k, v, g, beta, A_log=inp["A_log"], dt_bias=inp["dt_bias"], scale=D ** -0.5,
                                   initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    return run


def kda_bytes(N, L, H, D, update: bool):
    """(state bytes, all bytes): state and conv state read (+ written when updating), qkv/f/b read, o written."""
    rw = 2 if update else 1
    state = rw * N * H * D * D * 4
    conv = rw * N * 3 * H * D * 3 * 2
    io = N * L * (3 * H * D + H * D + H + H * D) * 2
    return state, state + conv + io


def bench_kda(quick: bool):
    D = pick(128, 16)
    for H in pick([12, 96], [2]):
        for N in pick([1, 16, 64], [2]):
            for L in ([1, 4] if H != 96 else [1]):
                inp = kda_inputs(N, L, H, D, slots_total=max(N, 64))
                mode = "decode" if L == 1 else "verify"
                upd = L == 1
                scale = D ** -0.5
                # parity once (copies of the pools)
                a = {k: (v.clone() if k in ("state", "conv_state") else v) for k, v in inp.items()}
                r = {k: (v.clone() if k in ("state", "conv_state") else v) for k, v in inp.items()}
                o = k_kda.kda_decode(**a, lower_bound=-5.0, scale=scale, update_state=upd)
                o_ref = public_ops._kda_decode_reference(**r, lower_bound=-5.0, scale=scale, update_state=upd,
                                                         step_states=None)
                err = max(rel(o, o_ref), rel(a["state"], r["state"]))
                state_b, all_b = kda_bytes(N, L, H, D, upd)

                def ours(bv=None, nw=None, hints=False):
                    return lambda: k_kda.kda_decode(**inp, lower_bound=-5.0, scale=scale, update_state=upd,
                                                    BV=bv, num_warps=nw, hints=hints)
                configs = {}
                for bv, nw, hints in pick([(32, 4, False), (64, 4, False), (32, 4, True), (64, 4, True),
                                           (32, 2, False), (64, 8, False)], [(8, 4, False)]):
                    key = f"BV={bv},w={nw}" + (",hints" if hints else "")
                    try:
                        configs[key] = graph_us(ours(bv, nw, hints))
                    except Exception as e:  # a config that fails to compile is reported, not fatal
                        configs[key] = f"error: {type(e).__name__}"
                numeric = {k: v for k, v in configs.items() if isinstance(v, float)}
                best_cfg = min(numeric, key=numeric.get)
                cold, warm, eager = both(ours())
                ref_fn = lambda: public_ops._kda_decode_reference(  # noqa: E731
                    **inp, lower_bound=-5.0, scale=scale, update_state=upd, step_states=None)
                t_ref = us(ref_fn, rep=30)
                peer = fla_peer(inp, N, L, H, D)
                t_peer = t_peer_eager = None
                if peer is not None:
                    t_peer_eager = us(peer)
                    try:
                        t_peer = graph_us(peer)
                    except Exception as e:
                        print("fla graph capture failed:", type(e).__name__, e)
                cfg_d = k_kda.default_config(N * H, D, L)
                record(f"kda_{mode}", f"H={H} N={N} q_len={L}", all_b, cold, t_ref, t_peer,
                       "fla fused_recurrent_kda", err=err, state_bytes=state_b,
                       state_bw_frac=state_b / (cold * 1e-6) / HBM,
                       best_config=best_cfg, best_us=numeric[best_cfg],
                       best_state_bw_frac=state_b / (numeric[best_cfg] * 1e-6) / HBM,
                       configs=configs, default_config=cfg_d.label, ours_warm_us=warm,
                       ours_eager_us=eager, peer_eager_us=t_peer_eager, ref_mode="eager (host syncs)",
                       speedup_vs_peer_eager=(t_peer_eager / cold) if t_peer_eager else None)
                del inp


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in ROWS if r.get("default", True)]
    fams = []
    for r in rows:
        fam = r["kernel"].split("/")[0]
        if fam not in fams:
            fams.append(fam)
    fig, axes = plt.subplots(len(fams), 1, figsize=(13, 3.2 * len(fams)))
    for ax, fam in zip(axes, fams):
        rs = [r for r in rows if r["kernel"].split("/")[0] == fam]
        x = range(len(rs))
        w = 0.2
        ax.bar([i - 1.5 * w for i in x], [r["ours_us"] for r in rs], w, label="ours (Triton)")
        ax.bar([i - 0.5 * w for i in x], [r["ref_us"] or 0 for r in rs], w, label="torch reference")
        if any(r["peer_us"] for r in rs):
            ax.bar([i + 0.5 * w for i in x], [r["peer_us"] or 0 for r in rs], w, label="fla fused_recurrent_kda")
        ax.bar([i + 1.5 * w for i in x], [r["roofline_us"] for r in rs], w, label="roofline (bytes / 4.27 TB/s)")
        ax.set_yscale("log")
        ax.set_ylabel("us (median)")
        ax.set_title(fam)
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["shape"] for r in rs], fontsize=7, rotation=12)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    global SMOKE, DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="norms,attn_res,router,kda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (plumbing check)")
    ap.add_argument("--check-split", action="store_true",
                    help="run the spin-barrier AttnRes schedule once and exit (run it under `timeout`)")
    args = ap.parse_args()
    if args.check_split:
        blocks = torch.randn(11, 8, 7168, device=DEV, dtype=BF)
        partial = torch.randn(8, 7168, device=DEV, dtype=BF)
        q, nw = torch.randn(7168, device=DEV) * 0.05, torch.randn(7168, device=DEV, dtype=BF)
        for _ in range(3):
            y = k_attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5, schedule="split")
        torch.cuda.synchronize()
        print("split schedule ok, err", rel(y, ref_attn_res.attn_res_mix_rms_norm(blocks, partial, q, 1e-6, nw, 1e-5)))
        return
    if args.smoke:
        SMOKE, DEV = True, "cpu"
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.time()
    copy_bw = measure_copy()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (baseline doc: 4.27)")
    parts = args.only.split(",")
    if "norms" in parts:
        bench_norms(args.quick)
    if "attn_res" in parts:
        bench_attn_res(args.quick)
    if "router" in parts:
        bench_router(args.quick)
    if "kda" in parts:
        bench_kda(args.quick)
    commit = os.environ.get("BENCH_COMMIT")  # the device copy of the tree has no .git: pass it in
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() or None
        except Exception:
            commit = None
    meta = dict(gpu=torch.cuda.get_device_name() if not SMOKE else "cpu (smoke)", torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), copy_bw_TBps=copy_bw / 1e12, hbm_roofline_TBps=HBM / 1e12,
                commit=commit, seconds=time.time() - t0,
                command="PYTHONPATH=. python benchmarks/kernels_h200.py --out benchmarks/results",
                timing="ours/peer/ref(graph): CUDA graph of 20 calls each after a 128 MiB memset, minus a graph of the "
                       "memsets, median of 15 replays (cold L2); *_warm_us: same without memsets; *_eager_us and "
                       "KDA ref: triton.testing.do_bench median (L2 cleared)")
    with open(os.path.join(args.out, "kernels_h200.json"), "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1)
    try:
        plot(os.path.join(args.out, "kernels_h200.png"))
    except Exception as e:
        print("plot failed:", e)
    print("\n=== summary (default configs; ours/peer = cold-L2 CUDA-graph replay per call) ===")
    print(f"{'kernel':28s} {'shape':30s} {'ours us':>8s} {'eager':>7s} {'ref us':>9s} {'peer us':>8s} "
          f"{'roof us':>8s} {'eff':>6s} {'x ref':>7s} {'x peer':>7s}")
    for r in ROWS:
        if not r.get("default", True):
            continue
        print(f"{r['kernel']:28s} {r['shape']:30s} {r['ours_us']:8.2f} {r.get('ours_eager_us') or math.nan:7.1f} "
              f"{r['ref_us'] or math.nan:9.1f} {r['peer_us'] or math.nan:8.1f} {r['roofline_us']:8.2f} "
              f"{100 * (r['eff'] or 0):5.1f}% {r['speedup_vs_ref'] or math.nan:7.1f} "
              f"{r['speedup_vs_peer'] or math.nan:7.1f}")
    for r in ROWS:
        if r["kernel"].startswith("kda"):
            print(f"{r['kernel']} {r['shape']}: state {100 * r['state_bw_frac']:.1f}% of 4.27 TB/s; peer eager "
                  f"{r['peer_eager_us'] or math.nan:.1f} us (x{r['speedup_vs_peer_eager'] or math.nan:.1f}); "
                  f"configs { {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r['configs'].items()} }")

if __name__ == "__main__":
    main()
