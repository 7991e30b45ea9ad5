"""The built-in default model: kimi-k3-mini, a small Kimi-K3-architecture model trained by the project.

Every K3 feature at a few million parameters (KDA and gated NoPE MLA layers, LatentMoE with SiTU and a shared
expert, Block AttnRes), a byte-level BPE tokenizer with the K3 special tokens and the K3 chat template, trained
on the Python standard library's source. Recipe, sizes and held-out perplexity: docs/default-model.md;
scripts: scripts/default_model/. The directory is an ordinary HF-style model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja) plus
eval.json, the training-time held-out numbers the engine must reproduce.
"""

from __future__ import annotations

from pathlib import Path

from tokenspeed.errors import ConfigError

DEFAULT_MODEL_NAME = "kimi-k3-mini"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / DEFAULT_MODEL_NAME


def default_model_path() -> str:
    """The default model's directory, for `LLM(...)`, `load_model(...)` and `tokenspeed serve`.

    Raises ConfigError if the package was installed without its assets (see docs/default-model.md).
    """
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json")
               if not (DEFAULT_MODEL_DIR / f).is_file()]
    if missing:
        raise ConfigError(
            f"the built-in default model is incomplete: {', '.join(missing)} missing from {DEFAULT_MODEL_DIR}; "
            "reinstall tokenspeed with its package data, or pass a model directory or preset explicitly"
        )
    return str(DEFAULT_MODEL_DIR)
