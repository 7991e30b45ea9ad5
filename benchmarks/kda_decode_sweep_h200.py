"""KDA decode launch variants on one H200: parity against the torch reference, CUDA-graph time, % of HBM.

    PYTHONPATH=.:benchmarks python benchmarks/kda_decode_sweep_h200.py --out benchmarks/results/kda_decode_sweep_h200.json
    PYTHONPATH=.:benchmarks python benchmarks/kda_decode_sweep_h200.py --device cpu --out /tmp/kda_sweep_smoke.json  # plumbing

For each shape (H heads x N sequences, one token each, head dim K = V = 128: 12 x 1, 32 x 1, 32 x 8, 32 x 16,
32 x 64, 96 x 16, 96 x 64) and each `KdaConfig` of VARIANTS (the original split launches, `legacy_config`, and
the chunked schedule with several tile widths / warps / stages; `default_config`'s choice is marked), this
  1. checks parity on the GPU against `ops._kda_decode_reference` (the composition of torch reference ops) from
     the same pools: max |o - o_ref| and its relative value, the relative error of the new state rows, whether the
     new conv-state rows are equal and the pool slots outside the batch untouched;
  2. times the launch from a CUDA graph of `calls` launches after a side-stream warm-up: CUDA events around each
     replay, median of `--reps` (>= 50) replays, divided by `calls`. The state keeps advancing in place.
     Warm L2 (no flush) is enough where the state is far bigger than the 60 MB L2: the state read is 403 MB at
     96 x 64 and 134 MB at 32 x 64, so it streams from HBM anyway. Smaller states (100 MB at 96 x 16, 34 / 17 MB
     at 32 x 16 / 32 x 8, 2 / 0.8 MB at 32 x 1 / 12 x 1) would partly or wholly stay in L2 across replays, which a
     real decode step (other layers in between) never sees: below 120 MB (--cold auto) each variant is also timed
     with a cold L2 (a 128 MiB memset before every call inside the graph, a graph of the memsets alone
     subtracted, as benchmarks/kernels_h200.py does) and that time (`us_cold`) is the one compared (`us`);
  3. times fla-core's `fused_recurrent_kda` on the same shape, called as benchmarks/kernels_h200.py calls it (the
     K3 flags: L2 norm, gate and beta sigmoid in-kernel; it does not do the short conv; h0 a contiguous copy of
     the batch's states, final state written to a new buffer: the same state bytes);
  4. times torch's copy of the same bytes (state read once, written once) in the same harness: the practical
     ceiling a state-streaming kernel is held against beside the 4.27 TB/s floor.
Bandwidth: state bytes = N * H * K * V * 4 * 2 (fp32 state read and written once) / time, as a % of 4.27 TB/s
(the H200 copy rate of shared/docs/h200-baseline.md); the conv state, projections and outputs (~4% more bytes)
are not counted. Registers / spills / shared memory of each compiled variant come from the launched kernel.

Inputs: bf16 projections shaped like the model's merged projection (qkv and b strided column slices of one
[T, 3HD + 2D + H] GEMM output), bf16 conv-state pool and fp32 state pool with 2N + 8 slots, random slot indices.
Robust: a variant that fails (compile error, out of resources, a parity exception) is recorded with its error and
skipped. Triton compiles every (variant, H) once (~3 s each); --jobs worker processes compile them in parallel
first (one tiny launch each, same specialisation; the on-disk Triton cache then serves the main process).
The whole default run should take about 1.5 minutes on the H200 host (about half of it compiling).
--device cpu: tiny shapes (H 2, N 1 / 3, D 32, fp32) on the Triton interpreter, block_v scaled by D / 128, no
graphs, no fla: checks the script's plumbing only.
Writes JSON (--out) and prints a table per shape and the best variant per shape (for `DECODE_TABLE`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time


def _device_arg(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cuda"


if _device_arg(sys.argv) == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch
import triton

from tokenspeed import ops as public_ops
from tokenspeed.ops.triton import kda_decode as k_kda
from tokenspeed.ops.triton.kda_decode import KdaConfig

HBM = 4.27e12  # bytes/s
COLD_BELOW = 120e6  # state bytes read below which a cold-L2 time is taken too (2x the H200's 60 MB L2)
LOWER = -5.0
# (H, N): the shapes, plus 32 x 8 and 32 x 16 (256 / 512 heads, where split and chunked should cross; no
# extra compiles, H = 32 is compiled anyway)
SHAPES = [(12, 1), (32, 1), (32, 8), (32, 16), (32, 64), (96, 16), (96, 64)]
D_GPU = 128
SMOKE_SHAPES = [(2, 1), (2, 3)]
D_SMOKE = 32

# The variants (written for head dim 128). split: the original kernel ([K, block_v] tile per program, V split
# over D / block_v programs); bv32 / bv64 w4 are legacy_config's two choices. chunked: one program per head walks
# its tiles (num_stages - 1 in flight through shared memory; s1: the next tile prefetched into registers).
VARIANTS = [
    KdaConfig(32),
    KdaConfig(64),
    KdaConfig(32, num_warps=2),
    KdaConfig(16),
    KdaConfig(32, chunked=True, num_stages=3),
    KdaConfig(32, chunked=True, num_stages=4),
    KdaConfig(16, chunked=True, num_stages=3),
    KdaConfig(16, chunked=True, num_stages=4),
    KdaConfig(8, chunked=True, num_stages=4),
    KdaConfig(8, chunked=True, num_stages=3),  # BV 8 (the best at 96 x 64, 84.1%): stage depth, warps, hints
    KdaConfig(8, chunked=True, num_stages=5),
    KdaConfig(8, chunked=True, num_stages=6),
    KdaConfig(8, chunked=True, num_warps=2, num_stages=4),
    KdaConfig(8, chunked=True, num_stages=4, hints=True),
    KdaConfig(16, chunked=True, num_stages=5),
    KdaConfig(16, chunked=True, num_warps=2, num_stages=4),
    KdaConfig(32, chunked=True, num_stages=1),
    KdaConfig(32, chunked=True, num_stages=3, hints=True),
    KdaConfig(32, chunked=True, num_stages=3, prefetch_state=True),  # the chunked default + the state L2 prefetch
    # the first tile loaded before the token inputs (it streams in during them)
    KdaConfig(8, chunked=True, num_stages=4, preload=True),
    KdaConfig(16, chunked=True, num_stages=4, preload=True),
    KdaConfig(16, chunked=True, num_stages=3, preload=True),
    KdaConfig(32, chunked=True, num_stages=3, preload=True),
    KdaConfig(32, chunked=True, num_stages=3, preload=True, max_regs=128),
    KdaConfig(32, chunked=True, num_stages=2, preload=True),
    KdaConfig(16, chunked=True, num_stages=4, preload=True, max_regs=104),
    KdaConfig(8, chunked=True, num_stages=4, preload=True, max_regs=72),
    # capped registers: more resident programs per SM (72 / 96 / 162 registers allow 7 / 5 / 3 of 4 warps)
    KdaConfig(8, chunked=True, num_stages=4, max_regs=64),
    KdaConfig(8, chunked=True, num_stages=4, max_regs=56),
    KdaConfig(8, chunked=True, num_stages=4, max_regs=48),
    KdaConfig(16, chunked=True, num_stages=4, max_regs=80),
    KdaConfig(16, chunked=True, num_stages=4, max_regs=64),
    KdaConfig(32, chunked=True, num_stages=3, max_regs=128),
    KdaConfig(32, chunked=True, num_stages=3, max_regs=96),
    # the prefetch of the first tiles only (the whole heads of every resident program overflow L2 at 96 x 64)
    KdaConfig(8, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=4),
    KdaConfig(8, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=8),
    KdaConfig(16, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=2),
    KdaConfig(16, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=4),
    KdaConfig(32, chunked=True, num_stages=3, prefetch_state=True, prefetch_tiles=1),
    KdaConfig(32, chunked=True, num_stages=3, prefetch_state=True, prefetch_tiles=2),
    KdaConfig(32, window=True),  # split, conv window in registers, next token's inputs ahead (verify windows)
    KdaConfig(64, window=True),
    KdaConfig(16, window=True),
    KdaConfig(64, wy=True),  # verify only: the window's key side once per head, one state product per token
    KdaConfig(32, wy=True),  # (chunk form, kda_verify_wy.py)
    KdaConfig(32, num_stages=4, wy=True),
    KdaConfig(16, wy=True),
    KdaConfig(16, num_stages=4, wy=True),
    KdaConfig(32, num_warps=2, wy=True),
    KdaConfig(16, num_warps=2, wy=True),
    KdaConfig(8, wy=True),
    KdaConfig(16, wy=True, prefetch_state=True),  # the head's state into L2 while the key side runs
    KdaConfig(32, wy=True, prefetch_state=True),
    KdaConfig(32, wy=True, keys_pass=True),  # the WY form in two launches (key pass, then state tiles)
    KdaConfig(16, wy=True, keys_pass=True),
    KdaConfig(8, wy=True, keys_pass=True),
    # the Gluon decode (kda_decode_gluon.py): the head's state copies issued first, into num_stages buffers (None:
    # the whole head, 64 KB) refilled as tiles are written back
    KdaConfig(16, chunked=True, gluon=True),
    KdaConfig(8, chunked=True, gluon=True),
    KdaConfig(32, chunked=True, gluon=True),
    KdaConfig(16, chunked=True, num_stages=4, gluon=True),
    KdaConfig(8, chunked=True, num_stages=8, gluon=True),
    KdaConfig(8, chunked=True, num_stages=4, gluon=True),
    KdaConfig(32, chunked=True, num_stages=2, gluon=True),
    KdaConfig(16, chunked=True, num_stages=2, gluon=True),
]
# Dropped after the H200 run at dc34ac2 (benchmarks/README.md): whole-head split programs (BV 128, 8 / 16 warps;
# 156-216 spilled registers, 23-31 us at 32 x 1 vs 8.9) and half heads on 8 warps (BV 64; 16.7 us).


def scaled(cfg: KdaConfig, D: int) -> KdaConfig:
    """cfg for head dim D (the smoke run): block_v scaled by D / 128, at least 2."""
    return cfg._replace(block_v=max(2, cfg.block_v * D // 128))


def make_inputs(H: int, N: int, D: int, dev: str, dtype: torch.dtype, seed: int = 0, q: int = 1) -> dict:
    """One KDA layer's decode inputs: N sequences of q tokens (1: decode; a verify window: k + 1), pools of 2N + 8
    slots, random slots."""
    gen = torch.Generator(device=dev).manual_seed(seed)  # drawn on the device: the 96 x 64 pool is 855 MB
    T, C, S = N * q, 3 * H * D, 2 * N + 8

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * s

    merged = r(T, C + 2 * D + H).to(dtype)  # [q | k | v | (2D) | b] as one merged projection GEMM writes them
    return {
        "qkv": merged[:, :C], "f": r(T, H * D).to(dtype), "b": merged[:, C + 2 * D:],
        "conv_weight": r(C, 4, s=0.5), "conv_state": r(S, C, 3).to(dtype),
        "A_log": r(H, s=0.5), "dt_bias": r(H, D, s=0.5), "state": r(S, H, D, D, s=0.3),
        "state_indices": torch.randperm(S, generator=gen, device=dev)[:N],
        "cu_seqlens": (torch.arange(N + 1, dtype=torch.int64) * q).to(dev),
    }


def clone_pools(inp: dict) -> dict:
    return {k: (v.clone() if k in ("state", "conv_state") else v) for k, v in inp.items()}


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


class KernelRecorder:
    """Stands in for `_kda_decode_kernel` (kda_decode) and `_kda_verify_wy_kernel` (kda_verify_wy) (`install`;
    `uninstall` puts them back): records the compiled kernel each launch returns
    (registers, spills, shared memory of the variant)."""

    def __init__(self):
        self.last = None
        self._real: list[tuple[object, str, object]] = []

    def install(self) -> None:
        from tokenspeed.ops.triton import kda_decode_gluon, kda_verify_wy

        real_gluon = kda_decode_gluon.launch

        def gluon_launch(*args, **kwargs):  # the Gluon kernel ran (no fallback to the Triton form)
            self.last = "gluon"
            return real_gluon(*args, **kwargs)
        self._real.append((kda_decode_gluon, "launch", real_gluon))
        kda_decode_gluon.launch = gluon_launch

        for module, name in ((k_kda, "_kda_decode_kernel"), (kda_verify_wy, "_kda_verify_wy_kernel")):
            fn = getattr(module, name)
            self._real.append((module, name, fn))
            setattr(module, name, _Recorded(fn, self))

    def uninstall(self) -> None:
        for module, name, fn in self._real:
            setattr(module, name, fn)
        self._real.clear()

    def info(self) -> dict:
        k = self.last
        if k == "gluon":
            return {"kernel": "gluon"}
        md = getattr(k, "metadata", None)
        return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                "shared_bytes": getattr(md, "shared", None)}


class _Recorded:
    """One kernel's stand-in: launches it and hands the compiled kernel to the recorder."""

    def __init__(self, fn, rec: KernelRecorder):
        self.fn, self.rec = fn, rec

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            self.rec.last = launch(*args, **kwargs)
            return self.rec.last
        return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def v_first_pools(inp: dict) -> dict:
    """The inputs with the recurrent-state pool transposed to [slots, H, V, K] (`kda_decode(state_v_first=True)`)."""
    return {**inp, "state": inp["state"].transpose(-1, -2).contiguous()}


