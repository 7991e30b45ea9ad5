"""Where one decode step and one short-tail prefill spend their time, on one H200 (kimi-linear-48b-a3b, dummy bf16).

    PYTHONPATH=. python benchmarks/step_profile_h200.py --out benchmarks/results

- decode, batch 1 and 64 at 4K context: the captured graph's replay time against the summed durations of its
  kernels (CUPTI sees the kernels a graph launches), the kernel count, and the kernels of one KDA layer and one
  MLA layer in launch order, so the per-layer launch list can be read and cut down;
- short-tail prefill: T new tokens (64 / 256 / 1024) on a 16K-token history, eager as the engine runs it: wall
  time to completion against the kernel time, the kernel count, the host syncs, and a cProfile of the host side
  (the functions the host time goes to);
- PDL A/B (`--pdl-ab`, `--pdl-configs`): the same decode graph captured under several PDL / weight-prefetch
  settings (TOKENSPEED_PDL families, TOKENSPEED_GEMV_PREFETCH, TOKENSPEED_L2_PREFETCH), timed interleaved, and
  replayed from the same saved state for several steps: step times side by side and whether the logits of every
  step are bit-identical to the first setting's (neither changes arithmetic, so any difference is a race);
- KDA path for short tails: the same eager forward (a tail alone, and beside 15 decoding sequences) with the KDA
  layers on the fused recurrent kernel vs the chunked scan: wall time, kernel time, logits of one against the
  other.
Writes step_profile_h200.json to --out; prints as it goes.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from graph_timing import events_ms
import serving_h200
from serving_h200 import KV_DTYPES, _sync_sites, decode_batch, decode_setup

from tokenspeed.executor.cuda_graphs import DecodeGraphs
from tokenspeed.models import CacheBuffers, ForwardBatch
from tokenspeed.models.loader import load_model
from tokenspeed.ops import dispatch


def log(*a) -> None:
    print(*a, flush=True)


def kernels_of(fn) -> list[tuple[str, float]]:
    """(name, device us) of every kernel one call of fn() ran, in start order (torch.profiler / CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evs]


def summary(kernels: list[tuple[str, float]], top: int = 30) -> list:
    by = collections.defaultdict(lambda: [0.0, 0])
    for name, us in kernels:
        by[name[:100]][0] += us
        by[name[:100]][1] += 1
    rows = sorted(([k, round(v[0], 1), v[1], round(v[0] / v[1], 2)] for k, v in by.items()), key=lambda r: -r[1])
    return rows[:top]


def layer_slices(kernels: list[tuple[str, float]], model) -> dict:
    """The kernels of one KDA layer and one MLA layer: split the step at the attention kernels (one per layer)."""
    cfg = model.config
    marks = [i for i, (n, _) in enumerate(kernels) if "kda_decode" in n or "mla_split" in n or "mla_decode" in n]
    out = {}
    if len(marks) >= 3:
        for i in range(1, len(marks) - 1):
            name = "mla" if "mla" in kernels[marks[i]][0] else "kda"
            if name not in out:
                out[name] = [(n[:80], round(us, 2)) for n, us in kernels[marks[i]:marks[i + 1]]]
    out["layers"] = cfg.num_hidden_layers
    return out


def decode_profile(model, batch: int, ctx: int) -> dict:
    page_size = 64
    buf, pps = decode_setup(model, batch, ctx, page_size)
    graphs = DecodeGraphs(model, buf, batch, pps, scratch_page=batch * pps)
    graphs.capture()
    fb = decode_batch(batch, ctx, pps, page_size)
    step_ms = events_ms(lambda: graphs.run(fb), 30, 5)
    graph_k = kernels_of(lambda: graphs.run(fb))
    eager_k = kernels_of(lambda: model(fb, buf, torch.arange(batch, device="cuda")))
    k_ms = sum(us for _, us in graph_k) / 1e3
    out = {"batch": batch, "ctx": ctx, "graph_step_ms": step_ms, "graph_kernels": len(graph_k),
           "graph_kernel_ms": k_ms, "gaps_ms": step_ms - k_ms, "eager_kernels": len(eager_k),
           "top": summary(graph_k), "per_layer": layer_slices(eager_k, model),
           "all_graph_kernels": [(n[:60], round(us, 2)) for n, us in graph_k]}
    log(f"decode b{batch} ctx {ctx}: graph {step_ms:.3f} ms, {len(graph_k)} kernels summing {k_ms:.3f} ms "
        f"(gaps {step_ms - k_ms:.3f} ms)")
    for r in out["top"][:22]:
        log("   ", r)
    for name in ("kda", "mla"):
        log(f"  one {name} layer:", out["per_layer"].get(name))
    return out  # the graphs are freed with this frame


