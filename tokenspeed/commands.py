"""Implementations of the `tokenspeed` subcommands (argument parsing lives in `cli.py`)."""

from __future__ import annotations

import argparse
import time

import torch

from tokenspeed.models import (
    CacheBuffers,
    ForwardBatch,
    KimiForCausalLM,
    load_model,
    resolve_config,
    write_tiny_checkpoint,
)


def _load(args: argparse.Namespace):
    from tokenspeed.cli import DTYPES

    return load_model(args.model, DTYPES[args.dtype], args.device, load_format=args.load_format, seed=args.seed)


def inspect(args: argparse.Namespace) -> int:
    """Summarise a model; built on the meta device, so even the full K3 geometry costs no memory."""
    from tokenspeed.cli import DTYPES

    config, _ = resolve_config(args.model)
    model = KimiForCausalLM(config, dtype=DTYPES[args.dtype], device="meta")
    c = model.config
    kinds = "".join("M" if c.is_mla_layer(i) else "k" for i in range(c.num_hidden_layers))
    total = sum(p.numel() for p in model.parameters())
    print(f"model_type={c.model_type} hidden={c.hidden_size} layers={c.num_hidden_layers} vocab={c.vocab_size}")
    print(f"layers (k=KDA, M=MLA): {kinds}")
    print(f"KDA heads={c.kda_num_heads}x{c.kda_head_dim} gate_lower_bound={c.gate_lower_bound} "
          f"full_rank_gate={c.use_full_rank_gate}")
    print(f"MLA heads={c.num_attention_heads} q_lora={c.q_lora_rank} kv_lora={c.kv_lora_rank} "
          f"nope={c.mla_use_nope} output_gate={c.mla_use_output_gate}")
    print(f"MoE experts={c.num_experts} top_k={c.num_experts_per_token} latent={c.routed_expert_hidden_size} "
          f"act={c.hidden_act} attn_res_block={c.attn_res_block_size}")
    print(f"parameters: {total:,}")
    return 0


def generate(args: argparse.Namespace) -> int:
    """Greedy decoding through the engine-style forward: one prefill, then one token per step from the cache."""
    model = _load(args)
    prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    page = 16
    total = len(prompt) + args.max_tokens
    pages = list(range(-(-total // page)))
    cache = CacheBuffers.allocate(model.config, len(pages), page, 1, model.dtype, args.device)
    out: list[int] = []
    step_tokens, cached = prompt, 0
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(args.max_tokens):
            batch = ForwardBatch.build([step_tokens], [cached], [pages], [0], page, args.device)
            logits = model(batch, cache, logits_indices=torch.tensor([len(step_tokens) - 1]))
            cached += len(step_tokens)
            step_tokens = [int(logits[0].argmax())]
            out.append(step_tokens[0])
    elapsed = time.perf_counter() - start
    print(",".join(map(str, out)))
    print(f"# {len(out)} tokens in {elapsed:.2f}s", flush=True)
    return 0


def write_checkpoint(args: argparse.Namespace) -> int:
    from tokenspeed.cli import DTYPES

    path = write_tiny_checkpoint(args.out_dir, args.preset, DTYPES[args.dtype], args.seed, args.num_shards)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """Print the per-GPU memory and capacity plan (config arithmetic only: no model is built)."""
    from tokenspeed.plan import ParallelLayout, PlanOptions, WeightPrecision, render_json, render_table
    from tokenspeed.plan import plan as make_plan

    config, _ = resolve_config(args.model)
    layout = ParallelLayout.resolve(
        args.attn_tp, args.attn_dp, args.moe_tp, args.moe_ep, tp_subgroup=args.tp_subgroup,
        subgroup_shards=tuple(s.strip() for s in args.tp_subgroup_shards.split(",") if s.strip()),
        latent_shard=args.latent_shard,
    )
    options = PlanOptions(
        layout=layout, precision=WeightPrecision.parse(args.weights_dtype), gpu_memory_gb=args.gpu_memory_gb,
        activation_gb=args.activation_gb, kv_cache_dtype=args.kv_cache_dtype, kda_state_dtype=args.kda_state_dtype,
        kda_copies=args.kda_copies, draft=None if args.draft == "none" else args.draft,
        spec_positions=args.spec_positions, max_num_seqs=args.max_num_seqs, context=args.context,
        page_size=args.page_size, verify_mode=args.verify_mode, local_tokens=args.local_tokens,
        reserve_verify_workspace=not args.verify_in_activation,
    )
    result = make_plan(config, options, model=args.model)
    print(render_json(result) if args.format == "json" else render_table(result))
    return 0


def serve(args: argparse.Namespace) -> int:
    from tokenspeed.server.serve import serve as run

    return run(args)