def parity(inp: dict, ref: dict, o_ref: torch.Tensor, cfg: KdaConfig, scale: float, dev: str,
           update: bool = True, v_first: bool = False, max_seq_tokens: int | None = None) -> dict:
    """One launch of cfg on fresh pool copies vs the reference's outputs and pools (verify, update False: both
    pools left as they were). v_first: the launch runs on a [V, K] copy of the state pool, compared transposed back."""
    a = clone_pools(v_first_pools(inp) if v_first else inp)
    o = k_kda.kda_decode(**a, lower_bound=LOWER, scale=scale, config=cfg, update_state=update, state_v_first=v_first,
                         max_seq_tokens=max_seq_tokens)
    sync(dev)
    if v_first:
        a["state"] = a["state"].transpose(-1, -2)
    slots = inp["state_indices"]
    idle = torch.ones(inp["state"].shape[0], dtype=torch.bool, device=slots.device)
    idle[slots] = False
    tol = 1e-5 if o.dtype == torch.float32 else 1e-2
    out = {
        "max_abs_err_o": (o.double() - o_ref.double()).abs().max().item(), "rel_err_o": rel(o, o_ref),
        "rel_err_state": rel(a["state"][slots], ref["state"][slots]),
        "conv_state_equal": bool(torch.equal(a["conv_state"][slots], ref["conv_state"][slots])),
        "idle_untouched": bool(torch.equal(a["state"][idle], inp["state"][idle])
                               and torch.equal(a["conv_state"][idle], inp["conv_state"][idle])),
        "has_nan": bool(torch.isnan(o).any() or torch.isnan(a["state"][slots]).any()),
    }
    out["parity_ok"] = (out["rel_err_o"] < tol and out["rel_err_state"] < tol and out["conv_state_equal"]
                        and out["idle_untouched"] and not out["has_nan"])
    return out