def host_profile(model, batch: int, ctx: int) -> dict:
    """Where the host time of one eager decode forward goes: wall time, then cProfile by own time and by
    cumulative time (top 40 each), to find what makes eager steps host-bound."""
    page_size = 64
    buf, pps = decode_setup(model, batch, ctx, page_size)
    fb = decode_batch(batch, ctx, pps, page_size)
    rows = torch.arange(batch, device="cuda")
    for _ in range(3):
        model(fb, buf, rows)
    torch.cuda.synchronize()
    walls = []
    for _ in range(10):
        t0 = time.perf_counter()
        model(fb, buf, rows)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    prof = cProfile.Profile()
    prof.enable()
    model(fb, buf, rows)
    torch.cuda.synchronize()
    prof.disable()
    texts = {}
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(40)
        texts[key] = s.getvalue()
    calls = pstats.Stats(prof).total_calls
    out = {"batch": batch, "ctx": ctx, "eager_wall_ms": statistics.median(walls), "python_calls": calls,
           "kernels": len(kernels_of(lambda: model(fb, buf, rows))), "cprofile": texts}
    log(f"eager decode b{batch}: wall {out['eager_wall_ms']:.2f} ms, {calls} Python calls, {out['kernels']} kernels")
    log(texts["tottime"][:6000])
    log(texts["cumtime"][:6000])
    torch.cuda.empty_cache()
    return out


def _config_env(config: str) -> dict[str, str]:
    """"pdl:gemv_prefetch:l2[:lin[:NAME=VALUE,...]]" (e.g. "1:regs:1", "-mla,-kda:regs:0",
    "1:regs:0:table:TOKENSPEED_MOE_GATE=0") -> the environment of that setting: the three PDL / prefetch
    variables, plus any extra variables named in the 5th field (an op's own A/B switch)."""
    fields = config.split(":", 4) + [""] * 5
    pdl_set, prefetch, l2, extra = fields[0], fields[1], fields[2], fields[4]
    env = {"TOKENSPEED_PDL": pdl_set or "1", "TOKENSPEED_GEMV_PREFETCH": prefetch or "regs",
           "TOKENSPEED_L2_PREFETCH": l2 or "0"}
    for item in filter(None, extra.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("TOKENSPEED_"):
            raise ValueError(f"extra settings are TOKENSPEED_NAME=VALUE; got {item!r} in {config!r}")
        env[name] = value
    return env


class _EveryShapeGemv(dict):
    """A routing-table `routes` mapping under which every (N, K) takes the Triton GEMV's default config for
    M <= 16: the "gemv" linear setting of the A/B (is cuBLAS's projection, which launches without PDL and so
    breaks the chain of dependents, still faster than the GEMV inside a step?)."""

    def get(self, key, default=None):
        return ((16, {}),)


def _linear_setting(config: str) -> str:
    """The 4th field of a --pdl-configs entry: "table" (the committed routing table; default), "gemv", or
    "table=PATH" (that table's entries over the committed one's, e.g. one from gemv_h200.py --producer-cycles)."""
    lin = (config.split(":") + ["", "", ""])[3] or "table"
    if lin not in ("table", "gemv") and not lin.startswith("table="):
        raise ValueError(f"linear setting must be table, gemv or table=PATH; got {lin!r} in {config!r}")
    return lin


def _merged_table(path: str) -> dict:
    """The committed routing table with the M buckets of the table at `path` put over it (raw JSON form)."""
    from gemv_table_merge import merge  # benchmarks/ (the script's folder is on sys.path)

    return merge(json.loads(dispatch.LINEAR_TABLE_PATH.read_text()), json.loads(Path(path).read_text()))


def pdl_ab(model, batch: int, ctx: int, configs: list[str], steps: int = 8, rounds: int = 5,
           page_size: int = 64) -> dict:
    """Decode graphs captured under each PDL / prefetch setting (`_config_env`) over one cache, all kept alive and
    timed interleaved (`rounds` rounds of events over 20 replays each, medians), so clock or thermal drift hits
    every setting alike; each also replays `steps` steps from the same saved KDA state, and its logits must equal
    the first setting's bit for bit (PDL and prefetches change no arithmetic: a difference is a race)."""
    buf, pps = decode_setup(model, batch, ctx, page_size)
    saved = [t.clone() for t in buf.kda_recurrent + buf.kda_conv]
    fb = decode_batch(batch, ctx, pps, page_size)
    prev = {k: os.environ.get(k) for cfg in configs for k in _config_env(cfg)}
    graphs, logits = {}, {}
    try:
        for cfg in configs:
            for k, v in prev.items():  # settings not named by this entry: as the process started
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.environ.update(_config_env(cfg))
            lin = _linear_setting(cfg)
            if lin == "gemv":
                dispatch.set_linear_table(dispatch.LinearTable(dispatch.linear_table().dtypes, _EveryShapeGemv()))
            elif lin.startswith("table="):
                dispatch.set_linear_table(_merged_table(lin.removeprefix("table=")))
            g = graphs[cfg] = DecodeGraphs(model, buf, batch, pps, scratch_page=batch * pps)
            g.capture()
            dispatch.set_linear_table(None)
            for dst, src in zip(buf.kda_recurrent + buf.kda_conv, saved, strict=True):
                dst.copy_(src)
            logits[cfg] = [g.run(fb).float().clone() for _ in range(steps)]
    finally:
        dispatch.set_linear_table(None)
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    times = {cfg: [] for cfg in configs}
    for _ in range(rounds):
        for cfg in configs:
            times[cfg].append(events_ms(lambda g=graphs[cfg]: g.run(fb), 20, 3))
    base = configs[0]
    out = {"batch": batch, "ctx": ctx, "rounds": rounds, "page_size": page_size,
           "kv_cache_dtype": str(serving_h200.KV_CACHE_DTYPE or model.dtype), "configs": {}}
    for cfg in configs:
        pairs = list(zip(logits[cfg], logits[base], strict=True))
        same = all(torch.equal(a, b) for a, b in pairs)
        # settings that change arithmetic (a fusion's switch) are compared by argmax and the largest difference
        argmax = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in pairs)
        diff = max((a - b).abs().max().item() for a, b in pairs)
        ms = statistics.median(times[cfg])
        out["configs"][cfg] = {"step_ms": ms, "all_ms": times[cfg], "bit_equal_to_first": same,
                               "argmax_equal_to_first": argmax, "max_abs_logit_diff": diff}
        log(f"PDL A/B b{batch} ctx {ctx} [{cfg:>18}]: {ms:.3f} ms (x{statistics.median(times[base]) / ms:.3f} "
            f"vs {base}), over {steps} steps vs {base}: bit-equal {same}, argmax equal {argmax}, "
            f"max |logit diff| {diff:.3g}")
    del graphs
    torch.cuda.empty_cache()
    return out


