"""Issue 8 on one H200: the GPU runner (Triton ops + decode CUDA graphs) on the benchmark geometries.

    PYTHONPATH=. python benchmarks/serving_h200.py --out benchmarks/results

In one run, per geometry (`kimi-linear-48b-a3b` ~98 GB bf16, `k3-slice` ~66 GB bf16, dummy weights on the GPU):
- parity: GPU-path logits (Triton ops; decode through the captured graph) against the same model through the
  torch reference ops (`TOKENSPEED_OPS=reference`) on short prompts: prefill and one decode step;
- decode: step time (graph replay, CUDA events, median after warm-up) and output tok/s for batch 1/4/16/64 at
  4K and 32K context, against the streaming roofline: (weights touched + KDA state read/write + MLA rows read)
  / 4.27 TB/s, where routed-expert bytes count the expected distinct experts E (1 - (1 - k/E)^B) of B tokens;
- eager vs graph at batch 1 (what the graphs buy);
- prefill: one 8K-token chunk from an empty cache (eager), FLOPs = 2 x active params x tokens + attention,
  against the bf16 matmul rate measured in this run;
- engine: `LLM` with the dummy geometry, 64 requests decoding together: per-step wall time vs the graph's GPU
  time (the CPU work not hidden behind the GPU);
- reference implementation: Hugging Face `transformers` KimiLinearForCausalLM.generate on the same geometry
  (its own random weights), batch 1 and 16, decode tok/s against ours at the same context.
Also the tiny-model check: greedy tokens of the trained default model on the GPU (fp32) equal the CPU's.
Writes serving_h200.json + serving_h200.png to --out; prints as it goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch
from graph_timing import events_ms  # benchmarks/graph_timing.py (the script's own folder is on sys.path)

from tokenspeed.executor.cuda_graphs import DecodeGraphs
from tokenspeed.models import CacheBuffers, ForwardBatch
from tokenspeed.models.kimi.moe import ROUTING_SIMULATIONS, set_routing_simulation
from tokenspeed.models.loader import load_model, resolve_config

HBM = 4.27e12
# The MLA latent cache's dtype in the decode sweep (--kv-cache-dtype; None: the model's dtype): set per sweep.
KV_CACHE_DTYPE: torch.dtype | None = None
KV_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# Tokens per MLA cache page in the decode sweep (--decode-page-size; `tokenspeed serve` defaults to 16).
DECODE_PAGE_SIZE = 64
RESULT: dict = {"sections": {}, "errors": {}}


def log(*a) -> None:
    print(*a, flush=True)


def section(name):
    """Run a section, record its result or its error (a failing section does not stop the run)."""
    def wrap(fn):
        def run(*args, **kw):
            t = time.perf_counter()
            try:
                out = fn(*args, **kw)
                RESULT["sections"].setdefault(name, []).append(out)
                log(f"== {name} done in {time.perf_counter() - t:.1f} s")
                return out
            except Exception as e:  # noqa: BLE001 - recorded and reported
                RESULT["errors"][f"{name}:{len(RESULT['errors'])}"] = traceback.format_exc()
                log(f"== {name} FAILED: {e!r}\n{traceback.format_exc()}")
                return None
        return run
    return wrap


def cuda_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median device time of fn() in ms (CUDA events around each call)."""
    return events_ms(fn, iters, warmup)


@section("ceilings")
def ceilings() -> dict:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: x @ y, iters=10)
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), iters=10)
    out = {"matmul_bf16_tflops": 2 * 8192**3 / ms / 1e9, "copy_tb_s": 2 * 2**31 / copy_ms / 1e9}
    log(out)
    return out


