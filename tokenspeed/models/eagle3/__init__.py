"""EAGLE3-MLA draft model for speculative decoding (k3-architecture.md section 4.2): config, model, loading,
presets and a checkpoint writer. See docs/eagle3.md for how the engine drives it."""

from tokenspeed.models.eagle3.checkpoint import (
    eagle3_checkpoint_tensors,
    save_eagle3_checkpoint,
    write_tiny_eagle3_checkpoint,
)
from tokenspeed.models.eagle3.config import Eagle3Config, load_eagle3_config, parse_eagle3_config
from tokenspeed.models.eagle3.model import Eagle3Draft, mla_kimi_config
from tokenspeed.models.eagle3.preset import EAGLE3_PRESETS, eagle3_preset_hf_config
from tokenspeed.models.eagle3.weights import (
    init_dummy_eagle3_weights,
    load_eagle3_draft,
    load_eagle3_weights,
    resolve_eagle3_config,
)

__all__ = [
    "EAGLE3_PRESETS",
    "Eagle3Config",
    "Eagle3Draft",
    "eagle3_checkpoint_tensors",
    "eagle3_preset_hf_config",
    "init_dummy_eagle3_weights",
    "load_eagle3_config",
    "load_eagle3_draft",
    "load_eagle3_weights",
    "mla_kimi_config",
    "parse_eagle3_config",
    "resolve_eagle3_config",
    "save_eagle3_checkpoint",
    "write_tiny_eagle3_checkpoint",
]
