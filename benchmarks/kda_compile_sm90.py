"""Compile the KDA decode kernel's launch variants for sm_90 with PDL on, on a host without a GPU, and report each
one's registers per thread, spill stack and shared memory (Triton's own ptxas and cuobjdump), or its error.

    PYTHONPATH=. python benchmarks/kda_compile_sm90.py [--only REGEX] [--sass]

It calls `tokenspeed.ops.triton.kda_decode.kda_decode` / `kda_replay_layers` on small CPU tensors of Kimi-Linear's
KDA geometry (32 heads x 128, bf16; batch 1 and 8, verify 4 tokens, the 20-layer replay) with `pdl.enabled`
forced True, catches the kernel launch instead of running it, and hands it to `triton.compile` for
GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT would derive (benchmarks/sm90_compile.py).
The PTX is checked for the PDL wait and trigger (and the L2 prefetches where the variant issues them). Use the
Triton the GPU runs (e.g. a `pip install --target DIR triton==3.6.0`, then PYTHONPATH=DIR:.): a variant that fails
here fails there.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch
import triton
from sm90_compile import TARGET, Launch, catch_launches, compile_launch, cubin_usage, failure_line, sass_hash

from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors
from tokenspeed.ops.triton import kda_decode as kd
from tokenspeed.ops.triton import kda_replay_wy as kdr
from tokenspeed.ops.triton import kda_verify_keys as kdk
from tokenspeed.ops.triton import kda_verify_wy as kdw

H, D = 32, 128


def _layer(N: int, q: int, d: int = D, dtype=torch.bfloat16) -> dict:
    """One layer's kda_decode arguments: N sequences of q tokens, 2N slots; qkv / b / gate strided views."""
    T, C, S = N * q, 3 * H * d, 2 * N
    merged = torch.zeros(T, C + H * d + H, dtype=dtype)
    return {"qkv": merged[:, :C], "f": torch.zeros(T, H * d, dtype=dtype), "b": merged[:, C + H * d:],
            "conv_weight": torch.zeros(C, 4), "conv_state": torch.zeros(S, C, 3, dtype=dtype),
            "A_log": torch.zeros(H), "dt_bias": torch.zeros(H, d), "state": torch.zeros(S, H, d, d),
            "state_indices": torch.arange(N), "cu_seqlens": torch.arange(0, T + 1, q)}


def _norm(inp: dict, d: int = D) -> dict:
    """The norm epilogue's arguments: the gate a column view of a wider projection, as in the full-rank layer."""
    T = inp["qkv"].shape[0]
    wide = torch.zeros(T, 2 * H * d, dtype=inp["qkv"].dtype)
    return {"norm_gate": wide[:, H * d:].view(T, H, d), "norm_weight": torch.zeros(d), "norm_eps": 1e-5}