# ----------------------------------------------------------------------------------------------------------- bytes
def distinct_experts(model, fb: ForwardBatch, buf: CacheBuffers) -> list[int]:
    """Distinct experts per MoE layer in one eager forward of `fb` (advances its states once): the routed ones,
    plus the shared expert where it is folded in as an always-selected expert (Kimi Linear: id E). Counted after
    the forward, so a simulated routing (`set_routing_simulation`, which rewrites the ids in place) is what counts."""
    from tokenspeed import ops

    seen: list[torch.Tensor] = []
    route, gate = ops.moe_route, ops.moe_gate  # the routing runs in one or the other (ops.moe_gate at decode sizes)

    def spy_route(*a, **kw):
        w, ids = route(*a, **kw)
        seen.append(ids)
        return w, ids

    def spy_gate(*a, **kw):
        out = gate(*a, **kw)
        seen.append(out[3])
        return out

    ops.moe_route, ops.moe_gate = spy_route, spy_gate
    try:
        model(fb, buf, torch.arange(fb.num_seqs, device="cuda"))
    finally:
        ops.moe_route, ops.moe_gate = route, gate
    if not seen:
        raise RuntimeError("no routing seen in a forward: distinct_experts spies on ops.moe_route / ops.moe_gate")
    return [int(ids.unique().numel()) for ids in seen]


def byte_model(model, batch: int, ctx: int, experts: list[int] | None = None) -> dict:
    """Bytes a decode step must move at this batch and context (the roofline's numerator). `experts`: measured
    distinct experts per MoE layer (else the uniform-routing expectation E (1 - (1 - k/E)^B)). A shared expert
    folded into the stacked expert weights (slot E of [E + 1, ...], always selected) is counted once, as a touched
    expert: `experts` includes its id, the expectation adds it; an unfolded shared MLP is one of the parameters."""
    cfg = model.config
    slot_bytes, slots, other = 0.0, 0, 0  # bytes of one expert slot summed over the MoE layers; slots per layer
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith((".w1", ".w2", ".w3")):
            slot_bytes += nbytes / p.shape[0]
            slots = p.shape[0]
        elif "embed_tokens" not in name:
            other += nbytes
    e, k = cfg.num_experts or 1, cfg.num_experts_per_token or 1
    folded = max(slots - e, 0)  # 1 with the shared expert folded in
    touched = e * (1 - (1 - k / e) ** batch) + folded if experts is None else sum(experts) / len(experts)
    kda_state = len(cfg.kda_layers) * cfg.kda_num_heads * cfg.kda_head_dim**2 * 4 * 2 * batch
    kv_bytes = (KV_CACHE_DTYPE or model.dtype).itemsize
    mla_rows = len(cfg.mla_layers) * cfg.mla_latent_dim * kv_bytes * ctx * batch
    total = other + slot_bytes * touched + kda_state + mla_rows
    return {"dense_weights": other, "experts_touched": slot_bytes * touched, "kda_state_rw": kda_state,
            "mla_rows": mla_rows, "total": total}


def decode_setup(model, max_batch: int, max_ctx: int, page_size: int = 64) -> tuple[CacheBuffers, int]:
    cfg = model.config
    pages_per_seq = max_ctx // page_size
    num_pages = max_batch * pages_per_seq
    buf = CacheBuffers.allocate(cfg, num_pages + 1, page_size, max_batch + 1, model.dtype, "cuda",
                                kv_cache_dtype=KV_CACHE_DTYPE)
    for t in buf.mla_latent:
        t.copy_(torch.randn(t.shape, device=t.device, dtype=model.dtype))  # fp8 pools have no normal_
    for t in buf.kda_recurrent:
        t.normal_(0, 0.05)
    return buf, pages_per_seq


def decode_batch(batch: int, ctx: int, pages_per_seq: int, page_size: int, q_len: int = 1) -> ForwardBatch:
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
    return ForwardBatch.build([[7 + i] * q_len for i in range(batch)], [ctx - q_len] * batch, tables,
                              list(range(batch)), page_size, "cuda")