_FLUSH = None


def time_us(fn, dev: str, calls: int, reps: int, cold: bool) -> float:
    """Per-call time of fn: CUDA graph of `calls` calls, median of `reps` replays (CUDA events), / calls.
    cold: a 128 MiB memset before each call inside the graph, a graph of the memsets alone subtracted."""
    if dev != "cuda":  # smoke: wall time of one interpreted call, plumbing only
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from graph_timing import replay_ms, warm_up  # benchmarks/graph_timing.py (the script's folder is on sys.path)

    global _FLUSH
    if cold and _FLUSH is None:
        _FLUSH = torch.empty(128 << 20, dtype=torch.int8, device=dev)
    warm_up(fn, 2)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                if cold:
                    _FLUSH.zero_()
                if with_fn:
                    fn()
        return g

    total = replay_ms(capture(True), reps, warmup=3)
    base = replay_ms(capture(False), reps, warmup=3) if cold else 0.0
    return max(total - base, 0.0) / calls * 1e3


def measure(fn, dev: str, calls: int, reps: int, cold: bool, state_bytes: int) -> dict:
    """Warm-L2 time, plus the cold-L2 time when `cold`; `us` (the one compared, and the bandwidth's) is the cold
    one when measured."""
    out = {"us_warm": time_us(fn, dev, calls, reps, False)}
    if cold:
        out["us_cold"] = time_us(fn, dev, calls, reps, True)
    us = out.get("us_cold", out["us_warm"])
    out.update(us=us, state_GBps=state_bytes / us * 1e-3, pct_hbm=100 * state_bytes / (us * 1e-6) / HBM)
    return out


