"""Do eager mixed steps stall on Triton compiles? Per step shape: wall time of the first and a repeat forward and the
kernel variants compiled by the first (issue 8: swe-smith at concurrency 4 had multi-second times to first token on
steps of a few short tails beside decodes; the hypothesis is that each new shape class compiles new specialisations
of the eager-path kernels mid-serve).

    PYTHONPATH=.:benchmarks python benchmarks/compile_stalls.py --engine --random 24 --out benchmarks/results  # H200
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/compile_stalls.py --geometry tiny-kimi-linear --device cpu \
        --history 64 --shapes "1,1,1,20;2,2,1" --no-warm-up                                   # plumbing only

A shape is the new tokens of each sequence of one step ("1,1,1,164": three decodes beside a 164-token tail), every
sequence on a `--history`-token cached history (scratch pages, distinct KDA slots). With --engine the model and
buffers are a started serving engine's (its start-up warm-up and CUDA-graph capture have run, as in `tokenspeed
serve`); without, a bare model after the lone prompts of WARM_UP_LENGTHS (unless --no-warm-up). --random N adds N
seeded random mixed shapes. A compiled variant is a new entry in a Triton JIT
function's per-device kernel cache (`JITFunction.device_caches`); in the interpreter, which compiles nothing, the
keys Triton would compute are simulated (`SimulatedKeys`). Writes compile_stalls.json to --out: per shape the two
wall times (CUDA-synchronised), the kernels that compiled, with counts, and per new variant the parameters whose
specialisation differs from the closest earlier variant.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import inspect
import json
import os
import pkgutil
import pstats
import random
import sys
import time
from itertools import accumulate
from typing import ClassVar

import torch

import tokenspeed.ops.triton as triton_ops
from tokenspeed.models import CacheBuffers, ForwardBatch
from tokenspeed.models.loader import load_model
from tokenspeed.ops.h2d import device_longs

SWE_SMITH_SHAPES = "1,1,1,164;164,164,164,1;1,1,168;168,1,1,1;1,1,1,1,300;40,1,1,1;1,17;1,1,1,1,1,1,1,1,200"
WARM_UP_LENGTHS = (8192, 1024, 100, 17)  # the engine's start-up prompts (EngineCore._warm_up)


def jit_functions() -> dict[str, object]:
    """Every Triton JIT function reachable from tokenspeed.ops.triton's modules and the loaded fla modules, by
    qualified name (autotuned kernels through their `.fn`)."""
    for info in pkgutil.iter_modules(triton_ops.__path__):
        importlib.import_module(f"{triton_ops.__name__}.{info.name}")
    found: dict[str, object] = {}
    seen: set[int] = set()  # a kernel re-exported by another module counts once
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("tokenspeed.ops.triton", "fla.")):
            continue
        for attr, obj in vars(mod).items():
            fn, depth = obj, 0
            while not _is_kernel(fn) and hasattr(fn, "fn") and depth < 4:  # autotuner / heuristics
                fn, depth = fn.fn, depth + 1
            if _is_kernel(fn) and id(fn) not in seen:
                seen.add(id(fn))
                found[f"{name}.{attr}"] = fn
    return found


def _is_kernel(obj) -> bool:
    """A Triton JIT function, or its interpreter stand-in (TRITON_INTERPRET=1)."""
    return hasattr(obj, "device_caches") or type(obj).__name__ == "InterpretedFunction"


def keys(fns: dict[str, object]) -> dict[str, set]:
    """Per JIT function, the specialisation keys compiled so far: on a GPU Triton's own (the kernel-key cache's
    (specialisation, options) pairs); in the interpreter the ones `SimulatedKeys` recorded."""
    out = {}
    for name, fn in fns.items():
        ks = set(SimulatedKeys.seen.get(id(fn), ()))
        for cache in getattr(fn, "device_caches", {}).values():
            ks.update(cache[1].keys())
        out[name] = ks
    return out


class SimulatedKeys:
    """Records, per launch in the Triton interpreter (which compiles nothing), the key Triton's JIT would compute:
    ("constexpr", value) for constexpr parameters, (type, "D" or None) for the others (an int or pointer divisible
    by 16 is specialised unless the parameter is in do_not_specialize / do_not_specialize_on_alignment; floats and
    None are not), and the launch options. `install()` patches the interpreter's launch entry point."""

    seen: ClassVar[dict[int, set]] = {}

    @staticmethod
    def key(fn, args: tuple, kwargs: dict) -> tuple:
        sig = inspect.signature(fn.fn)
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        dns = set(fn.kwargs.get("do_not_specialize") or ())
        dnsa = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
        spec = []
        for i, (name, p) in enumerate(sig.parameters.items()):
            v = bound.arguments.get(name)
            if "constexpr" in str(p.annotation):
                spec.append(("constexpr", v if not isinstance(v, torch.dtype) else str(v)))
                continue
            free = i in dns or name in dns or i in dnsa or name in dnsa
            if isinstance(v, bool):
                spec.append(("u1", None))
            elif isinstance(v, int):
                spec.append(("i32" if -2**31 <= v < 2**31 else "i64", None if free or v % 16 else "D"))
            elif isinstance(v, torch.Tensor):
                spec.append((f"*{v.dtype}", None if free or v.data_ptr() % 16 else "D"))
            elif v is None:
                spec.append(("constexpr", None))
            else:
                spec.append((type(v).__name__, None))
        options = sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters)
        return tuple(spec), str(options)

    @classmethod
    def install(cls) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        orig = InterpretedFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            cls.seen.setdefault(id(self), set()).add(cls.key(self, args, kwargs))
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run


