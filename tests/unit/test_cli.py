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


def test_token_budgets_default_by_device_and_keep_what_the_user_set() -> None:
    """Unset budgets: 8K budget and chunk on a GPU (prefill near the matmul rate), 2048 / 512 on the CPU; a value
    the user gives is kept; a zero is refused with the flag's name."""
    from tokenspeed.config import EngineConfig
    from tokenspeed.errors import ConfigError

    cpu = EngineConfig.create(model="tiny-k3").scheduler
    assert (cpu.max_num_batched_tokens, cpu.chunked_prefill_size) == (2048, 512)
    gpu = EngineConfig.create(model="tiny-k3", device="cuda").scheduler
    assert (gpu.max_num_batched_tokens, gpu.chunked_prefill_size) == (8192, 8192)
    mine = EngineConfig.create(model="tiny-k3", device="cuda", max_num_batched_tokens=4096).scheduler
    assert (mine.max_num_batched_tokens, mine.chunked_prefill_size) == (4096, 4096)
    mine = EngineConfig.create(model="tiny-k3", max_num_batched_tokens=256).scheduler
    assert (mine.max_num_batched_tokens, mine.chunked_prefill_size) == (256, 256)
    with pytest.raises(ConfigError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=0)