def prefill_profile(model, history: int, tails: list[int], beside: int = 0) -> list:
    """Eager forward of a T-token tail on a `history`-token history, alone or beside `beside` sequences decoding
    at the same history (the mixed step a serving engine runs when a turn's new tokens arrive)."""
    cfg, page_size = model.config, 64
    pages = (history + max(tails)) // page_size + 2
    buf = CacheBuffers.allocate(cfg, pages * (beside + 1) + 1, page_size, beside + 2, model.dtype, "cuda")
    for t in buf.mla_latent:
        t.normal_(0, 1)
    rows = []
    for tail in tails:
        ids = torch.randint(0, cfg.vocab_size, (tail,)).tolist()
        toks = [ids] + [[5 + i] for i in range(beside)]
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(beside + 1)]
        fb = ForwardBatch.build(toks, [history] * (beside + 1), tables, list(range(beside + 1)), page_size, "cuda")
        last = torch.tensor([tail - 1 + i for i in range(beside + 1)], device="cuda")

        def step(fb=fb, last=last):
            return model(fb, buf, last)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        ks = kernels_of(step)
        syncs = _sync_sites(step)
        prof = cProfile.Profile()
        prof.enable()
        step()
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        cum = io.StringIO()
        pstats.Stats(prof, stream=cum).sort_stats("cumulative").print_stats("tokenspeed", 40)
        row = {"history": history, "tail": tail, "beside": beside, "wall_ms": statistics.median(walls),
               "events_ms": events_ms(step, 10, 2), "kernels": len(ks), "kernel_ms": sum(u for _, u in ks) / 1e3,
               "host_syncs": syncs, "top": summary(ks, 25), "cprofile": s.getvalue()[-6000:],
               "cprofile_cumulative": cum.getvalue()[-9000:]}
        log(f"prefill tail {tail} on {history} beside {beside}: wall {row['wall_ms']:.2f} ms, events {row['events_ms']:.2f} ms, "
            f"{len(ks)} kernels summing {row['kernel_ms']:.2f} ms, syncs {syncs}")
        for r in row["top"][:10]:
            log("   ", r)
        if tail == tails[len(tails) // 2]:
            log(row["cprofile"])
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


def tail_policy(model, history: int, tails: list[int], others: int = 15) -> list:
    """Eager forward of a short tail (alone, and beside `others` decoding sequences) with the KDA layers on the
    fused recurrent kernel vs on the chunked scan (fla): wall time to completion (host + GPU, what an eager step
    costs), and the last-token logits of the two against each other (same weights, same starting state)."""
    import tokenspeed.models.kimi.kda as kda_mod

    cfg, page_size = model.config, 64
    pps = (history + max(tails)) // page_size + 2
    buf = CacheBuffers.allocate(cfg, pps * (others + 1) + 1, page_size, others + 2, model.dtype, "cuda")
    for t in buf.mla_latent:
        t.normal_(0, 1)
    for t in buf.kda_recurrent:
        t.normal_(0, 0.05)
    snap = [t.clone() for t in buf.kda_recurrent + buf.kda_conv]
    default = kda_mod.FUSED_MAX_TAIL_CUDA
    rows = []
    for tail in tails:
        for n_dec in (0, others):
            ids = torch.randint(0, cfg.vocab_size, (tail,)).tolist()
            toks = [ids] + [[5 + i] for i in range(n_dec)]
            cached = [history] + [4096] * n_dec
            tables = [list(range(i * pps, (i + 1) * pps)) for i in range(n_dec + 1)]
            fb = ForwardBatch.build(toks, cached, tables, list(range(n_dec + 1)), page_size, "cuda")
            last = torch.tensor([tail - 1 + i for i in range(n_dec + 1)], device="cuda")
            row = {"tail": tail, "history": history, "decoding_beside": n_dec}
            logits = {}
            for policy, limit in (("fused", 1 << 30), ("chunk", 0)):
                kda_mod.FUSED_MAX_TAIL_CUDA = limit
                try:
                    for dst, src in zip(buf.kda_recurrent + buf.kda_conv, snap, strict=True):
                        dst.copy_(src)
                    logits[policy] = model(fb, buf, last).float()
                    walls = []
                    for _ in range(7):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        model(fb, buf, last)
                        torch.cuda.synchronize()
                        walls.append((time.perf_counter() - t0) * 1e3)
                    row[f"{policy}_wall_ms"] = statistics.median(walls[2:])
                    row[f"{policy}_kernel_ms"] = sum(u for _, u in kernels_of(lambda fb=fb, last=last: model(fb, buf, last))) / 1e3
                finally:
                    kda_mod.FUSED_MAX_TAIL_CUDA = default
            a, b = logits["fused"], logits["chunk"]
            row["logits_rel_l2"] = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
            row["argmax_equal"] = bool((a.argmax(-1) == b.argmax(-1)).all())
            log(row)
            rows.append(row)
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--geometry", default="kimi-linear-48b-a3b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tails", default="64,256,1024")
    ap.add_argument("--history", type=int, default=16384)
    ap.add_argument("--policy-tails", default="16,64,160,256,512,1024")
    ap.add_argument("--beside", type=int, default=0, help="decoding sequences beside the profiled prefill tail")
    ap.add_argument("--skip", default="", help="comma list of: decode, prefill, policy")
    ap.add_argument("--host", action="store_true", help="cProfile one eager batch-1 decode forward")
    ap.add_argument("--pdl-ab", default="", help="comma list of batches for the PDL / prefetch A/B (none: skip)")
    ap.add_argument("--pdl-ctx", default="4096", help="comma list of contexts for the A/B (each with every batch)")
    ap.add_argument("--pdl-page", type=int, default=64, help="MLA cache page size of the A/B (the server's: 16)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_DTYPES),
                    help="the MLA latent cache of the A/B (fp8: e4m3, as `tokenspeed serve --kv-cache-dtype fp8`)")
    ap.add_argument("--pdl-configs", default="0:regs:1;1:regs:1;1:regs:0;1:none:1;1:l2:1;-mla:regs:1;-mla,-kda:regs:1",
                    help="';' list of pdl:gemv_prefetch:l2[:table|gemv] settings for --pdl-ab (the first is the reference)")
    args = ap.parse_args()
    res = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "python": platform.python_version(), "commit": os.environ.get("BENCH_COMMIT", "unknown"),
                   "argv": sys.argv, "date": time.strftime("%Y-%m-%d")}}
    model = load_model(args.geometry, torch.bfloat16, "cuda", load_format="dummy", seed=0)
    with torch.no_grad():
        skip = set(args.skip.split(","))
        if "decode" not in skip:
            res["decode"] = [decode_profile(model, int(b), 4096) for b in args.batches.split(",")]
        if args.host:
            res["host"] = host_profile(model, 1, 4096)
        if args.pdl_ab:
            configs = args.pdl_configs.split(";")
            serving_h200.KV_CACHE_DTYPE = KV_DTYPES[args.kv_cache_dtype]
            res["pdl_ab"] = [pdl_ab(model, int(b), ctx, configs, page_size=args.pdl_page)
                             for ctx in map(int, args.pdl_ctx.split(","))
                             for b in args.pdl_ab.split(",")]
        if "prefill" not in skip:
            res["prefill"] = prefill_profile(model, args.history, [int(t) for t in args.tails.split(",")],
                                             args.beside)
        if "policy" not in skip:
            res["tail_policy"] = tail_policy(model, args.history, [int(t) for t in args.policy_tails.split(",")])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_profile_h200.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