def variants() -> list[tuple[str, callable]]:
    """(tag, thunk calling the wrapper) for each launch variant."""
    dec = {"lower_bound": -5.0, "scale": D ** -0.5}
    out = []
    for norm in (False, True):
        sfx = "-norm" if norm else ""

        def call(N, q, norm=norm, d=D, **kw):
            inp = _layer(N, q, d)
            return lambda: kd.kda_decode(**inp, **dec, **(_norm(inp, d) if norm else {}), **kw)

        out += [(f"decode-b1{sfx}", call(1, 1)),
                (f"decode-b1-hints{sfx}", call(1, 1, hints=True)),
                (f"decode-b8-chunked{sfx}", call(8, 1)),
                (f"decode-b8-chunked-s1{sfx}", call(8, 1, num_stages=1)),
                (f"decode-b8-chunked-vfirst{sfx}", call(8, 1, state_v_first=True)),
                (f"decode-b32-chunked-vfirst{sfx}", call(32, 1, state_v_first=True)),  # 1024 pairs: BV 16, 4 stages
                (f"decode-b128-chunked-vfirst{sfx}", call(128, 1, state_v_first=True)),  # 4096 pairs: BV 8, 4 stages
                (f"decode-b32-chunked-pf4-vfirst{sfx}", call(32, 1, state_v_first=True, config=kd.KdaConfig(
                    8, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=4))),  # the first 4 tiles
                (f"decode-b32-chunked-r56-vfirst{sfx}", call(32, 1, state_v_first=True, config=kd.KdaConfig(
                    8, chunked=True, num_stages=4, max_regs=56))),  # capped registers: more programs per SM
                (f"decode-b32-chunked-pl-vfirst{sfx}", call(32, 1, state_v_first=True, config=kd.KdaConfig(
                    16, chunked=True, num_stages=4, preload=True))),  # the first tile before the token inputs
                (f"decode-b32-chunked-pf2{sfx}", call(32, 1, config=kd.KdaConfig(
                    16, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=2))),
                (f"decode-b1-d96{sfx}", call(1, 1, d=96)),
                (f"verify-b2-q4{sfx}", call(2, 4, update_state=False)),
                (f"verify-b2-q4-chunked{sfx}", call(2, 4, update_state=False, chunked=True)),
                (f"verify-b2-q4-window{sfx}", call(2, 4, update_state=False, config=kd.KdaConfig(32, window=True))),
                (f"verify-b2-q4-window-bv64{sfx}", call(2, 4, update_state=False,
                                                        config=kd.KdaConfig(64, window=True))),
                (f"verify-b2-q4-wy-bv32-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                           config=kd.KdaConfig(32, wy=True))),
                (f"verify-b2-q4-wy-bv64-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                           config=kd.KdaConfig(64, wy=True))),
                (f"verify-b2-q4-wy-bv16-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                           config=kd.KdaConfig(16, wy=True))),
                (f"verify-b2-q4-wy-bv128-w8-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                               config=kd.KdaConfig(128, num_warps=8, wy=True))),
                (f"verify-b2-q4-wy-bv32{sfx}", call(2, 4, update_state=False, config=kd.KdaConfig(32, wy=True))),
                (f"verify-b2-q4-wy-bv32-vfirst-told{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                                max_seq_tokens=4, config=kd.KdaConfig(32, wy=True))),
                (f"verify-b2-q4-wy-bv16-vfirst-told{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                                max_seq_tokens=4, config=kd.KdaConfig(16, wy=True))),
                (f"verify-b2-q4-wy-bv64-vfirst-told{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                                max_seq_tokens=4, config=kd.KdaConfig(64, wy=True))),
                (f"verify-b2-q4-wy-pf-bv16-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                              max_seq_tokens=4,
                                                              config=kd.KdaConfig(16, wy=True, prefetch_state=True))),
                (f"verify-b2-q4-wy-kp-bv32-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                              max_seq_tokens=4,
                                                              config=kd.KdaConfig(32, wy=True, keys_pass=True))),
                (f"verify-b2-q4-wy-kp-bv16-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                              max_seq_tokens=4,
                                                              config=kd.KdaConfig(16, wy=True, keys_pass=True))),
                (f"verify-b2-q4-window-vfirst{sfx}", call(2, 4, update_state=False, state_v_first=True,
                                                          config=kd.KdaConfig(32, window=True))),
                (f"verify-b2-q4-wy-bv16-w2{sfx}", call(2, 4, update_state=False,
                                                       config=kd.KdaConfig(16, num_warps=2, wy=True))),
                (f"tail-b1-q64{sfx}", call(1, 64))]
    for N in (1, 4):  # the low-rank gates' up projections in the kernel (kimi-linear: f and the norm gate)
        def low_rank(N=N, **kw):
            inp = _layer(N, 1)
            T = inp.pop("f").shape[0]
            wide = torch.zeros(T, 2 * D + H, dtype=torch.bfloat16)
            w = torch.zeros(2, H * D, D, dtype=torch.bfloat16)
            return lambda: kd.kda_decode(**inp, f=None, **dec, f_low_rank=(wide[:, :D], w[0]),
                                         gate_low_rank=(wide[:, D:2 * D], w[1]), norm_weight=torch.zeros(D),
                                         state_v_first=True, max_seq_tokens=1, **kw)

        out += [(f"decode-b{N}-lowrank-norm", low_rank()), (f"decode-b{N}-lowrank-w8-norm", low_rank(num_warps=8))]
    layers = [KdaLayerTensors(*(_layer(2, 4)[k] for k in KdaLayerTensors._fields)) for _ in range(3)]
    table = KdaLayerTable.build(layers, strict=True)
    acc = torch.zeros(2, dtype=torch.int64)
    slots, cu = torch.arange(2), torch.arange(0, 9, 4)
    out += [("replay-3l", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0)),
            ("replay-3l-chunked", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0, chunked=True)),
            ("replay-3l-window", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0,
                                                              config=kd.KdaConfig(32, window=True))),
            ("replay-3l-window-bv16", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0,
                                                                   config=kd.KdaConfig(16, window=True))),
            ("replay-3l-window-bv64", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0,
                                                                   config=kd.KdaConfig(64, window=True))),
            ("replay-3l-wy-bv32", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0,
                                                               config=kd.KdaConfig(32, wy=True), max_seq_tokens=4)),
            ("replay-3l-wy-bv64-vfirst", lambda: kd.kda_replay_layers(
                table, slots, cu, acc, lower_bound=-5.0, config=kd.KdaConfig(64, wy=True), max_seq_tokens=4,
                state_v_first=True)),
            ("replay-3l-wy-bv32-vfirst", lambda: kd.kda_replay_layers(
                table, slots, cu, acc, lower_bound=-5.0, config=kd.KdaConfig(32, wy=True), max_seq_tokens=4,
                state_v_first=True))]
    return out