@section("decode")
def decode_sweep(model, name: str, batches: list[int], contexts: list[int], kv_cache_dtype: str = "auto") -> dict:
    global KV_CACHE_DTYPE
    KV_CACHE_DTYPE = KV_DTYPES[kv_cache_dtype]
    page_size = DECODE_PAGE_SIZE
    buf, pps = decode_setup(model, max(batches), max(contexts), page_size)
    graphs = DecodeGraphs(model, buf, max(batches), pps, scratch_page=max(batches) * pps)
    t = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t
    rows = []
    for ctx in contexts:
        for b in batches:
            fb = decode_batch(b, ctx, pps, page_size)
            experts = distinct_experts(model, fb, buf)
            ms = cuda_ms(lambda: graphs.run(fb))
            bytes_ = byte_model(model, b, ctx, experts)
            roof_ms = bytes_["total"] / HBM * 1e3
            row = {"geometry": name, "kv_cache_dtype": kv_cache_dtype, "page_size": page_size, "ctx": ctx, "batch": b, "step_ms": ms, "distinct_experts_mean":
                   statistics.mean(experts) if experts else None, "tok_s": b / ms * 1e3,
                   "tok_s_per_user": 1e3 / ms, "roofline_ms": roof_ms, "fraction_of_roofline": roof_ms / ms,
                   "bytes": bytes_}
            rows.append(row)
            log(f"{name} kv {kv_cache_dtype} page {page_size} ctx {ctx:6d} batch {b:3d}: {ms:7.3f} ms  {row['tok_s']:8.1f} tok/s  "
                f"roofline {roof_ms:6.3f} ms  = {100 * roof_ms / ms:5.1f}%")
    fb = decode_batch(1, contexts[0], pps, page_size)
    eager_ms = cuda_ms(lambda: model(fb, buf, torch.arange(1, device="cuda")), iters=10)
    graph_ms = cuda_ms(lambda: graphs.run(fb))
    log(f"{name} batch 1 ctx {contexts[0]}: eager {eager_ms:.3f} ms vs graph {graph_ms:.3f} ms")
    torch.cuda.empty_cache()  # the graphs and buffers are freed when this frame goes
    return {"geometry": name, "kv_cache_dtype": kv_cache_dtype, "rows": rows, "capture_s": capture_s, "eager_ms_b1": eager_ms, "graph_ms_b1": graph_ms}


@section("parity")
def parity(model, name: str) -> dict:
    """GPU fast path vs the reference ops on the same GPU and weights.

    prefill: Triton/fla/SDPA eager vs reference ops, from empty caches; the bf16 noise floor of this geometry is the
    reference path itself run on each prompt alone vs both batched (only the rounding order differs).
    decode: from one shared post-prefill state, the captured graph vs the reference ops.
    """
    page_size, n, prompt = 16, 2, 40
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt,), generator=gen).tolist() for _ in range(n)]
    pages = [list(range(i * 8, (i + 1) * 8)) for i in range(n)]

    def fresh():
        return CacheBuffers.allocate(model.config, 8 * n + 1, page_size, n + 1, model.dtype, "cuda")

    def prefill_logits(mode: str, seqs: list[int]):
        os.environ["TOKENSPEED_OPS"] = mode
        buf = fresh()
        fb = ForwardBatch.build([prompts[i] for i in seqs], [0] * len(seqs), [pages[i] for i in seqs], seqs,
                                page_size, "cuda")
        rows = torch.arange(1, len(seqs) + 1, device="cuda") * prompt - 1
        return model(fb, buf, rows).float(), buf

    try:
        ref_p, buf = prefill_logits("reference", [0, 1])
        solo = torch.cat([prefill_logits("reference", [i])[0] for i in range(n)])
        fast_p, _ = prefill_logits("auto", [0, 1])
        nxt = ref_p.argmax(-1).tolist()
        dec = ForwardBatch.build([[t] for t in nxt], [prompt] * n, pages, list(range(n)), page_size, "cuda")
        snap = [t.clone() for t in buf.kda_recurrent + buf.kda_conv + buf.mla_latent]
        os.environ["TOKENSPEED_OPS"] = "reference"
        ref_d = model(dec, buf, torch.arange(n, device="cuda")).float()
        for dst, src in zip(buf.kda_recurrent + buf.kda_conv + buf.mla_latent, snap, strict=True):
            dst.copy_(src)
        os.environ["TOKENSPEED_OPS"] = "auto"
        g = DecodeGraphs(model, buf, n, 8, scratch_page=8 * n)
        g.capture()
        fast_d = g.run(dec).float().clone()
    finally:
        os.environ["TOKENSPEED_OPS"] = "auto"

    def rel(a, b):
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()

    out = {"geometry": name, "prefill_rel_l2": rel(fast_p, ref_p), "prefill_noise_floor_rel_l2": rel(solo, ref_p),
           "decode_graph_rel_l2": rel(fast_d, ref_d),
           "prefill_argmax_equal": (fast_p.argmax(-1) == ref_p.argmax(-1)).tolist(),
           "decode_argmax_equal": (fast_d.argmax(-1) == ref_d.argmax(-1)).tolist()}
    log(out)
    return out