def key_diffs(fn, new: set, old: set) -> list[str]:
    """For each new key, the parameters where it differs from the closest earlier key ("name: old -> new")."""
    names = list(inspect.signature(fn.fn).parameters)
    out = []
    for k in new:
        if not old:
            out.append("first variant")
            continue
        best = min(old, key=lambda o: sum(a != b for a, b in zip(o[0], k[0])) + (o[1] != k[1]))
        d = [f"{n}: {a} -> {b}" for n, a, b in zip(names, best[0], k[0]) if a != b]
        if best[1] != k[1]:
            d.append(f"options: {best[1]} -> {k[1]}")
        out.append("; ".join(d))
    return out


def step(model, buf: CacheBuffers, qlens: list[int], history: int, scratch: int, device: str) -> float:
    """One eager forward of `qlens` new tokens per sequence on `history` cached tokens; wall ms."""
    page = buf.page_size
    pages = [[scratch] * (-(-(history + q) // page)) for q in qlens]
    fb = ForwardBatch.build([[7] * q for q in qlens], [history] * len(qlens), pages, list(range(len(qlens))), page,
                            device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    model(fb, buf, device_longs([c - 1 for c in accumulate(qlens)], device))
    sync()
    return (time.perf_counter() - t0) * 1e3


def alloc_counts(device: str) -> dict[str, int]:
    """The CUDA caching allocator's counters that a slow first call could come from: cudaMalloc / cudaFree calls,
    retries after a failed cudaMalloc (which free the cache and synchronise), reserved bytes (empty off CUDA)."""
    if not device.startswith("cuda"):
        return {}
    st = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "reserved_bytes.all.current")
    return {k: int(st.get(k, 0)) for k in keys}


def top_calls(prof: cProfile.Profile, n: int = 12) -> list[str]:
    """The n functions with the most own time in a profile, as 'ms  calls  function'."""
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [f"{tt * 1e3:8.1f} ms {nc:6d}  {fn[0].rsplit('/', 1)[-1]}:{fn[1]}({fn[2]})"
            for fn, (_, nc, tt, _, _) in rows]


def random_shapes(n: int, seed: int = 0) -> list[list[int]]:
    """n mixed steps like multi-turn serving's: 0-15 decodes beside 1-3 tails of 2-64, 65-256 or 257-900 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tails = [rng.choice((rng.randint(2, 64), rng.randint(65, 256), rng.randint(257, 900)))
                 for _ in range(rng.randint(1, 3))]
        out.append([1] * rng.randint(0, 15) + tails)
    return out


def build(args) -> tuple[object, CacheBuffers, int, float]:
    """(model, cache buffers, scratch page, start-up s): with --engine the serving engine's own (its start-up
    warm-up and graph capture included), else a bare model whose warm-up is the lone prompts of WARM_UP_LENGTHS
    (unless --no-warm-up)."""
    t0 = time.time()
    if args.engine:
        from tokenspeed import LLM

        llm = LLM(args.geometry, device=args.device, load_format="dummy", max_num_seqs=32,
                  max_model_len=args.history + 2048, gpu_memory_utilization=0.9)
        runner = llm.engine.runner
        return runner.model, runner.buffers, runner.num_pages, time.time() - t0
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(args.geometry, dtype, args.device, load_format="dummy", seed=0)
    page = 64
    longest = args.history + 2048
    buf = CacheBuffers.allocate(model.config, -(-longest // page) + 1, page, 33, model.dtype, args.device)
    scratch = buf.mla_latent[0].shape[0] - 1 if buf.mla_latent else 0
    if not args.no_warm_up:
        with torch.no_grad():
            for n in WARM_UP_LENGTHS:
                step(model, buf, [n], 0, scratch, args.device)
    return model, buf, scratch, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="kimi-linear-48b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--history", type=int, default=10240)
    ap.add_argument("--shapes", default=SWE_SMITH_SHAPES, help="';' list of ','-separated new tokens per sequence")
    ap.add_argument("--random", type=int, default=0, help="this many more random mixed shapes (`random_shapes`)")
    ap.add_argument("--engine", action="store_true", help="start the serving engine (its warm-up and graphs)")
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--profile-first", type=float, default=0.0,
                    help="cProfile every first call; print the top functions of those slower than this many ms")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    shapes = [[int(x) for x in s.split(",")] for s in args.shapes.split(";") if s]
    shapes += random_shapes(args.random)
    if max(len(s) for s in shapes) > 32 or max(max(s) for s in shapes) > 2048:
        raise SystemExit("shapes must have at most 32 sequences of at most 2048 new tokens")
    model, buf, scratch, start_s = build(args)
    print(f"start-up (model, warm-up{', graphs' if args.engine else ''}): {start_s:.1f} s", flush=True)
    fns = jit_functions()
    if os.environ.get("TRITON_INTERPRET") == "1":
        SimulatedKeys.install()
    rows, t_start = [], time.time()
    with torch.no_grad():
        for qlens in shapes:
            before = keys(fns)
            mem0 = alloc_counts(args.device)
            prof = cProfile.Profile() if args.profile_first else None
            if prof is not None:
                prof.enable()
            first = step(model, buf, qlens, args.history, scratch, args.device)
            if prof is not None:
                prof.disable()
            mem = {k: v - mem0[k] for k, v in alloc_counts(args.device).items()}
            after = keys(fns)
            again = step(model, buf, qlens, args.history, scratch, args.device)
            new = {k: len(after[k] - before[k]) for k in after if after[k] - before[k]}
            why = {k: key_diffs(fns[k], after[k] - before[k], before[k]) for k in new}
            rows.append({"qlens": qlens, "first_ms": first, "repeat_ms": again, "new_variants": sum(new.values()),
                         "compiled": new, "why": why, "allocator": mem})
            if prof is not None and first > args.profile_first:
                rows[-1]["profile"] = top_calls(prof)
                print("    allocator:", mem, "\n    " + "\n    ".join(rows[-1]["profile"]), flush=True)
            for k, ds in why.items():
                for d in ds:
                    print(f"    {k.rsplit('.', 1)[-1]}: {d}", flush=True)
            print(f"{','.join(map(str, qlens)):>28}: first {first:9.1f} ms, repeat {again:8.1f} ms, "
                  f"{sum(new.values())} new variants {sorted(new)[:6]}", flush=True)
    res = {"env": {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                   "torch": torch.__version__, "commit": os.environ.get("BENCH_COMMIT", "unknown"),
                   "date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "wall_s": time.time() - t_start},
           "geometry": args.geometry, "history": args.history, "start_up_s": start_s, "engine": args.engine,
           "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_stalls.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
