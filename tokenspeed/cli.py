"""The `tokenspeed` command line.

Subcommands available today:
  inspect MODEL            config summary, layer layout and parameter counts of a directory or preset
  generate MODEL           greedy continuation of token ids through the engine-style forward (prefill + decode)
  write-checkpoint DIR     write a random checkpoint of a preset (config.json + safetensors, official names)
  plan --model MODEL       memory and capacity plan per GPU: weights, cache, KDA state, requests that fit, comm
  serve [MODEL]            the OpenAI-compatible server
  bench                    agentic benchmark client against any OpenAI-compatible server
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from tokenspeed.errors import CheckpointError, ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
NOT_YET: dict[str, str] = {}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HF-style model directory or a built-in preset (tiny-k3, tiny-kimi-linear, ...)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="activation/weight dtype")
    p.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                   help="auto: safetensors for a directory, dummy (random) for a preset")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")


def _add_plan_parser(sub) -> None:
    from tokenspeed.plan.layout import LATENT_SHARD_CHOICES, SUBGROUP_COMPONENTS
    from tokenspeed.plan.planner import VERIFY_MODES

    p = sub.add_parser("plan", help="memory and capacity plan per GPU (no weights needed)",
                       description="Bytes per GPU for weights, cache and KDA state under a parallel layout; "
                                   "requests of a given context that fit; per-layer TP vs EP communication.")
    p.add_argument("--model", required=True, help="HF-style config directory or a preset (kimi-k3, ...)")
    p.add_argument("--gpu-memory-gb", type=float, default=288.0, help="memory of one GPU in GB (1e9 bytes)")
    p.add_argument("--attn-tp", type=int, help="attention tensor-parallel size (default 1)")
    p.add_argument("--attn-dp", type=int, help="attention data-parallel size (default: world / attn-tp)")
    p.add_argument("--moe-tp", type=int, help="routed-expert tensor-parallel size (default: attn-tp)")
    p.add_argument("--moe-ep", type=int, help="routed-expert expert-parallel size (default: attn-dp)")
    p.add_argument("--tp-subgroup", type=int, default=1, help="TP subgroup size inside attention DP (DEP's TP4)")
    p.add_argument("--tp-subgroup-shards", default="attention,shared_experts",
                   help=f"components a TP subgroup shards, comma-separated from {','.join(SUBGROUP_COMPONENTS)}")
    p.add_argument("--latent-shard", choices=LATENT_SHARD_CHOICES, default="both",
                   help="routed latent projections sharded over attention TP")
    p.add_argument("--weights-dtype", default="bf16",
                   help="preset bf16|nvfp4|mxfp4|fp8 and/or COMPONENT=FORMAT overrides, e.g. nvfp4,shared=fp8 "
                        "(components: routed_experts, attention, shared_experts, latent, router, dense_mlp, "
                        "embeddings; formats: nvfp4, mxfp4, fp8, bf16)")
    p.add_argument("--kv-cache-dtype", choices=["fp8", "bf16"], default="bf16")
    p.add_argument("--kda-state-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the KDA recurrent state (live state and checkpoints)")
    p.add_argument("--kda-copies", type=int, default=2, help="KDA state copies kept per request (live + checkpoint)")
    p.add_argument("--draft", choices=["eagle3", "none"], default="none", help="speculative draft model")
    p.add_argument("--spec-positions", type=int, default=4, help="tokens verified per request per step (with --draft)")
    p.add_argument("--verify-mode", choices=VERIFY_MODES, default="replay", help="KDA verify: replay or snapshots")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together per GPU")
    p.add_argument("--context", type=int, default=200_000, help="tokens per request for 'requests that fit'")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--activation-gb", type=float, default=40.0, help="reserve for activations, graphs, workspace")
    p.add_argument("--verify-in-activation", action="store_true",
                   help="the activation reserve already covers the KDA verify workspace (the seeds' accounting)")
    p.add_argument("--local-tokens", type=int, help="tokens per GPU per forward for the comm estimate "
                                                     "(default: max-num-seqs x verified positions)")
    p.add_argument("--format", choices=["table", "json"], default="table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenspeed", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show a model's config, layer layout and parameter counts")
    _add_model_args(p)
    p = sub.add_parser("generate", help="greedy continuation of token ids (no tokenizer yet)")
    _add_model_args(p)
    p.add_argument("--prompt-ids", default="1,2,3,4", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=16, help="number of tokens to generate")
    p = sub.add_parser("write-checkpoint", help="write a random checkpoint of a preset")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="tiny-k3")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    _add_plan_parser(sub)
    from tokenspeed.server.serve import add_serve_parser

    add_serve_parser(sub)
    from tokenspeed.bench.cli import add_bench_parser

    add_bench_parser(sub)
    for name, what in NOT_YET.items():
        sub.add_parser(name, help=f"{what} (not available yet)", add_help=False).add_argument(
            "rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=(args.log_level or "warning").upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        from tokenspeed.bench.cli import run_bench

        return run_bench(args)
    if args.command in NOT_YET:
        print(f"tokenspeed {args.command}: {NOT_YET[args.command]} is not available in this version yet.",
              file=sys.stderr)
        return 2
    try:
        from tokenspeed import commands

        return getattr(commands, args.command.replace("-", "_"))(args)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