@section("profile")
def profile(model, name: str, batches: list[int], ctx: int, prefill_tokens: int) -> dict:
    """Kernel time by name of one eager decode step per batch and of one prefill chunk (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    page_size = 64
    out = {}
    buf, pps = decode_setup(model, max(batches), ctx, page_size)
    cases = [(f"decode_b{b}", decode_batch(b, ctx, pps, page_size)) for b in batches]
    ids = torch.randint(0, model.config.vocab_size, (prefill_tokens,)).tolist()
    pages = prefill_tokens // page_size + 1
    cases.append(("prefill", ForwardBatch.build([ids], [0], [list(range(pages))], [0], page_size, "cuda")))
    for label, fb in cases:
        rows = torch.arange(1, device="cuda") if label == "prefill" else torch.arange(fb.num_seqs, device="cuda")
        model(fb, buf, rows)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                           record_shapes=label == "prefill") as prof:
            model(fb, buf, rows)
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
        if label == "prefill":  # which torch ops the kernel time comes from (by op and input shapes)
            out["prefill_ops"] = _ops_table(prof)
            for k, ms, c in out["prefill_ops"][:25]:
                log(f"  op {ms:8.3f} ms  x{c:4d}  {k}")
        table = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0:
                table.append((ev.key[:90], t / 1e3, ev.count))
        gpu_keys = {ev.key for ev in prof.events() if str(getattr(ev, "device_type", "")).endswith("CUDA")}
        table = [r for r in table if r[0] in {k[:90] for k in gpu_keys}]  # kernels only, not the ops above them
        table.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in table)
        out[label] = {"kernel_ms_total": total, "wall_ms_profiled": wall_ms, "top": table[:25]}
        log(f"--- {name} {label}: kernels {total:.3f} ms")
        for k, ms, c in table[:18]:
            log(f"  {ms:8.3f} ms  x{c:4d}  {k}")
    torch.cuda.empty_cache()
    return out


def _ops_table(prof) -> list:
    """(op + input shapes, self device ms, calls) of the aten ops, by self device time."""
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t > 0 and ev.key.startswith("aten::"):
            rows.append((f"{ev.key} {str(ev.input_shapes)[:120]}", t / 1e3, ev.count))
    rows.sort(key=lambda r: -r[1])
    return rows[:40]


@section("prefill")
def prefill(model, name: str, tokens: int, matmul_tflops: float | None) -> dict:
    cfg = model.config
    page_size = 64
    pages = tokens // page_size + 1
    buf = CacheBuffers.allocate(cfg, pages + 1, page_size, 2, model.dtype, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
    fb = ForwardBatch.build([ids], [0], [list(range(pages))], [0], page_size, "cuda")
    last = torch.tensor([tokens - 1], device="cuda")

    def step():
        buf.reset_slots([0])
        model(fb, buf, last)

    ms = cuda_ms(step, iters=5, warmup=2)
    kernel_ms = _kernel_ms(step)
    syncs = _sync_sites(step)
    copies_ms = _with_qkv_copies(lambda: cuda_ms(step, iters=5, warmup=2))
    fresh_ms = _with_fresh_fla_offsets(lambda: cuda_ms(step, iters=5, warmup=2))
    active = active_params(model)
    attn = sum(4 * tokens * tokens / 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
               for _ in cfg.mla_layers)
    flops = 2 * active * tokens + attn
    rate = flops / ms / 1e9
    out = {"geometry": name, "tokens": tokens, "ms": ms, "kernel_ms": kernel_ms, "ms_with_qkv_copies": copies_ms,
           "ms_with_fla_sync_per_layer": fresh_ms, "host_syncs": syncs,
           "tok_s": tokens / ms * 1e3, "tflops": rate,
           "active_params": active, "fraction_of_matmul": rate / matmul_tflops if matmul_tflops else None}
    log(out)
    torch.cuda.empty_cache()
    return out


def _kernel_ms(fn) -> float:
    """Summed device time of the kernels of one call of fn (torch.profiler), to set against its wall time."""
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return sum(getattr(e, "device_time_total", 0) or 0 for e in kernels) / 1e3


def _sync_sites(fn) -> list:
    """The host synchronisations of one call of fn: torch's sync debug mode warns at each one; returned as
    [count, innermost tokenspeed/fla frames] rows, most frequent first."""
    import traceback
    import warnings
    from collections import Counter

    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "tokenspeed" in f.filename or "/fla/" in f.filename]
        sites[" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}:{f.name}" for f in frames[::-1][:4])] += 1

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    rows = [[n, site] for site, n in sites.most_common()]
    log({"host_syncs": rows})
    return rows


def _with_fresh_fla_offsets(fn):
    """fn() with a new CPU offsets tensor per KDA layer (before: every layer missed fla's identity-keyed chunk
    table cache and synchronised): an A/B of that change in one run."""
    from tokenspeed.ops.cuda import kda_chunk

    orig = kda_chunk._host_offsets
    kda_chunk._host_offsets = lambda cu, host: torch.tensor(host, dtype=torch.int64)
    try:
        return fn()
    finally:
        kda_chunk._host_offsets = orig


def _with_qkv_copies(fn):
    """fn() with KDA prefill's conv writing a plain [T, C] output that is then copied into the grouped q/k/v
    buffer (the layout before q, k, v came out of the conv contiguous): an A/B of that change in one run."""
    from tokenspeed import ops

    orig = ops.causal_conv1d

    def plain(x, w, cs, si, cu, activation="silu", *, out=None):
        y = orig(x, w, cs, si, cu, activation)
        return y if out is None else out.copy_(y.view(out.shape))

    ops.causal_conv1d = plain
    try:
        return fn()
    finally:
        ops.causal_conv1d = orig


def active_params(model) -> int:
    """Parameters a token uses, less the embedding: k of the E routed experts, plus a shared expert folded in as
    slot E of the stacked expert weights (always active), plus everything else."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        if name.endswith((".w1", ".w2", ".w3")):
            folded = p.shape[0] - cfg.num_experts  # 1 with the shared expert folded in
            total += p.numel() // p.shape[0] * (cfg.num_experts_per_token + folded)
        else:
            total += p.numel()
    return total