def capture(thunk, use_pdl: bool = True) -> list[Launch]:
    """The launches `thunk` makes (one, or the WY key pass's two), with PDL forced on or off (launch keyword
    dropped)."""
    calls = catch_launches({kd: ("_kda_decode_kernel",), kdw: ("_kda_verify_wy_kernel",),
                            kdk: ("_kda_verify_keys_kernel", "_kda_verify_tiles_kernel"),
                            kdr: ("_kda_replay_keys_kernel", "_kda_replay_tiles_kernel")}, thunk, pdl_on=use_pdl,
                           drop_launch_pdl=True)
    assert 1 <= len(calls) <= 2, calls
    return calls


def compile_sm90(launch: Launch, sass: bool = False) -> dict:
    """Compile one caught launch: shared memory, registers, stack, the PTX's PDL wait / trigger and L2 prefetch
    counts, the TTGIR's layout conversions (`cvt`: each a round trip through shared memory), and (`sass`) a hash
    of the SASS."""
    kernel = compile_launch(launch)
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, **cubin_usage(kernel), "wait": ptx.count("griddepcontrol.wait"),
            "trigger": ptx.count("griddepcontrol.launch_dependents"), "prefetch": ptx.count("prefetch.global.L2"),
            "bulk": ptx.count("cp.async.bulk.prefetch.L2"), "tma": ptx.count("cp.async.bulk.tensor"),
            "sass": sass_hash(kernel) if sass else None,
            "cvt": kernel.asm["ttgir"].count("ttg.convert_layout")}


def report(name: str, launch: Launch, args: argparse.Namespace) -> bool:
    """Compile one launch and print its line; False if its PTX lacks the PDL wait or trigger (PDL on)."""
    r, kw = compile_sm90(launch, args.sass), launch.kwargs
    keys = ("BV", "RB", "NV", "CHUNKS", "STAGES", "NORM", "PDL", "LOW_RANK_F", "LOW_RANK_G", "num_warps")
    cfg = {k: kw[k] for k in keys if k in kw}
    ok = args.no_pdl or (r["wait"] >= 1 and r["trigger"] >= 1)
    print(f"{name:28s} regs {r['regs']:4d}  stack {r['stack']}  smem {r['shared']:6d} B  wait {r['wait']} "
          f"trigger {r['trigger']} prefetch {r['prefetch']}+{r['bulk']} bulk  tma {r['tma']}  cvt {r['cvt']}  {cfg}"
          + (f"  sass {r['sass']}" if args.sass else "") + ("" if ok else "  NO PDL"), flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex of variant names")
    ap.add_argument("--sass", action="store_true", help="print a hash of each kernel's SASS")
    ap.add_argument("--no-pdl", action="store_true", help="compile with PDL off (for comparison)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target {TARGET}", flush=True)
    failed = 0
    for tag, thunk in variants():
        if args.only and not re.search(args.only, tag):
            continue
        try:
            launches = capture(thunk, not args.no_pdl)
        except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
            failed += 1
            print(failure_line(f"{tag:28s} ", e, 400), flush=True)
            continue
        for launch in launches:
            name = tag if len(launches) == 1 else f"{tag}:{launch.fn.__name__.split('_')[-2]}"
            try:
                failed += not report(name, launch, args)
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
                failed += 1
                print(failure_line(f"{name:28s} ", e, 400), flush=True)
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
