"""What each op costs inside a captured decode step: the step with the op against the step without it.

    PYTHONPATH=.:benchmarks python benchmarks/marginal_cost_h200.py --batches 1,64 --out benchmarks/results/x.json
    PYTHONPATH=.:benchmarks python benchmarks/marginal_cost_h200.py --smoke     # CPU: the stand-in plumbing only

Per-kernel times with PDL off overstate what a kernel costs in the graph (PDL overlaps each kernel's start with
the previous one's tail), and with PDL on the profiler's kernel spans overlap. So this script captures the decode
graph once with every op and once per entry of --skip with that op replaced by a stand-in that launches nothing
and returns the op's real output for that call signature, recorded in an eager forward of the same batch just
before (`OpStandins`): values stay realistic (the MoE routing, the norms' scales), the pools the op would update
in place are left as they are, and nothing else changes. The graphs are timed interleaved (`--rounds` rounds of
CUDA events over 20 replays each, medians), and the op's marginal cost is the step without it subtracted from the
step with it: what a perfect fusion of that op into its neighbours could save at most. An entry is an op of
`tokenspeed.ops` by name, optionally restricted to calls whose weight (2nd argument) has a shape, e.g.
`linear:12576x2304` (the merged KDA input projection of kimi-linear-48b-a3b).

Writes one JSON: per batch, the full step time, and per entry its step time, marginal us per step and per call
(calls counted in the recording forward), with the command, commit and GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, Self

import torch

from tokenspeed import ops

DEFAULT_SKIPS = ("kda_decode,mla_decode,moe_experts,moe_gate,add_rms_norm,mla_norm_store_absorb,"
                 "linear:12576x2304,linear:2304x4096,linear:6720x2304,linear:163840x2304")


def _signature(x: Any) -> Any:
    """A hashable description of a call's arguments: tensors by shape, dtype and stride, the rest as they are."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), str(x.dtype), tuple(x.stride()))
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _signature(v)) for k, v in x.items()))
    return x if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__


class OpStandins:
    """Replaces `tokenspeed.ops.<name>` for the entries "name" or "name:NxK" (only calls whose second argument
    has shape (N, K)). Recording (`recording` True): each matched call runs the real op and its output is kept
    per call signature, calls counted. Skipping: a matched call returns the kept output, launching nothing; a
    signature never recorded (the graph ladder's other batch sizes) runs the real op. Use as a context manager;
    the real ops are restored on exit."""

    def __init__(self, entries: list[str]) -> None:
        self.entries: dict[str, tuple[int, int] | None] = {}
        for entry in entries:
            name, _, shape = entry.partition(":")
            if not hasattr(ops, name):
                raise ValueError(f"tokenspeed.ops has no op {name!r} (entry {entry!r})")
            self.entries[name] = tuple(int(v) for v in shape.split("x")) if shape else None
        self.recording = True
        self.kept: dict[tuple, Any] = {}
        self.pristine: list[tuple[torch.Tensor, torch.Tensor]] = []  # (kept tensor, its value when recorded)
        self.calls = 0
        self._saved: dict[str, Callable] = {}

    def _wrap(self, name: str, real: Callable, shape: tuple[int, int] | None) -> Callable:
        def standin(*args, **kwargs):
            w = args[1] if len(args) > 1 else None
            if shape is not None and not (isinstance(w, torch.Tensor) and tuple(w.shape) == shape):
                return real(*args, **kwargs)
            key = (name, _signature(args), _signature(kwargs))
            if self.recording:
                self.calls += 1
                out = real(*args, **kwargs)
                if key not in self.kept:
                    self.kept[key] = out
                    leaves = out if isinstance(out, (tuple, list)) else (out,)
                    self.pristine += [(t, t.clone()) for t in leaves if isinstance(t, torch.Tensor)]
                return out
            kept = self.kept.get(key)
            return real(*args, **kwargs) if kept is None else kept
        return standin

    def reset(self) -> None:
        """The kept outputs back to their recorded values (a later op may update one in place, e.g. a residual
        sum, so every replay of a graph that returns it would add to it again)."""
        for kept, value in self.pristine:
            kept.copy_(value)

    def __enter__(self) -> Self:
        for name, shape in self.entries.items():
            self._saved[name] = getattr(ops, name)
            setattr(ops, name, self._wrap(name, self._saved[name], shape))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(ops, name, real)
        self._saved.clear()


def _restore(buf, saved: list[torch.Tensor]) -> None:
    """The KDA pools back to the state decode_setup drew. Every replay advances them at the same position with
    random weights; over the ~1,000 replays of a run they reach inf / NaN, and NaN router scores route no expert
    (a first version of this script timed that: a 2.18 ms batch-1 step where the step is 2.57 ms)."""
    for dst, src in zip(buf.kda_recurrent + buf.kda_conv, saved, strict=True):
        dst.copy_(src)