@section("engine")
def engine_overhead(name: str, batch: int, prompt: int, output: int, async_scheduling: str = "auto",
                    temperature: float = 0.0) -> dict:
    """LLM on the dummy geometry: per-step wall time against the graph replay's GPU time at `batch`, with the
    asynchronous scheduling mode given (auto: on with graphs; off: every step synchronous), greedy or sampled."""
    from tokenspeed import LLM, SamplingParams

    llm = LLM(name, device="cuda", load_format="dummy", max_num_seqs=batch, max_model_len=prompt + output + 64,
              max_num_batched_tokens=8192, chunked_prefill_size=8192, gpu_memory_utilization=0.92,
              async_scheduling=async_scheduling)
    graphs = llm.engine.runner.graphs[1]
    gpu_ms: list[float] = []
    orig = graphs.run

    def timed(fb):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = orig(fb)
        b.record()
        timed.events.append((a, b, fb.num_seqs))
        return out

    timed.events = []
    graphs.run = timed
    for i in range(batch):
        llm.add_request(list(range(100 + i, 100 + i + prompt)),
                        SamplingParams(max_tokens=output, ignore_eos=True, temperature=temperature, top_p=0.95))
    walls = []
    t0 = time.perf_counter()
    while llm.engine.has_work:
        before = len(timed.events)
        llm.engine.step()
        if len(timed.events) > before and timed.events[-1][2] == batch:
            walls.append(llm.engine.last_step.duration * 1e3)
    total_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu_ms = [a.elapsed_time(b) for a, b, n in timed.events if n == batch]
    wall, gpu = statistics.median(walls[3:]), statistics.median(gpu_ms[3:])
    out = {"geometry": name, "batch": batch, "temperature": temperature, "async_scheduling": llm.engine.async_scheduling,
           "async_steps": llm.engine.num_async_steps, "decode_steps": len(walls), "step_wall_ms": wall,
           "graph_gpu_ms": gpu, "cpu_overhead_fraction": (wall - gpu) / wall, "total_s": total_s,
           "output_tok_s": batch * output / total_s}
    log(out)
    graphs.run = orig  # break the graphs -> timed -> graphs cycle so the engine is freed before the next one
    del llm, graphs, orig, timed
    gc.collect()
    torch.cuda.empty_cache()
    return out


