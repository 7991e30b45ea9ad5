"""Per-layer communication volume: TP-style all-reduces versus expert-parallel dispatch/combine.

Bytes SENT by one GPU for one decoder layer with a MoE block, for B local tokens per GPU on N GPUs (the
seed's model, "DEP decode"):

- TEP (tensor/expert parallel: every rank holds all B*N tokens): one ring all-reduce per reduced output,
  each sending 2 (N-1)/N x B*N x width x bytes. K3 reduces the attention output and the shared-expert output at
  the hidden width and the routed latent partial sums at the latent width (3584): two bf16 all-reduces at 7168
  and one at 3584. A model without a latent reduces attention and MoE at the hidden width.
- DEP (attention data parallel + expert parallel): each token is dispatched to the ranks owning its top-k
  experts and their outputs combined back, in the expert input width (the latent for LatentMoE). Upper bound
  (every copy remote, no deduplication; 0 on one GPU): B x k x width x (dispatch + combine bytes). With uniform routing and
  one copy per destination rank, the expected number of remote ranks a token reaches is
  (N-1) x (1 - C(E - E/N, k) / C(E, k)).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from tokenspeed.errors import ConfigError
from tokenspeed.models.config import KimiConfig

# Bytes per transported activation element (NVFP4/MXFP4 include their per-16 / per-32 scales).
ACTIVATION_BYTES = {"nvfp4": 0.5625, "mxfp4": 0.53125, "fp8": 1.0, "bf16": 2.0}


@dataclass(frozen=True)
class LayerComm:
    """Bytes sent per GPU for one MoE decoder layer; see the module docstring for the formulas."""

    local_tokens: int  # B
    gpus: int  # N
    tep_widths: tuple[int, ...]  # widths of the TEP all-reduces
    tep_bytes: float
    dep_width: int  # dispatched/combined width
    top_k: int
    expected_remote_ranks: float  # per token, uniform routing, one copy per destination rank
    dep_dispatch_bound: float
    dep_combine_bound: float
    dep_dispatch_expected: float
    dep_combine_expected: float

    @property
    def dep_bound(self) -> float:
        return self.dep_dispatch_bound + self.dep_combine_bound

    @property
    def dep_expected(self) -> float:
        return self.dep_dispatch_expected + self.dep_combine_expected


def allreduce_bytes_sent(tokens: int, width: int, gpus: int, elem_bytes: float = 2.0) -> float:
    """Ring all-reduce of a [tokens, width] tensor: 2 (N-1)/N x payload sent per GPU."""
    return 2 * (gpus - 1) / gpus * tokens * width * elem_bytes


def expected_remote_ranks(num_experts: int, top_k: int, gpus: int) -> float:
    """Expected distinct OTHER ranks a token's top-k experts live on (uniform routing, E/N experts per rank)."""
    if gpus <= 1:
        return 0.0
    per_rank = num_experts // gpus
    miss = comb(num_experts - per_rank, top_k) / comb(num_experts, top_k)
    return (gpus - 1) * (1 - miss)


def layer_comm(config: KimiConfig, local_tokens: int, gpus: int, dispatch_dtype: str = "nvfp4",
               combine_dtype: str = "bf16", allreduce_dtype: str = "bf16") -> LayerComm:
    """TEP all-reduce vs DEP dispatch/combine bytes per GPU per layer for `local_tokens` tokens per GPU."""
    if config.num_experts is None:
        raise ConfigError("the model has no routed experts: there is no dispatch/combine to plan")
    for name in (dispatch_dtype, combine_dtype, allreduce_dtype):
        if name not in ACTIVATION_BYTES:
            raise ConfigError(f"unknown transport dtype {name!r}; choose from {', '.join(ACTIVATION_BYTES)}")
    if config.num_experts % gpus:
        raise ConfigError(f"num_experts ({config.num_experts}) is not divisible by {gpus} GPUs of expert parallelism")
    d, latent = config.hidden_size, config.routed_expert_hidden_size
    shared_apart = latent is not None and config.num_shared_experts > 0  # latent: shared reduced apart at d
    widths = (d, d, latent) if shared_apart else (d, latent or d)
    ar = ACTIVATION_BYTES[allreduce_dtype]
    tep = sum(allreduce_bytes_sent(local_tokens * gpus, w, gpus, ar) for w in widths)
    width, k = latent or d, config.num_experts_per_token
    remote = expected_remote_ranks(config.num_experts, k, gpus)
    disp, comb_b = ACTIVATION_BYTES[dispatch_dtype], ACTIVATION_BYTES[combine_dtype]
    copies = k if gpus > 1 else 0  # one GPU: nothing leaves it
    return LayerComm(
        local_tokens=local_tokens, gpus=gpus, tep_widths=widths, tep_bytes=tep, dep_width=width, top_k=k,
        expected_remote_ranks=remote,
        dep_dispatch_bound=local_tokens * copies * width * disp,
        dep_combine_bound=local_tokens * copies * width * comb_b,
        dep_dispatch_expected=local_tokens * remote * width * disp,
        dep_combine_expected=local_tokens * remote * width * comb_b,
    )
