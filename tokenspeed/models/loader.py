"""Public entry points: build, load and write models, and a one-sequence logits helper."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from tokenspeed.distributed import ParallelContext
from tokenspeed.errors import ConfigError
from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.checkpoint import dtype_name, save_checkpoint
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.hf_config import load_hf_config, parse_hf_config, quantization_method
from tokenspeed.models.kimi.model import KimiForCausalLM
from tokenspeed.models.presets import PRESETS, preset_hf_config
from tokenspeed.models.weights import checkpoint_prefix, init_dummy_weights, load_safetensors

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def resolve_config(model: str | Path) -> tuple[KimiConfig, Path | None]:
    """(config, checkpoint dir or None) for a model directory or a built-in preset name."""
    path = Path(model)
    if path.is_dir():
        return load_hf_config(path), path
    if str(model) in PRESETS:
        return parse_hf_config(preset_hf_config(str(model))), None
    raise ConfigError(
        f"model {str(model)!r} is neither a directory with config.json nor a built-in preset "
        f"({', '.join(sorted(PRESETS))})"
    )


def load_model(
    model: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    *,
    load_format: str = "auto",
    seed: int = 0,
    parallel: ParallelContext | None = None,
) -> KimiForCausalLM:
    """Build the model of a checkpoint directory or preset and fill its weights.

    load_format: "safetensors" (from the directory), "dummy" (random, any geometry, deterministic in `seed`),
    "auto" (safetensors for a directory, dummy for a preset).
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"unknown load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    config, model_dir = resolve_config(model)
    if load_format == "auto":
        load_format = "dummy" if model_dir is None else "safetensors"
    if load_format == "safetensors" and model_dir is None:
        raise ConfigError(f"preset {model!r} has no weights; use load_format='dummy' or pass a checkpoint directory")
    parallel = parallel or ParallelContext()
    net = KimiForCausalLM(config, parallel, dtype, device).eval()
    if load_format == "dummy":
        init_dummy_weights(net, seed)
    else:
        assert model_dir is not None
        method = quantization_method(model_dir)
        if method is not None:
            raise ConfigError(
                f"quantized checkpoint ({method}) is not supported yet; use bf16 weights or load_format='dummy'"
            )
        load_safetensors(net, model_dir, checkpoint_prefix(config), parallel.tp_rank, parallel.tp_size)
    logger.info("loaded %s (%s, %s, %s weights)", model, config.model_type, dtype, load_format)
    return net


def write_tiny_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny-k3",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_shards: int = 1,
    overrides: dict | None = None,
) -> Path:
    """Write a random checkpoint of a preset (config.json + safetensors with the official names); `overrides`:
    top-level keys of the (text) config replaced first, e.g. a tiny model with the real MLA widths."""
    hf_config = preset_hf_config(preset)
    text = hf_config.get("text_config") or hf_config
    text.update(overrides or {})
    text["torch_dtype"] = dtype_name(dtype)
    net = KimiForCausalLM(parse_hf_config(hf_config), dtype=dtype)
    init_dummy_weights(net, seed)
    return save_checkpoint(net, hf_config, out_dir, checkpoint_prefix(net.config), num_shards)


def forward_logits(model: KimiForCausalLM, token_ids: Sequence[int] | Tensor, page_size: int = 16) -> Tensor:
    """Logits [T, vocab] fp32 of one sequence from an empty cache (no engine; for validation and tests)."""
    ids = token_ids.tolist() if isinstance(token_ids, Tensor) else list(token_ids)
    num_pages = max(1, -(-len(ids) // page_size))
    cache = CacheBuffers.allocate(model.config, num_pages, page_size, 1, model.dtype, model.device,
                                  tp_size=model.parallel.tp_size)
    batch = ForwardBatch.build([ids], [0], [list(range(num_pages))], [0], page_size, model.device)
    with torch.no_grad():
        return model(batch, cache)