def fla_fn(inp: dict, H: int, N: int, D: int, dev: str):
    """fla-core fused_recurrent_kda on this shape, as benchmarks/kernels_h200.py calls it; None if unavailable."""
    if dev != "cuda":
        return None
    from fla.ops.kda import fused_recurrent_kda

    bf = torch.bfloat16
    q, k, v, g = (torch.randn(N, 1, H, D, device=dev, dtype=bf) for _ in range(4))
    beta = torch.randn(N, 1, H, device=dev, dtype=torch.float32)
    h0 = inp["state"][inp["state_indices"]].clone()

    def run():
        return fused_recurrent_kda(q, k, v, g, beta, A_log=inp["A_log"], dt_bias=inp["dt_bias"], scale=D ** -0.5,
                                   initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER)
    return run


def copy_ceiling(state_bytes: int, dev: str, calls: int, reps: int, cold: bool) -> dict:
    """The practical ceiling in the same harness: torch's device copy of state_bytes / 2 (the bytes a decode reads,
    written back to a second buffer), timed like a variant."""
    v = {"label": "copy (torch, same bytes)"}
    try:
        src = torch.empty(state_bytes // 8, dtype=torch.float32, device=dev).uniform_()
        dst = torch.empty_like(src)
        v.update(measure(lambda d=dst, x=src: d.copy_(x), dev, calls, reps, cold, state_bytes))
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        v["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return v


def pattern_kernels(H: int, D: int, slots: torch.Tensor) -> list[tuple[str, callable]]:
    """(label, fn(pool)) of the copy kernels that move the decode's state bytes (`state_copy_kernels`): the in-place
    walks of [K, 32] column tiles and of contiguous tiles (and into a second pool), shorter walks and dependent
    loads first, the decode's tile loop part by part (`mini_decode`), TMA walks."""
    from state_copy_kernels import mini_decode, state_rmw, state_rmw_tma

    bv0 = min(32, D)
    second: dict[str, torch.Tensor] = {}

    def to_second_pool(p: torch.Tensor) -> None:  # the second pool made by the first (untimed) call, then reused
        state_rmw(p, slots, H, D, bv0, True, out=second.setdefault("pool", torch.empty_like(p)))

    out = [("rmw [K, 32] tiles (Triton)", lambda p: state_rmw(p, slots, H, D, bv0, False)),
           ("rmw contiguous tiles (Triton)", lambda p: state_rmw(p, slots, H, D, bv0, True)),
           ("contiguous tiles to a second pool (Triton)", to_second_pool)]
    walks = ((32, 2, 3, 4, 0), (32, 1, 3, 4, 0), (16, 2, 4, 4, 0), (16, 1, 4, 4, 0), (64, 1, 3, 8, 0),
             (128, 1, 1, 8, 0), (32, 0, 3, 4, 1), (32, 0, 3, 4, 2), (16, 0, 4, 4, 1))
    for bv, tpp, stages, warps, pre in walks:  # shorter walks (more, shorter programs); dependent loads first
        label = (f"rmw contiguous tiles bv{bv} s{stages} w{warps}, {tpp or 128 // bv} tiles a program"
                 + (f", {pre} dependent loads first" if pre else "") + " (Triton)")
        out.append((label, lambda p, b=bv, t=tpp, g=stages, w=warps, r=pre: state_rmw(
            p, slots, H, D, b, True, g, tiles_per_program=t, pre_loads=r, num_warps=w)))
    parts = ((False, 0, False, 0), (True, 0, False, 0), (True, 0, True, 0), (True, 1, True, 0), (True, 2, True, 0),
             (True, 1, True, 1), (True, 2, True, 1))
    for bv, stages in ((16, 4), (32, 3)):  # the decode's tile loop with its parts added one by one
        for math, yv, ost, pre in parts:
            label = (f"mini decode bv{bv} s{stages}: math {int(math)} v {('-', 'staged', 'regs')[yv]} o {int(ost)} "
                     f"pre {pre} (Triton)")
            out.append((label, lambda p, b=bv, g=stages, m=math, y=yv, o=ost, r=pre: mini_decode(
                p, slots, H, D, b, g, m, y, o, r)))
    for bv, tma, stages in ((32, 1, 3), (32, 2, 3), (16, 1, 4), (8, 1, 4), (8, 2, 4)):
        label = f"rmw contiguous tiles, TMA loads{' + stores' if tma == 2 else ''} bv{bv} s{stages} (Triton)"
        out.append((label, lambda p, b=bv, m=tma, g=stages: state_rmw_tma(p, slots, H, D, b, m, g)))
    return out


def pattern_ceilings(inp: dict, H: int, D: int, dev: str, calls: int, reps: int, cold: bool,
                     state_bytes: int) -> list[dict]:
    """Every `pattern_kernels` kernel, each on a fresh copy of the pool, and torch's in-place `mul_` of the same
    bytes, timed as the decode is; a kernel that fails is reported, not fatal."""
    rows = []
    kernels = pattern_kernels(H, D, inp["state_indices"])
    kernels.append(("in-place mul_ of the same bytes (torch)", None))  # torch's elementwise RMW: in place
    for label, fn in kernels:
        v = {"label": label}
        try:
            if fn is None:
                buf = torch.empty(state_bytes // 8, dtype=torch.float32, device=dev).uniform_()
                thunk = lambda b=buf: b.mul_(1.0)  # noqa: E731
            else:
                pool = inp["state"].clone()
                thunk = lambda f=fn, p=pool: f(p)  # noqa: E731
            v.update(measure(thunk, dev, calls, reps, cold, state_bytes))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            v["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(v)
    return rows


def _warm_one(task: tuple) -> tuple:
    """Worker: compile one (H, D, config) by a tiny launch (N = 1) with the sweep's specialisation."""
    H, D, cfg_fields, dev, v_first = task
    cfg = KdaConfig(*cfg_fields)
    try:
        inp = make_inputs(H, 1, D, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
        k_kda.kda_decode(**inp, lower_bound=LOWER, scale=D ** -0.5, config=cfg, state_v_first=v_first,
                         max_seq_tokens=1)
        sync(dev)
        return H, cfg.label, None
    except Exception as e:  # noqa: BLE001 - reported by the caller; the main process hits it again
        return H, cfg.label, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(tasks: list[tuple], jobs: int) -> dict:
    """Compile the (H, D, config) tasks in `jobs` spawned processes (fills the on-disk Triton cache)."""
    import multiprocessing as mp

    t0 = time.time()
    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            res = pool.map(_warm_one, tasks, chunksize=1)
    except Exception as e:  # noqa: BLE001 - a pool failure only loses the head start
        print(f"precompile failed ({type(e).__name__}: {e}); compiling in the main process", flush=True)
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.time() - t0}
    errors = {f"H={H} {label}": err for H, label, err in res if err}
    print(f"precompiled {len(tasks)} kernels in {time.time() - t0:.1f} s with {jobs} processes"
          + (f"; errors: {errors}" if errors else ""), flush=True)
    return {"seconds": time.time() - t0, "tasks": len(tasks), "errors": errors}


def sweep_shape(H: int, N: int, D: int, dev: str, dtype: torch.dtype, variants: list[KdaConfig], args,
                rec: KernelRecorder) -> dict:
    scale = D ** -0.5
    q, update = (args.verify, False) if args.verify else (1, True)  # --verify K: windows of K tokens, pools read
    window = q if args.verify else 1  # max_seq_tokens, as the model passes for its uniform steps
    inp = make_inputs(H, N, D, dev, dtype, seed=H * 1000 + N, q=q)
    state_bytes = N * H * D * D * 4 * (2 if update else 1)
    ref = clone_pools(inp)
    o_ref = public_ops._kda_decode_reference(**ref, lower_bound=LOWER, scale=scale, update_state=update,
                                             step_states=None)
    sync(dev)
    v_first = bool(args.v_first)
    work = clone_pools(v_first_pools(inp) if v_first else inp)  # the timed launches advance this copy in place
    norm = {}  # --norm: the timed launches also apply the model's fused gated RMSNorm epilogue (parity: without)
    if args.norm:
        gen = torch.Generator(device=dev).manual_seed(7)
        norm = {"norm_gate": torch.randn(N * q, H * D, generator=gen, device=dev).to(dtype),
                "norm_weight": torch.randn(D, generator=gen, device=dev)}
    calls = args.calls or (20 if N * H < 512 else 5)
    cold = args.cold == "on" or (args.cold == "auto" and state_bytes / 2 < COLD_BELOW)
    default = k_kda.default_config(N * H, D, q)
    legacy = k_kda.legacy_config(N * H, D)
    variants = list(variants)
    for c in (legacy, default):  # both always measured
        if c not in variants:
            variants.append(c)
    row = {"H": H, "N": N, "D": D, "norm": bool(args.norm), "v_first": v_first, "state_bytes": state_bytes,
           "floor_us": state_bytes / HBM * 1e6,
           "default": default.label, "legacy": legacy.label, "calls_per_graph": calls, "cold_l2": cold,
           "variants": []}
    for cfg in variants:
        v = {"label": cfg.label + ("-vfirst" if v_first else ""), "config": cfg._asdict(),
             "is_default": cfg == default, "is_legacy": cfg == legacy}
        t0 = time.time()
        try:
            rec.last = None
            v.update(parity(inp, ref, o_ref, cfg, scale, dev, update, v_first, window))
            v.update(rec.info())
            v.update(measure(lambda c=cfg, w=work: k_kda.kda_decode(**w, **norm, lower_bound=LOWER, scale=scale,
                                                                     config=c, update_state=update,
                                                                     state_v_first=v_first, max_seq_tokens=window),
                             dev, calls, args.reps, cold, state_bytes))
        except Exception as e:  # noqa: BLE001 - one failing variant is reported and skipped
            v["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            try:
                sync(dev)
            except Exception as e2:  # noqa: BLE001 - a sticky CUDA error poisons the rest of the run
                v["error"] += f" | after: {type(e2).__name__}: {str(e2)[:200]}"
        v["seconds"] = time.time() - t0
        row["variants"].append(v)
        print(fmt_variant(v), flush=True)
    fla = {"label": "fla fused_recurrent_kda"}
    if not args.no_fla and update:  # (verify: fla's recurrence writes a final state; not the same work)
        try:
            fn = fla_fn(inp, H, N, D, dev)
            if fn is None:
                fla["error"] = "skipped (not on CUDA)"
            else:
                fla.update(measure(fn, dev, calls, args.reps, cold, state_bytes))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            fla["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(fmt_variant(fla), flush=True)
    row["fla"] = fla
    row["copy"] = copy_ceiling(state_bytes, dev, calls, args.reps, cold)
    print(fmt_variant(row["copy"]), flush=True)
    row["patterns"] = pattern_ceilings(inp, H, D, dev, calls, args.reps, cold, state_bytes) \
        if update and not args.no_patterns else []
    for v in row["patterns"]:
        print(fmt_variant(v), flush=True)
    ok = [v for v in row["variants"] if v.get("us") is not None and v.get("parity_ok")]
    if ok:
        best = min(ok, key=lambda v: v["us"])
        leg = next((v for v in ok if v["is_legacy"]), None)
        row.update(best=best["label"], best_us=best["us"], best_pct_hbm=best["pct_hbm"],
                   best_speedup_vs_legacy=(leg["us"] / best["us"]) if leg else None,
                   best_speedup_vs_fla=(fla["us"] / best["us"]) if fla.get("us") else None)
    del inp, ref, work, o_ref
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def fmt_variant(v: dict) -> str:
    if v.get("us") is None:
        return f"  {v['label']:28s} {v.get('error', 'no time')}"
    tags = ("D" if v.get("is_default") else "") + ("L" if v.get("is_legacy") else "")
    par = "" if "parity_ok" not in v else (
        f" err o {v['rel_err_o']:.1e} (abs {v['max_abs_err_o']:.1e}) state {v['rel_err_state']:.1e}"
        f"{'' if v['parity_ok'] else ' PARITY FAIL'}")
    regs = f" regs {v['regs']}" if v.get("regs") is not None else ""
    spills = f" spills {v['spills']}" if v.get("spills") else ""
    smem = f" smem {v['shared_bytes']}" if v.get("shared_bytes") is not None else ""
    warm = f" (warm {v['us_warm']:.2f})" if "us_cold" in v else ""
    return (f"  {v['label']:28s}{tags:>2s} {v['us']:9.2f} us{warm} {v['state_GBps']:8.1f} GB/s {v['pct_hbm']:6.1f}%"
            f"{regs}{spills}{smem}{par}")


def git_commit() -> str | None:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kda_decode_sweep_h200.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", default=None, help="H:N,... (default: 12:1,32:1,32:8,32:16,32:64,96:16,96:64)")
    ap.add_argument("--only", default=None, help="comma-separated substrings: keep variants whose label has one")
    ap.add_argument("--reps", type=int, default=60, help="graph replays per timing (median; >= 50)")
    ap.add_argument("--calls", type=int, default=None, help="launches per graph (default 20 below 512 heads, 5)")
    ap.add_argument("--cold", default="auto", choices=["auto", "on", "off"],
                    help="also time with L2 flushed before every call: auto = states below 120 MB (docstring)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-patterns", action="store_true", help="skip the copy kernels of the decode's access pattern")
    ap.add_argument("--v-first", action="store_true",
                    help="every variant on a [V, K] state pool (kda_decode(state_v_first=True)): contiguous V tiles")
    ap.add_argument("--norm", action="store_true", help="time the launches with the fused output norm, as the model")
    ap.add_argument("--verify", type=int, default=0,
                    help="K > 0: verify windows of K tokens per sequence (pools read, not written; "
                         "the -wy variants run only here; no fla)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes that precompile the variants first (default: min(8, CPUs) on CUDA; 0: none)")
    ap.add_argument("--pdl", default="on", choices=["on", "off"],
                    help="off: TOKENSPEED_PDL=0 for the run (no programmatic dependent launches, as off Hopper)")
    args = ap.parse_args()
    if args.pdl == "off":
        os.environ["TOKENSPEED_PDL"] = "0"  # read per launch; inherited by the precompile workers
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu for the interpreter smoke run)")
    D = D_GPU if dev == "cuda" else D_SMOKE
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if dev == "cuda" else SMOKE_SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    variants = [scaled(c, D) for c in VARIANTS]
    if args.only:
        keys = args.only.split(",")
        variants = [c for c in variants if any(k in c.label for k in keys)]
    if not args.verify:
        variants = [c for c in variants if not c.wy]  # the WY schedule is for verify windows only
    t0 = time.time()
    pre = None
    jobs = args.jobs if args.jobs is not None else (min(8, os.cpu_count() or 1) if dev == "cuda" else 0)
    if jobs > 0:  # (on the CPU only a plumbing check: the interpreter caches nothing)
        extra = {c for H, N in shapes
                 for c in (k_kda.legacy_config(N * H, D), k_kda.default_config(N * H, D, args.verify or 1))}
        cfgs = variants + [c for c in extra if c not in variants]
        tasks = [(H, D, tuple(c), dev, args.v_first) for H in sorted({h for h, _ in shapes}) for c in cfgs]
        pre = precompile(tasks, jobs)
    rec = KernelRecorder()
    rec.install()
    rows = []
    try:
        for H, N in shapes:
            nbytes = N * H * D * D * (4 if args.verify else 8)
            what = f"read (verify, {args.verify} tokens)" if args.verify else "read+written"
            print(f"== H={H} N={N} D={D}: state {nbytes / 1e6:.1f} MB {what}, "
                  f"floor {nbytes / HBM * 1e6:.1f} us at 4.27 TB/s; default "
                  f"{k_kda.default_config(N * H, D, args.verify or 1).label}, "
                  f"legacy {k_kda.legacy_config(N * H, D).label}", flush=True)
            rows.append(sweep_shape(H, N, D, dev, dtype, variants, args, rec))
    finally:
        rec.uninstall()
    try:
        import fla
        fla_version = getattr(fla, "__version__", None)
    except ImportError:
        fla_version = None
    meta = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter smoke run)",
        "torch": torch.__version__, "triton": triton.__version__, "fla": fla_version,
        "python": platform.python_version(), "commit": git_commit(), "seconds": time.time() - t0,
        "hbm_Bps": HBM, "precompile": pre, "cold": args.cold, "reps": args.reps, "pdl": args.pdl,
        "command": " ".join(["PYTHONPATH=. python"] + sys.argv),
        "timing": "CUDA graph of `calls_per_graph` launches after a side-stream warm-up; CUDA events around each "
                  "replay, median of `reps` replays / calls. us_warm: L2 not flushed (the state at 96x64 and "
                  "32x64 is far bigger than the 60 MB L2); us_cold (rows with cold_l2): a 128 MiB memset before "
                  "each call in the graph, a memset-only graph subtracted; us = us_cold if measured, else us_warm",
        "bytes": "state only: N*H*D*D*4 read + written; % of 4.27 TB/s",
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n=== best per shape (parity ok) ===")
    for r in rows:
        fla_us = r["fla"].get("us")
        print(f"H={r['H']:3d} N={r['N']:3d}: best {r.get('best')} {r.get('best_us') or float('nan'):.2f} us "
              f"({r.get('best_pct_hbm') or float('nan'):.1f}% of HBM; floor {r['floor_us']:.1f} us), "
              f"x{r.get('best_speedup_vs_legacy') or float('nan'):.2f} vs legacy {r['legacy']}, "
              f"fla {fla_us or float('nan'):.2f} us, copy {r['copy'].get('us') or float('nan'):.2f} us "
              f"({r['copy'].get('pct_hbm') or float('nan'):.1f}%); default {r['default']}")
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
