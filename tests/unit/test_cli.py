"""The `tokenspeed` command line: serve flags come from the config dataclasses; refused flags say so."""

from __future__ import annotations

import dataclasses

import pytest

from tokenspeed.cli import build_parser, main
from tokenspeed.cli_config import config_from_args
from tokenspeed.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig


def test_every_config_field_is_a_serve_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "tiny-k3", "--max-num-seqs", "7", "--no-enable-prefix-caching",
                              "--kv-cache-dtype", "fp8", "--port", "9001", "--served-model-name", "x"])
    assert config_from_args(SchedulerConfig, args).max_num_seqs == 7
    cache = config_from_args(CacheConfig, args)
    assert cache.enable_prefix_caching is False and cache.kv_cache_dtype == "fp8"
    assert config_from_args(ServerConfig, args).port == 9001
    assert config_from_args(ModelConfig, args, model=args.model).model == "tiny-k3"
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for cls in (CacheConfig, SchedulerConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in help_text
    for group in ("model:", "cache:", "scheduler:", "parallelism:", "speculative decoding:", "server:"):
        assert group in help_text


@pytest.mark.parametrize("flags, message", [
    (["--attn-tp-size", "2"], "not supported yet"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-draft-model-path"),
    (["--speculative-force-accept-length", "2"], "needs --speculative-algorithm"),
    (["--page-size", "0"], "page_size"),
])
def test_refused_flags_exit_2_with_a_message(flags, message, capsys) -> None:
    assert main(["serve", "tiny-k3", *flags]) == 2
    assert message in capsys.readouterr().err


def test_inspect_full_k3_costs_no_memory(capsys) -> None:
    assert main(["inspect", "kimi-k3"]) == 0
    assert "2,779,484,476,000" in capsys.readouterr().out
