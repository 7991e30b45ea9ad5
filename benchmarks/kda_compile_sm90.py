"""Compile the KDA decode kernel's launch variants for sm_90 with PDL on, on a host without a GPU, and report each
one's registers per thread, spill stack and shared memory (Triton's own ptxas and cuobjdump), or its error.

    PYTHONPATH=. python benchmarks/kda_compile_sm90.py [--only REGEX] [--sass]

It calls `tokenspeed.ops.triton.kda_decode.kda_decode` / `kda_replay_layers` on small CPU tensors of Kimi-Linear's
KDA geometry (32 heads x 128, bf16; batch 1 and 8, verify 4 tokens, the 20-layer replay; `-fold`: the low-rank
gates folded in, `f_a=` / `g_a=` rank-128 column views with their up-projection weights) with `pdl.enabled`
forced True, catches the kernel launch instead of running it, and hands it to `triton.compile` for
GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT would derive. The PTX is checked for the
PDL wait and trigger (and the L2 prefetches where the variant issues them). Use the Triton the GPU runs (e.g. a
`pip install --target DIR triton==3.6.0`, then PYTHONPATH=DIR:.): a variant that fails here fails there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors
from tokenspeed.ops.triton import kda_decode as kd
from tokenspeed.ops.triton import pdl

TARGET = GPUTarget("cuda", 90, 32)
H, D = 32, 128


class _Catch:
    """Stands in for the JIT kernel: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.fn, args, kw))


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


def _fold(inp: dict, d: int = D) -> dict:
    """The folded low-rank gates (`kda_decode(f=None, f_a=, f_b_weight=, g_a=, g_b_weight=)`): f_a | g_a adjacent
    column views of a merged projection (rank d, as in Kimi Linear), bf16 weights [H * d, d], the norm epilogue on."""
    T, dt = inp["qkv"].shape[0], inp["qkv"].dtype
    merged = torch.zeros(T, 3 * H * d + 2 * d + H, dtype=dt)
    lo = 3 * H * d
    return {"f": None, "f_a": merged[:, lo:lo + d], "g_a": merged[:, lo + d:lo + 2 * d],
            "f_b_weight": torch.zeros(H * d, d, dtype=dt), "g_b_weight": torch.zeros(H * d, d, dtype=dt),
            "norm_weight": torch.zeros(d), "norm_eps": 1e-5}


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
                (f"decode-b1-d96{sfx}", call(1, 1, d=96)),
                (f"verify-b2-q4{sfx}", call(2, 4, update_state=False)),
                (f"verify-b2-q4-chunked{sfx}", call(2, 4, update_state=False, chunked=True)),
                (f"tail-b1-q64{sfx}", call(1, 64))]
    for tag, N, q, kw in [("decode-b1", 1, 1, {}), ("decode-b8-chunked", 8, 1, {}),
                          ("decode-b8-chunked-s1", 8, 1, {"num_stages": 1}), ("verify-b2-q4", 2, 4, {"update_state": False}),
                          ("verify-b2-q4-chunked", 2, 4, {"update_state": False, "chunked": True})]:
        def fold_call(N=N, q=q, kw=kw):
            inp = _layer(N, q)
            return kd.kda_decode(**{**inp, **_fold(inp)}, **dec, **kw)
        out.append((f"{tag}-fold", fold_call))
    layers = [KdaLayerTensors(*(_layer(2, 4)[k] for k in KdaLayerTensors._fields)) for _ in range(3)]
    table = KdaLayerTable.build(layers, strict=True)
    acc = torch.zeros(2, dtype=torch.int64)
    slots, cu = torch.arange(2), torch.arange(0, 9, 4)
    out += [("replay-3l", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0)),
            ("replay-3l-chunked", lambda: kd.kda_replay_layers(table, slots, cu, acc, lower_bound=-5.0, chunked=True))]
    return out


def capture(thunk, use_pdl: bool = True) -> tuple:
    """The (kernel, args, kwargs) of the one launch `thunk` makes, with PDL forced on or off (launch keyword
    dropped)."""
    calls: list = []
    saved = (kd._kda_decode_kernel, pdl.enabled, pdl.launch_kwargs)
    kd._kda_decode_kernel = _Catch(saved[0], calls)
    pdl.enabled, pdl.launch_kwargs = (lambda device, family="": use_pdl), (lambda device, family="": {})
    try:
        thunk()
    finally:
        kd._kda_decode_kernel, pdl.enabled, pdl.launch_kwargs = saved
    assert len(calls) == 1, calls
    return calls[0]


def compile_sm90(fn, args, kwargs) -> dict:
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    ptx = kernel.asm["ptx"]
    sass = "\n".join(line for line in sass.splitlines() if not line.lstrip().startswith(("code for", "Fatbin")))
    return {"shared": kernel.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "stack": int(stack.group(1)) if stack else None, "wait": ptx.count("griddepcontrol.wait"),
            "trigger": ptx.count("griddepcontrol.launch_dependents"), "prefetch": ptx.count("prefetch.global.L2"),
            "bulk": ptx.count("cp.async.bulk.prefetch.L2"),
            "sass": hashlib.sha1(sass.encode()).hexdigest()[:12]}


def main() -> None:
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
            fn, a, kw = capture(thunk, not args.no_pdl)
            r = compile_sm90(fn, a, kw)
            cfg = {k: kw[k] for k in ("BV", "NV", "CHUNKS", "STAGES", "NORM", "PDL", "num_warps") if k in kw}
            ok = args.no_pdl or (r["wait"] >= 1 and r["trigger"] >= 1)
            failed += not ok
            print(f"{tag:28s} regs {r['regs']:4d}  stack {r['stack']}  smem {r['shared']:6d} B  wait {r['wait']} "
                  f"trigger {r['trigger']} prefetch {r['prefetch']}+{r['bulk']} bulk  {cfg}" + (f"  sass {r['sass']}" if args.sass
                                                                              else "") + ("" if ok else "  NO PDL"),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
            failed += 1
            print(f"{tag:28s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    print(f"{failed} failed", flush=True)


if __name__ == "__main__":
    main()
