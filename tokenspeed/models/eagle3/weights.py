"""Loading an EAGLE3-MLA draft: safetensors with the official names, dummy weights, and `load_eagle3_draft`.

Official names (no `model.` prefix; a prefixed checkpoint is accepted too): `fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight` (own head only), `d2t` (int64 [draft_vocab], target id = d + d2t[d]), optional
`embed_tokens.weight`. `t2d` (bool [vocab], the inverse map) is read by nobody and skipped, as vLLM and SGLang do.
Missing, unexpected and mis-shaped tensors are reported together (CheckpointError).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from tokenspeed.distributed import ParallelContext
from tokenspeed.errors import CheckpointError, ConfigError
from tokenspeed.models.eagle3.config import Eagle3Config, load_eagle3_config, parse_eagle3_config
from tokenspeed.models.eagle3.model import Eagle3Draft
from tokenspeed.models.eagle3.preset import EAGLE3_PRESETS, eagle3_preset_hf_config
from tokenspeed.models.kimi.model import KimiForCausalLM
from tokenspeed.models.weights import param_sources

from tokenspeed.models.weights import checkpoint_files  # noqa: E402

logger = logging.getLogger(__name__)

SKIPPED_TENSORS = ("t2d",)  # target -> draft mask: derivable from d2t, unused at inference
_OPTIONAL_PREFIX = "model."
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _our_name(name: str) -> str:
    """Checkpoint name -> our name: drop a leading `model.` (some trainers save the draft under it)."""
    return name.removeprefix(_OPTIONAL_PREFIX)


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """Tensor names of a draft checkpoint directory (normalised: without a `model.` prefix)."""
    names = set()
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(_our_name(k) for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    return names


def load_eagle3_weights(
    draft: Eagle3Draft, model_dir: str | Path, *, ignore: Iterable[str] = (), tp_rank: int = 0, tp_size: int = 1
) -> None:
    """Fill every parameter of `draft` from `model_dir` (mutates them). `ignore`: names present but not used.

    `d2t` may be absent when the draft vocab is the whole target vocab (identity). Raises CheckpointError naming
    every missing, unexpected and mis-shaped tensor.
    """
    model_dir = Path(model_dir)
    ignored = set(ignore) | set(SKIPPED_TENSORS)
    with ExitStack() as stack:
        handles = {}
        for path in checkpoint_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            handles.update({_our_name(k): (f, k) for k in f.keys()})  # noqa: SIM118
        sources = list(param_sources(draft, ""))
        wanted = {n for s in sources for n in s.hf_names}
        optional = {"d2t"} if draft.config.draft_vocab_size == draft.config.vocab_size else set()
        missing = sorted(wanted - handles.keys() - optional)
        unexpected = sorted(k for k in handles.keys() - wanted - ignored if not k.endswith("rotary_emb.inv_freq"))
        misshaped = []
        for src in sources:
            if any(n not in handles for n in src.hf_names):
                if src.hf_names == ("d2t",) and "d2t" in optional:
                    with torch.no_grad():
                        src.param.zero_()  # full vocab without a map: identity
                continue
            p = src.param
            pieces = []
            for n in src.hf_names:
                f, key = handles[n]
                t = f.get_tensor(key)
                if p.tp_shard_dim is not None and tp_size > 1:
                    if t.shape[p.tp_shard_dim] % tp_size:
                        misshaped.append(f"{n}: dim {p.tp_shard_dim} of {tuple(t.shape)} does not split {tp_size} ways")
                        break
                    t = t.chunk(tp_size, dim=p.tp_shard_dim)[tp_rank]
                pieces.append(t)
            else:
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
                if tuple(t.shape) != tuple(p.shape):
                    shown = src.hf_names[0] if len(src.hf_names) == 1 else f"{src.hf_names[0]} (+ combined)"
                    misshaped.append(f"{shown}: expected {tuple(p.shape)}, got {tuple(t.shape)}")
                    continue
                with torch.no_grad():
                    p.copy_(t.to(p.dtype))
    skipped = sorted(ignored & handles.keys())
    if skipped:
        logger.info("EAGLE3 draft %s: not loading %s", model_dir, ", ".join(skipped))
    if missing or unexpected or misshaped:
        lines = [f"EAGLE3 draft checkpoint {model_dir} does not match the model:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                lines.append(f"  {len(items)} {title}: " + "; ".join(items[:40]))
        raise CheckpointError("\n".join(lines))
    _check_d2t(draft)


def _check_d2t(draft: Eagle3Draft) -> None:
    if not draft.config.has_own_lm_head:
        return
    targets = torch.arange(draft.d2t.shape[0], device=draft.d2t.device) + draft.d2t
    if targets.numel() and (targets.min() < 0 or targets.max() >= draft.config.vocab_size):
        raise CheckpointError(f"d2t maps draft ids outside the target vocab 0..{draft.config.vocab_size - 1}")


def dummy_d2t(draft_vocab: int, vocab: int, generator: torch.Generator) -> Tensor:
    """A valid random map: a sorted random subset of `draft_vocab` target ids, stored as offsets (ids - arange)."""
    chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    return chosen - torch.arange(draft_vocab)


def init_dummy_eagle3_weights(draft: Eagle3Draft, seed: int = 0) -> None:
    """Deterministic random weights keeping activations O(1): linear ~ N(0, 1/fan_in) (o_proj/down_proj further
    / sqrt(2)), norm gains 1 + N(0, 0.1^2), embedding N(0, 1), and a valid random d2t. Each parameter draws from
    its own stream (seed, name), so a draft with or without its own embedding gets the same other weights."""
    with torch.no_grad():
        for name, p in draft.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name == "d2t":
                p.copy_(dummy_d2t(p.shape[0], draft.config.vocab_size, gen))
                continue
            leaf = name.rsplit(".", 2)[-2] if "." in name else name
            value = torch.randn(tuple(p.shape), generator=gen)
            if leaf == "embed_tokens":
                pass
            elif "norm" in leaf:
                value = 1.0 + 0.1 * value
            else:
                value = value / math.sqrt(p.shape[-1])
                if leaf in ("o_proj", "down_proj"):
                    value = value / math.sqrt(2.0)
            p.copy_(value.to(p.dtype))


def resolve_eagle3_config(model: str | Path) -> tuple[Eagle3Config, Path | None]:
    """(config, checkpoint dir or None) for a draft directory or a built-in draft preset name."""
    path = Path(model)
    if path.is_dir():
        return load_eagle3_config(path), path
    if str(model) in EAGLE3_PRESETS:
        return parse_eagle3_config(eagle3_preset_hf_config(str(model))), None
    raise ConfigError(
        f"EAGLE3 draft {str(model)!r} is neither a directory with config.json nor a built-in draft preset "
        f"({', '.join(sorted(EAGLE3_PRESETS))})"
    )


def load_eagle3_draft(
    model: str | Path,
    target: KimiForCausalLM | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    *,
    load_format: str = "auto",
    seed: int = 0,
    parallel: ParallelContext | None = None,
    share_target_embedding: bool = True,
) -> Eagle3Draft:
    """Build an EAGLE3 draft from a checkpoint directory or preset, fill its weights, and bind it to `target`.

    Embedding: the target's when `share_target_embedding` and the widths match (a checkpoint's own copy is then
    skipped, as SGLang does), else the checkpoint's `embed_tokens.weight`. lm_head: the draft's own when the
    config has `draft_vocab_size`, else the target's (a checkpoint's `lm_head.weight` is then skipped).
    Without a target, borrowed parts must be bound later with `draft.bind_target(target)`.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"unknown load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    config, model_dir = resolve_eagle3_config(model)
    if load_format == "auto":
        load_format = "dummy" if model_dir is None else "safetensors"
    if load_format == "safetensors" and model_dir is None:
        raise ConfigError(f"draft preset {model!r} has no weights; use load_format='dummy' or a checkpoint directory")
    can_share = target is not None and target.config.hidden_size == config.hidden_size
    share = share_target_embedding and can_share
    names = checkpoint_names(model_dir) if load_format == "safetensors" else set()
    if load_format == "safetensors":
        has_embed = "embed_tokens.weight" in names
        own_embedding = has_embed and not share
        if not has_embed and target is not None and not can_share:
            raise ConfigError(
                f"draft checkpoint {model_dir} has no embed_tokens.weight and the target's embedding (width "
                f"{target.config.hidden_size}) does not fit the draft (hidden {config.hidden_size})"
            )
    else:
        own_embedding = not share
    parallel = parallel or ParallelContext()
    draft = Eagle3Draft(config, parallel, dtype, device, own_embedding=own_embedding).eval()
    if load_format == "dummy":
        init_dummy_eagle3_weights(draft, seed)
    else:
        assert model_dir is not None
        ignore = set()
        if not own_embedding:
            ignore.add("embed_tokens.weight")
        if not config.has_own_lm_head:
            ignore.add("lm_head.weight")
        load_eagle3_weights(draft, model_dir, ignore=ignore, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size)
    if target is not None:
        draft.bind_target(target)
    logger.info("loaded EAGLE3 draft %s (%s, %s weights, embedding %s, lm_head %s)", model, dtype, load_format,
                "own" if own_embedding else "target's", "own" if config.has_own_lm_head else "target's")
    return draft
