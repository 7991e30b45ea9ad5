"""TokenSpeed: an inference and serving engine for the Kimi K3 model family."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:  # lazy: `import tokenspeed.ops` must not load the engine
    if name == "LLM":
        from tokenspeed.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenspeed.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
