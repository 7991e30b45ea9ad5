"""Engine configuration: frozen dataclasses, each field declared once with its help text.

`EngineConfig` composes `ModelConfig`, `CacheConfig` and `SchedulerConfig`. Validation raises `ConfigError` with
a fix-it message. The CLI (issue: serve) generates its flags from the `help` metadata of these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
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
    enforce_eager: bool = opt(False, "GPU: run decode steps eagerly instead of replaying captured CUDA graphs")
    cuda_graph_max_bs: int | None = opt(None, "GPU: largest decode batch captured as a CUDA graph "
                                              "(default: max_num_seqs)")
    moe_routing_simulation: str = opt(
        "off", "benchmarks with dummy weights: 'uniform' replaces each token's routed experts by k drawn as a "
               "balanced router spreads them (random weights send similar tokens to the same few experts, which "
               "understates MoE cost); changes the outputs")

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError("cuda_graph_max_bs must be at least 1 (use --enforce-eager to disable graphs)")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ConfigError(f"dtype {self.dtype!r}: choose auto, bfloat16, float32 or float16")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"load_format {self.load_format!r}: choose auto, safetensors or dummy")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be at least 2")
        if self.moe_routing_simulation not in ("off", "uniform"):
            raise ConfigError(f"moe_routing_simulation {self.moe_routing_simulation!r}: choose off or uniform")


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
    max_num_batched_tokens: int | None = opt(None, "token budget of one step (prefill chunks + decodes); default "
                                                   "8192 on a GPU, 2048 on the CPU")
    chunked_prefill_size: int | None = opt(None, "most prompt tokens of one request in one step; default 8192 on "
                                                 "a GPU, 512 on the CPU")
    prefill_chunk_beside_decodes: int | None = opt(
        None, "most prompt tokens of one request in a step where other requests decode (a shorter step bounds "
              "their inter-token latency; the prompt then takes more steps); default: chunked_prefill_size")
    async_scheduling: str = opt("auto", "launch step N+1 before reading step N's tokens, so the host work "
                                        "overlaps the GPU's: auto (on with CUDA graphs and no speculation), on, off")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in (int, "int", "int | None") and value is not None and value < 1:
                raise ConfigError(f"{f.name} must be >= 1")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"async_scheduling {self.async_scheduling!r}: choose auto, on or off")

    def for_device(self, device: str) -> SchedulerConfig:
        """This config with the unset token budgets filled in for `device`: on a GPU an 8K-token budget and
        chunk (a prefill chunk is long enough to run near the matmul rate, and a 10K-token prompt takes 2 steps,
        not 20); on the CPU 2048 / 512 (a step stays short)."""
        gpu = str(device).startswith("cuda")
        budget = self.max_num_batched_tokens or (8192 if gpu else 2048)
        chunk = self.chunked_prefill_size or (budget if gpu else min(512, budget))
        return replace(self, max_num_batched_tokens=budget, chunked_prefill_size=chunk)


NOT_YET = "not supported yet"  # help marker of a recognised flag whose non-default value is refused


@dataclass(frozen=True)
class ParallelConfig:
    attn_tp_size: int = opt(1, f"attention tensor-parallel size ({NOT_YET}: 1 only)")
    moe_tp_size: int = opt(1, f"routed-expert tensor-parallel size ({NOT_YET}: 1 only)")
    moe_ep_size: int = opt(1, f"routed-expert expert-parallel size ({NOT_YET}: 1 only)")
    attn_dp_size: int = opt(1, f"attention data-parallel size ({NOT_YET}: 1 only)")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) != 1:
                raise ConfigError(f"--{f.name.replace('_', '-')} {getattr(self, f.name)}: multi-GPU parallelism is "
                                  f"{NOT_YET} in `serve`; use 1")


SPEC_ALGORITHMS = ("eagle3", "ngram", "repeat")


@dataclass(frozen=True)
class SpecConfig:
    speculative_algorithm: str | None = opt(
        None, "EAGLE3 (with --speculative-draft-model-path), ngram (prompt lookup), or repeat (a fixed stand-in "
              "draft for forced-acceptance benchmarks)")
    speculative_draft_model_path: str | None = opt(None, "EAGLE3 draft model directory or preset (tiny-eagle3)")
    speculative_num_steps: int = opt(3, "draft tokens proposed per step (the verify window is steps + 1)")
    speculative_force_accept_length: int | None = opt(
        None, "benchmarks only: accept exactly L draft tokens per step whatever the target says")

    def __post_init__(self) -> None:
        algorithm = (self.speculative_algorithm or "").lower()
        if (algorithm == "eagle3") != (self.speculative_draft_model_path is not None):
            raise ConfigError("EAGLE3 needs both --speculative-algorithm EAGLE3 and --speculative-draft-model-path")
        if algorithm and algorithm not in SPEC_ALGORITHMS:
            raise ConfigError(f"--speculative-algorithm {self.speculative_algorithm!r}: choose one of {SPEC_ALGORITHMS}")
        if self.speculative_num_steps < 1:
            raise ConfigError("--speculative-num-steps must be >= 1")
        if self.speculative_force_accept_length is not None and not algorithm:
            raise ConfigError("--speculative-force-accept-length needs --speculative-algorithm")
        if self.speculative_force_accept_length is not None and not (
            0 <= self.speculative_force_accept_length <= self.speculative_num_steps
        ):
            raise ConfigError("--speculative-force-accept-length must be in 0..speculative_num_steps")

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per decode step (0 without speculation)."""
        return self.speculative_num_steps if self.speculative_algorithm else 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        # The token budgets left unset are resolved once here, so every reader sees plain ints.
        object.__setattr__(self, "scheduler", self.scheduler.for_device(self.model.device))

    @classmethod
    def create(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (model=..., page_size=..., max_num_seqs=...)."""
        groups: dict[str, dict[str, Any]] = {name: {} for name in ENGINE_GROUPS}
        owners = {f.name: g for g, c in ENGINE_GROUPS.items() for f in fields(c)}
        for key, value in kwargs.items():
            if key not in owners:
                raise ConfigError(f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}")
            groups[owners[key]][key] = value
        return cls(**{g: ENGINE_GROUPS[g](**values) for g, values in groups.items()})


ENGINE_GROUPS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
    "spec": SpecConfig,
}


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    served_model_name: str | None = opt(None, "model name clients use (default: the model argument)")
    api_key: str | None = opt(None, "require `Authorization: Bearer KEY` on /v1 endpoints")
    enable_metrics: bool = opt(True, "serve Prometheus metrics at /metrics")
    max_waiting_requests: int = opt(1024, "requests waiting in the engine beyond which new ones get HTTP 503")
    log_level: str = opt("info", "debug | info | warning | error")
    timeout_graceful_shutdown: float = opt(30.0, "seconds in-flight requests get to finish after SIGTERM")
