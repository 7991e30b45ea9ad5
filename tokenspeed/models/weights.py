"""Weight loading from HF safetensors checkpoints (single file or sharded), and dummy (random) weights.

Each parameter knows its checkpoint sources (see `tokenspeed.models.layers.weight`); this module resolves them,
applies transforms and the tensor-parallel shard, checks shapes, and reports every missing, unexpected and
mis-shaped tensor at once. fp32 islands stay fp32 because their parameters are created fp32.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from tokenspeed.errors import CheckpointError
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.layers import source_shard_dim

logger = logging.getLogger(__name__)

# Checkpoint tensors a text-only engine does not use (skipped and logged, not "unexpected").
_SKIPPED = re.compile(r"^(vision_tower\.|mm_projector\.|multi_modal_projector\.)|rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class ParamSource:
    """Where one parameter comes from: its checkpoint names and how they combine."""

    param_name: str
    param: nn.Parameter
    hf_names: tuple[str, ...]


def checkpoint_prefix(config: KimiConfig) -> str:
    """`language_model.` for a full kimi_k3 checkpoint, nothing for kimi_linear."""
    return "language_model." if config.model_type == "kimi_k3" else ""


def param_sources(model: nn.Module, prefix: str) -> Iterator[ParamSource]:
    """Every parameter (shared ones once) with its full checkpoint names."""
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0]
        for _ in range(getattr(param, "hf_scope_up", 0)):
            owner = owner.rpartition(".")[0]
        rel = getattr(param, "hf_sources", None)
        names = tuple(f"{prefix}{owner}.{s}" if owner else f"{prefix}{s}" for s in rel) if rel else (prefix + name,)
        yield ParamSource(name, param, names)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (from its index when sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def _assemble(src: ParamSource, read, tp_rank: int, tp_size: int) -> Tensor:
    """Read, transform, shard (each source by its own `source_shard_dim`) and combine the sources of one parameter.
    Raises ValueError when a piece's rows differ from the parameter's `hf_split_sizes` entry for it."""
    p = src.param
    sizes = getattr(p, "hf_split_sizes", None)
    pieces = []
    for i, name in enumerate(src.hf_names):
        t = read(name)
        if p.hf_transform is not None:
            t = p.hf_transform(t)
        dim = source_shard_dim(p, i)
        if dim is not None and tp_size > 1:
            t = t.chunk(tp_size, dim=dim)[tp_rank]
        if sizes is not None and t.shape[0] != sizes[i]:
            raise ValueError(f"{name} gives {t.shape[0]} rows {tuple(t.shape)}, expected {sizes[i]}")
        pieces.append(t)
    if len(pieces) == 1 and not p.hf_stack:
        return pieces[0]
    return torch.stack(pieces) if p.hf_stack else torch.cat(pieces, dim=0)


def load_safetensors(model: nn.Module, model_dir: str | Path, prefix: str, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir` (mutates the parameters).

    Raises CheckpointError naming all missing, unexpected and mis-shaped tensors.
    """
    model_dir = Path(model_dir)
    with ExitStack() as stack:
        handles = {}
        for path in checkpoint_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            handles.update({key: f for key in f.keys()})
        sources = list(param_sources(model, prefix))
        wanted = {n for s in sources for n in s.hf_names}
        missing = sorted(wanted - handles.keys())
        skipped = sorted(k for k in handles if k not in wanted and _SKIPPED.search(k))
        unexpected = sorted(handles.keys() - wanted - set(skipped))
        misshaped = []
        for src in sources:
            if any(n not in handles for n in src.hf_names):
                continue
            try:
                t = _assemble(src, lambda n: handles[n].get_tensor(n), tp_rank, tp_size)
            except (RuntimeError, ValueError) as e:
                misshaped.append(f"{', '.join(src.hf_names[:2])}: {e}")
                continue
            if tuple(t.shape) != tuple(src.param.shape):
                misshaped.append(f"{_names(src)}: expected {tuple(src.param.shape)}, got {tuple(t.shape)}")
                continue
            with torch.no_grad():
                src.param.copy_(t.to(src.param.dtype))
    if skipped:
        logger.info("skipped %d checkpoint tensors of the vision tower / projector", len(skipped))
    if missing or unexpected or misshaped:
        raise CheckpointError(_report(model_dir, missing, unexpected, misshaped))


def _names(src: ParamSource) -> str:
    n = src.hf_names
    return n[0] if len(n) == 1 else f"{n[0]} (+{len(n) - 1} combined)"


def _report(model_dir: Path, missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    lines = [f"checkpoint {model_dir} does not match the model:"]
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if items:
            shown = items[:40] + ([f"... and {len(items) - 40} more"] if len(items) > 40 else [])
            lines.append(f"  {len(items)} {title}: " + "; ".join(shown))
    return "\n".join(lines)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights scaled so activations stay O(1) at any geometry (mutates the parameters).

    Linear weights ~ N(0, 1/fan_in), residual-output projections further / sqrt(2 * layers), so the random network
    behaves like a trained one (each sublayer nudges the stream) rather than a chaotic one; norm gains
    ~ 1 + N(0, 0.1^2); KDA A_log / dt_bias in their trained ranges. Values are drawn on the parameters' device
    (a 98 GB geometry initialises in seconds on a GPU), so the same seed gives different weights on CPU and GPU.
    """
    gens: dict[torch.device, torch.Generator] = {}
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = gens.get(p.device) or gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
            value = _dummy_value(name, tuple(p.shape), gen)
            if name.rsplit(".", 2)[-2] in _RESIDUAL_OUTPUTS or name.endswith(".w2"):
                value = value / math.sqrt(2 * num_layers)  # sublayer outputs small against the stream
            p.copy_(value.to(p.dtype))


# Projections whose output is added to the residual stream (scaled by 1/sqrt(2 * layers), as GPT-2 initialises).
_RESIDUAL_OUTPUTS = {"o_proj", "down_proj", "routed_expert_up_proj"}


def _dummy_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    dev = gen.device
    randn = torch.randn(shape, generator=gen, device=dev)
    if leaf == "A_log":
        return torch.log(torch.empty(shape, device=dev).uniform_(1.0, 16.0, generator=gen))
    if leaf == "dt_bias":
        dt = torch.exp(torch.empty(shape, device=dev).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf == "e_score_correction_bias":
        return 0.1 * randn
    if leaf == "embed_tokens":
        return randn
    if "norm" in leaf:
        return 1.0 + 0.1 * randn
    if leaf == "conv_weight":
        return 0.5 * randn
    return randn / math.sqrt(shape[-1])
