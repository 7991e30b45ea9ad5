"""Write a model's weights as an HF checkpoint directory (config.json + safetensors with the official names).

Used to make random tiny checkpoints for tests and examples; the inverse of `weights.load_safetensors`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from tokenspeed.models.weights import param_sources


def checkpoint_tensors(model: nn.Module, prefix: str) -> dict[str, Tensor]:
    """Every parameter split back into its checkpoint tensors {hf_name: tensor} (world size 1 only): stacked
    sources unbound, concatenated ones split by `hf_split_sizes` (equal pieces without it), then untransformed."""
    out: dict[str, Tensor] = {}
    for src in param_sources(model, prefix):
        p, data = src.param, src.param.detach()
        if p.hf_stack:
            pieces = data.unbind(0)
        elif getattr(p, "hf_split_sizes", None) is not None:
            pieces = data.split(list(p.hf_split_sizes), dim=0)
        else:
            pieces = data.chunk(len(src.hf_names), dim=0) if len(src.hf_names) > 1 else (data,)
        for name, piece in zip(src.hf_names, pieces, strict=True):
            if p.hf_untransform is not None:
                piece = p.hf_untransform(piece)
            out[name] = piece.contiguous().clone()
    return out


def save_checkpoint(
    model: nn.Module, hf_config: dict[str, Any], out_dir: str | Path, prefix: str, num_shards: int = 1
) -> Path:
    """Write config.json and model.safetensors (or N shards + model.safetensors.index.json) to out_dir."""
    return write_checkpoint_dir(checkpoint_tensors(model, prefix), hf_config, out_dir, num_shards)


def write_checkpoint_dir(
    tensors: dict[str, Tensor], hf_config: dict[str, Any], out_dir: str | Path, num_shards: int = 1
) -> Path:
    """Write `tensors` {hf_name: tensor} and config.json as an HF checkpoint directory (sharded with an index
    when num_shards > 1)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    if num_shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return out_dir
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
