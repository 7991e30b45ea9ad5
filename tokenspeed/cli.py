"""The `tokenspeed` command line.

Subcommands available today:
  inspect MODEL            config summary, layer layout and parameter counts of a directory or preset
  generate MODEL           greedy continuation of token ids through the engine-style forward (prefill + decode)
  write-checkpoint DIR     write a random checkpoint of a preset (config.json + safetensors, official names)
`serve`, `bench` and `plan` are recognised and say that they are not available yet.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import torch

from tokenspeed.errors import CheckpointError, ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
NOT_YET = {
    "serve": "the OpenAI-compatible server",
    "bench": "the agentic benchmark client",
    "plan": "the memory and capacity planner",
}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HF-style model directory or a built-in preset (tiny-k3, tiny-kimi-linear, ...)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="activation/weight dtype")
    p.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                   help="auto: safetensors for a directory, dummy (random) for a preset")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")


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
    for name, what in NOT_YET.items():
        sub.add_parser(name, help=f"{what} (not available yet)", add_help=False).add_argument(
            "rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
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