def _graph(model, buf, batch: int, pps: int, fb, entry: str | None, saved: list[torch.Tensor]):
    """(decode graph captured with `entry` stood in, or with every op for None; its `OpStandins`, whose `calls`
    counts the matched calls of one forward)."""
    from tokenspeed.executor.cuda_graphs import DecodeGraphs

    _restore(buf, saved)
    g = DecodeGraphs(model, buf, batch, pps, scratch_page=batch * pps)
    g.sizes = [batch]  # only the graph of this batch size (the ladder's others would be captured for nothing)
    if entry is None:
        g.capture()
        return g, OpStandins([])
    with OpStandins([entry]) as st:
        model(fb, buf, torch.arange(batch, device="cuda"))  # the recording forward
        st.recording = False
        g.capture()
    return g, st


def marginal(model, batch: int, ctx: int, entries: list[str], rounds: int) -> dict:
    from graph_timing import events_ms
    from serving_h200 import decode_batch, decode_setup

    page_size = 64
    buf, pps = decode_setup(model, batch, ctx, page_size)
    fb = decode_batch(batch, ctx, pps, page_size)
    saved = [t.clone() for t in buf.kda_recurrent + buf.kda_conv]
    graphs = {None: _graph(model, buf, batch, pps, fb, None, saved)}
    for e in entries:
        graphs[e] = _graph(model, buf, batch, pps, fb, e, saved)
    times: dict = {k: [] for k in graphs}
    finite = dict.fromkeys(graphs, True)  # a stand-in's values that still blow up mark its row, not the run
    for _ in range(rounds):
        for k, (g, st) in graphs.items():
            _restore(buf, saved)
            st.reset()
            times[k].append(events_ms(lambda g=g: g.run(fb), 20, 3))
            finite[k] &= bool(torch.isfinite(g.run(fb)).all())
    base = statistics.median(times[None])
    if not finite[None]:
        raise RuntimeError("non-finite logits after the timed replays of the full step")
    out = {"batch": batch, "ctx": ctx, "step_ms": base, "rounds": rounds, "entries": {}}
    print(f"b{batch} ctx {ctx}: step {base:.3f} ms with every op", flush=True)
    for e in entries:
        ms = statistics.median(times[e])
        calls = graphs[e][1].calls
        us = (base - ms) * 1e3
        out["entries"][e] = {"step_ms": ms, "marginal_us": us, "calls": calls,
                             "marginal_us_per_call": us / calls if calls else None, "all_ms": times[e],
                             "finite_logits": finite[e]}
        print(f"  without {e:28s} {ms:8.3f} ms: {us:8.1f} us per step, {calls:3d} calls, "
              f"{us / max(calls, 1):6.2f} us per call{'' if finite[e] else ' (NON-FINITE logits)'}", flush=True)
    del graphs
    torch.cuda.empty_cache()
    return out


def smoke() -> None:
    """CPU: a tiny model's eager forward with each default entry stood in runs and gives finite logits."""
    from tokenspeed.models import CacheBuffers, ForwardBatch
    from tokenspeed.models.loader import load_model

    model = load_model("tiny-kimi-linear", torch.float32, "cpu", load_format="dummy", seed=0)
    buf = CacheBuffers.allocate(model.config, 9, 16, 3, torch.float32, "cpu")
    fb = ForwardBatch.build([[5], [6]], [20, 30], [[0, 1], [2, 3]], [0, 1], 16, "cpu")
    with torch.no_grad():
        for e in ["kda_decode", "mla_decode", "moe_experts", "add_rms_norm", "linear"]:
            with OpStandins([e]) as st:
                model(fb, buf, torch.arange(2))
                st.recording = False
                logits = model(fb, buf, torch.arange(2))
            print(f"smoke {e}: {st.calls} calls recorded, logits finite {bool(torch.isfinite(logits).all())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/marginal_cost_h200.json")
    ap.add_argument("--geometry", default="kimi-linear-48b-a3b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--skip", default=DEFAULT_SKIPS, help="comma list of ops (or op:NxK) to stand in, one at a time")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU check of the stand-ins on a tiny model")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    from tokenspeed.models.loader import load_model

    model = load_model(args.geometry, torch.bfloat16, "cuda", load_format="dummy", seed=0)
    entries = [e for e in args.skip.split(",") if e]
    t0 = time.time()
    with torch.no_grad():
        rows = [marginal(model, int(b), args.ctx, entries, args.rounds) for b in args.batches.split(",")]
    from graph_timing import write_result

    write_result(args.out, {"rows": rows}, seconds=time.time() - t0, geometry=args.geometry)


if __name__ == "__main__":
    main()
