"""Write an EAGLE3-MLA draft as an HF checkpoint directory (config.json + safetensors with the official names).

The inverse of `eagle3.weights.load_eagle3_weights`; used to make random tiny drafts for tests and examples.
Like the public EAGLE3 checkpoints it also writes `t2d` (bool [vocab]: target ids the draft vocab covers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tokenspeed.models.checkpoint import checkpoint_tensors, dtype_name, write_checkpoint_dir
from tokenspeed.models.eagle3.config import parse_eagle3_config
from tokenspeed.models.eagle3.model import Eagle3Draft
from tokenspeed.models.eagle3.preset import eagle3_preset_hf_config
from tokenspeed.models.eagle3.weights import init_dummy_eagle3_weights


def eagle3_checkpoint_tensors(draft: Eagle3Draft, *, write_t2d: bool = True) -> dict[str, Tensor]:
    """{official name: tensor} of a draft (world size 1), plus `t2d` when the draft has its own vocab."""
    tensors = checkpoint_tensors(draft, "")
    if write_t2d and draft.config.has_own_lm_head:
        t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
        t2d[draft.to_target_ids(torch.arange(draft.d2t.shape[0], device=draft.d2t.device)).cpu()] = True
        tensors["t2d"] = t2d
    return tensors


def save_eagle3_checkpoint(
    draft: Eagle3Draft, hf_config: dict[str, Any], out_dir: str | Path, num_shards: int = 1, *, write_t2d: bool = True
) -> Path:
    """Write config.json and model.safetensors (or N shards + model.safetensors.index.json) to out_dir."""
    return write_checkpoint_dir(eagle3_checkpoint_tensors(draft, write_t2d=write_t2d), hf_config, out_dir,
                                num_shards)


def write_tiny_eagle3_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny-eagle3",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_shards: int = 1,
    *,
    with_embedding: bool = True,
) -> Path:
    """Write a random draft checkpoint of a preset. with_embedding: include `embed_tokens.weight` (some public
    drafts do, others rely on the target's)."""
    hf_config = eagle3_preset_hf_config(preset)
    hf_config["torch_dtype"] = dtype_name(dtype)
    draft = Eagle3Draft(parse_eagle3_config(hf_config), dtype=dtype, own_embedding=with_embedding)
    init_dummy_eagle3_weights(draft, seed)
    return save_eagle3_checkpoint(draft, hf_config, out_dir, num_shards)
