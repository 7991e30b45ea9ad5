"""Engine configuration: frozen dataclasses, each field declared once with its help text.

`EngineConfig` composes `ModelConfig`, `CacheConfig` and `SchedulerConfig`. Validation raises `ConfigError` with
a fix-it message. The CLI (issue: serve) generates its flags from the `help` metadata of these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tokenspeed.errors import ConfigError


def opt(default: Any, help: str) -> Any:  # noqa: A002 - the field's help text
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("tiny-k3", "model directory (HF config.json + safetensors) or built-in preset")
    dtype: str = opt("auto", "weights/activations: auto (float32 on CPU, bfloat16 on GPU), bfloat16, float32")
    device: str = opt("cpu", "torch device: cpu or cuda")
    load_format: str = opt("auto", "auto | safetensors | dummy (random weights of the model's geometry)")
    seed: int = opt(0, "seed of dummy weights and of unseeded sampling")
    max_model_len: int | None = opt(None, "longest prompt + output in tokens (default: the model's maximum)")

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ConfigError(f"dtype {self.dtype!r}: choose auto, bfloat16, float32 or float16")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"load_format {self.load_format!r}: choose auto, safetensors or dummy")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be at least 2")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = opt(16, "tokens per MLA cache page (and the granularity of prefix matching)")
    kv_cache_dtype: str = opt("auto", "MLA latent cache: auto (the model dtype), bfloat16, float32 or fp8 (e4m3)")
    cache_memory_gb: float = opt(0.5, "CPU: bytes for the MLA pages and KDA state slots (GiB)")
    gpu_memory_utilization: float = opt(0.9, "GPU: fraction of device memory for weights + cache")
    enable_prefix_caching: bool = opt(True, "reuse cached pages and KDA checkpoints across requests")
    num_checkpoint_slots: int | None = opt(None, "KDA state checkpoints kept (default: 2 per max_num_seqs)")
    checkpoint_chunk_ends: bool = opt(False, "also checkpoint at prefill chunk ends that are page boundaries")
    num_pages: int | None = opt(None, "fix the number of MLA pages instead of sizing from the budget (testing)")

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError("page_size must be >= 1")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3"):
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r}: choose auto, bfloat16, float32 or fp8")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.cache_memory_gb <= 0:
            raise ConfigError("cache_memory_gb must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "most requests running at once")
    max_num_batched_tokens: int = opt(2048, "token budget of one step (prefill chunks + decodes)")
    chunked_prefill_size: int = opt(512, "most prompt tokens of one request in one step")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ConfigError(f"{f.name} must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def create(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (model=..., page_size=..., max_num_seqs=...)."""
        groups: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {f.name: g for g, c in (("model", ModelConfig), ("cache", CacheConfig),
                                         ("scheduler", SchedulerConfig)) for f in fields(c)}
        for key, value in kwargs.items():
            if key not in owners:
                raise ConfigError(f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}")
            groups[owners[key]][key] = value
        return cls(ModelConfig(**groups["model"]), CacheConfig(**groups["cache"]),
                   SchedulerConfig(**groups["scheduler"]))