@section("tiny_greedy")
def tiny_greedy() -> dict:
    """The trained default model: greedy tokens of a mixed batch on the GPU (fp32, graphs) == on the CPU."""
    from tokenspeed import LLM, SamplingParams
    from tokenspeed.models.default_model import default_model_path

    prompts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "In 1905, Einstein", "Hello"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for dev, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        llm = LLM(default_model_path(), device=dev, dtype=dtype, max_num_seqs=8)
        outs[f"{dev}-{dtype}"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    ref = outs["cpu-float32"]
    res = {k: sum(a == b for a, b in zip(v, ref)) for k, v in outs.items()}
    out = {"prompts": len(prompts), "equal_to_cpu_fp32": res,
           "bf16_token_agreement": sum(x == y for a, b in zip(outs["cuda-bfloat16"], ref) for x, y in zip(a, b))
           / sum(len(a) for a in ref)}
    log(out)
    return out


@section("transformers")
def hf_reference(name: str, batches: list[int], prompt: int, new_tokens: int) -> dict:
    """transformers' KimiLinearForCausalLM.generate on the same geometry (random weights), decode tok/s."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenspeed.models.presets import preset_hf_config

    cfg_dict = preset_hf_config(name)
    cfg_dict.pop("architectures", None)
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    t = time.perf_counter()
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.eval()
    init_s = time.perf_counter() - t
    rows = []
    for b in batches:
        ids = torch.randint(0, config.vocab_size, (b, prompt), device="cuda")

        def gen(n, ids=ids, model=model):
            torch.cuda.synchronize()
            s = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - s

        gen(2)
        t1, tn = gen(1), gen(1 + new_tokens)
        decode_s = (tn - t1) / new_tokens
        rows.append({"batch": b, "decode_step_ms": decode_s * 1e3, "tok_s": b / decode_s, "prefill_s": t1})
        log(f"transformers {transformers.__version__} {name} batch {b}: {decode_s * 1e3:.1f} ms/step, "
            f"{b / decode_s:.1f} tok/s")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"geometry": name, "version": transformers.__version__, "init_s": init_s, "prompt": prompt,
            "new_tokens": new_tokens, "rows": rows}


@section("ours_short_ctx")
def ours_short(model, name: str, batches: list[int], ctx: int) -> dict:
    page_size = 64
    buf, pps = decode_setup(model, max(batches), max(ctx, page_size), page_size)
    graphs = DecodeGraphs(model, buf, max(batches), pps, scratch_page=max(batches) * pps)
    graphs.capture()
    rows = []
    for b in batches:
        fb = decode_batch(b, ctx, pps, page_size)
        ms = cuda_ms(lambda: graphs.run(fb))
        rows.append({"batch": b, "ctx": ctx, "step_ms": ms, "tok_s": b / ms * 1e3})
        log(f"ours {name} batch {b} ctx {ctx}: {ms:.3f} ms/step {b / ms * 1e3:.1f} tok/s")
    torch.cuda.empty_cache()  # the graphs and buffers are freed when this frame goes
    return {"geometry": name, "rows": rows}


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = RESULT["sections"].get("decode", [])
    if not runs:
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for ctx in sorted({r["ctx"] for r in run["rows"]}):
            rs = [r for r in run["rows"] if r["ctx"] == ctx]
            ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "o-", label=f"measured, ctx {ctx}")
            ax.plot([r["batch"] for r in rs], [r["batch"] / r["roofline_ms"] * 1e3 for r in rs], "--",
                    label=f"roofline, ctx {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode batch")
        ax.set_ylabel("output tok/s")
        kv = run.get("kv_cache_dtype", "auto")
        kv = "" if kv == "auto" else f", {kv} MLA cache"
        ax.set_title(f"{run['geometry']} decode on 1x H200 (bf16{kv}, CUDA graphs)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--geometries", default="kimi-linear-48b-a3b,k3-slice")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--routing-simulation", default="off", choices=ROUTING_SIMULATIONS,
                    help="uniform: MoE layers route as a balanced router would (`set_routing_simulation`; random "
                         "weights concentrate tokens on few experts); the decode sweep and the prefill only")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="comma list of auto / bfloat16 / fp8: the MLA latent cache of the decode sweep, one sweep "
                         "each in this process (fp8: e4m3, as `tokenspeed serve --kv-cache-dtype fp8` serves)")
    ap.add_argument("--decode-page-size", type=int, default=DECODE_PAGE_SIZE,
                    help="tokens per MLA cache page in the decode sweep (64: the earlier runs; the server uses 16)")
    args = ap.parse_args()
    globals()["DECODE_PAGE_SIZE"] = args.decode_page_size
    kv_dtypes = args.kv_cache_dtype.split(",")
    if any(d not in KV_DTYPES for d in kv_dtypes):
        ap.error(f"--kv-cache-dtype: each of {', '.join(KV_DTYPES)}; got {args.kv_cache_dtype!r}")
    skip = set(args.skip.split(","))
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    RESULT["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "python": platform.python_version(), "commit": os.environ.get("BENCH_COMMIT", "unknown"),
                     "argv": sys.argv, "routing_simulation": args.routing_simulation,
                     "kv_cache_dtype": args.kv_cache_dtype,
                     "date": time.strftime("%Y-%m-%d")}
    ceil = ceilings() or {}
    if "tiny" not in skip:
        tiny_greedy()
    for name in args.geometries.split(","):
        cfg, _ = resolve_config(name)
        t = time.perf_counter()
        model = load_model(name, torch.bfloat16, "cuda", load_format="dummy", seed=0)
        log(f"{name}: built + dummy-initialised in {time.perf_counter() - t:.1f} s, "
            f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        with torch.no_grad():
            if "parity" not in skip:
                parity(model, name)
            if "profile" not in skip:
                profile(model, name, [1, 64], 4096, args.prefill_tokens)
            if args.routing_simulation != "off":  # after the parity check, which compares the model's own outputs
                set_routing_simulation(model, args.routing_simulation)
            if "decode" not in skip:
                for kv in kv_dtypes:
                    decode_sweep(model, name, batches, contexts, kv)
            if "prefill" not in skip:
                prefill(model, name, args.prefill_tokens, ceil.get("matmul_bf16_tflops"))
            if "transformers" not in skip and cfg.attn_res_block_size is None:
                ours_short(model, name, [1, 16], 256)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        if "engine" not in skip and cfg.attn_res_block_size is None:
            engine_overhead(name, 64, 256, 64, "off")
            engine_overhead(name, 64, 256, 64, "auto")
            engine_overhead(name, 64, 256, 64, "auto", temperature=0.8)
        if "transformers" not in skip and cfg.attn_res_block_size is None:
            hf_reference(name, [1, 16], 128, 32)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serving_h200.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    plot(os.path.join(args.out, "serving_h200.png"))
    log(f"errors: {list(RESULT['errors'])}")


if __name__ == "__main__":
    main()
