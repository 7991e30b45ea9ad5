"""Kimi K3 / Kimi Linear models: config, presets, the model, weight loading, and validation helpers."""

from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.hf_config import load_hf_config, parse_hf_config
from tokenspeed.models.kimi.model import KimiForCausalLM
from tokenspeed.models.loader import forward_logits, load_model, resolve_config, write_tiny_checkpoint
from tokenspeed.models.presets import PRESETS, preset_hf_config

__all__ = [
    "PRESETS",
    "CacheBuffers",
    "ForwardBatch",
    "KimiConfig",
    "KimiForCausalLM",
    "forward_logits",
    "load_hf_config",
    "load_model",
    "parse_hf_config",
    "preset_hf_config",
    "resolve_config",
    "write_tiny_checkpoint",
]
