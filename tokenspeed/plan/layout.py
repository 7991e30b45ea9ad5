"""The parallel layout the planner sizes a GPU for: attention TP x DP, routed experts TP x EP, TP subgroups.

Sharding rules (the same ones the engine applies):

- Everything dense runs on the tokens of its attention group, so it shards by `attn_tp`: KDA/MLA projections by
  head (f_a, q_a and kv_a stay replicated), shared experts and the dense layer-0 MLP by intermediate width,
  embedding and lm_head by vocabulary, the routed latent down/up projections by latent column (`latent_shard`).
- A TP subgroup (`tp_subgroup` > 1, DEP's "TP4") further shards the components named in `subgroup_shards`
  inside groups of `tp_subgroup` data-parallel ranks; core attention and its cache stay local.
- Routed experts: whole experts over `moe_ep`, each expert's intermediate width over `moe_tp`.
- The router, norms and other vectors are replicated.

`attn_tp * attn_dp` and `moe_tp * moe_ep` are both the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed.errors import ConfigError
from tokenspeed.models.config import KimiConfig

SUBGROUP_COMPONENTS = ("attention", "shared_experts", "dense_mlp", "embeddings")
LATENT_SHARD_CHOICES = ("both", "up", "none")  # which latent projections shard over attn_tp


@dataclass(frozen=True)
class ParallelLayout:
    """GPU counts of each parallel dimension (all >= 1). See the module docstring for what shards where."""

    attn_tp: int = 1
    attn_dp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    tp_subgroup: int = 1
    subgroup_shards: tuple[str, ...] = ("attention", "shared_experts")
    latent_shard: str = "both"

    def __post_init__(self) -> None:
        for name in ("attn_tp", "attn_dp", "moe_tp", "moe_ep", "tp_subgroup"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.attn_tp * self.attn_dp != self.moe_tp * self.moe_ep:
            raise ConfigError(
                f"attention uses attn_tp x attn_dp = {self.attn_tp} x {self.attn_dp} = {self.attn_tp * self.attn_dp} "
                f"GPUs but the experts use moe_tp x moe_ep = {self.moe_tp} x {self.moe_ep} = "
                f"{self.moe_tp * self.moe_ep}; make the two products equal (e.g. --attn-dp 16 --moe-ep 16)"
            )
        if self.attn_dp % self.tp_subgroup:
            raise ConfigError(
                f"--tp-subgroup {self.tp_subgroup} must divide --attn-dp {self.attn_dp}: a subgroup is made of "
                "data-parallel attention ranks (e.g. --attn-dp 16 --tp-subgroup 4)"
            )
        bad = [c for c in self.subgroup_shards if c not in SUBGROUP_COMPONENTS]
        if bad:
            raise ConfigError(f"unknown TP-subgroup component(s) {bad}; choose from {', '.join(SUBGROUP_COMPONENTS)}")
        if self.latent_shard not in LATENT_SHARD_CHOICES:
            raise ConfigError(f"latent_shard must be one of {LATENT_SHARD_CHOICES}, got {self.latent_shard!r}")

    @classmethod
    def resolve(
        cls,
        attn_tp: int | None = None,
        attn_dp: int | None = None,
        moe_tp: int | None = None,
        moe_ep: int | None = None,
        **kwargs,
    ) -> ParallelLayout:
        """Fill unset sizes: MoE follows attention (moe_tp = attn_tp, moe_ep = attn_dp) unless one MoE size is
        given, in which case the other makes the world sizes match; attn_dp follows the MoE world."""
        atp = attn_tp or 1
        if attn_dp is None:
            world = (moe_tp or 1) * (moe_ep or 1) if (moe_tp or moe_ep) else atp
            if world % atp:
                raise ConfigError(f"the MoE world size {world} is not a multiple of --attn-tp {atp}")
            attn_dp = max(world // atp, 1)
        world = atp * attn_dp
        if moe_tp is None and moe_ep is None:
            moe_tp, moe_ep = atp, attn_dp
        elif moe_tp is None or moe_ep is None:
            given = moe_tp if moe_tp is not None else moe_ep
            if given < 1 or world % given:
                raise ConfigError(f"world size {world} (attn_tp x attn_dp) is not a multiple of the MoE size {given}")
            moe_tp, moe_ep = (given, world // given) if moe_tp is not None else (world // given, given)
        return cls(atp, attn_dp, moe_tp, moe_ep, **kwargs)

    @property
    def world_size(self) -> int:
        return self.attn_tp * self.attn_dp

    def subgroup(self, component: str) -> int:
        """The TP-subgroup factor applied to `component` (1 unless it is in subgroup_shards)."""
        return self.tp_subgroup if component in self.subgroup_shards else 1

    def dense_divisor(self, group: str) -> int:
        """How many ways a dense tensor of sharding group `group` is split on one GPU (1: replicated)."""
        if group in SUBGROUP_COMPONENTS:
            return self.attn_tp * self.subgroup(group)
        if group == "latent_down":
            return self.attn_tp if self.latent_shard == "both" else 1
        if group == "latent_up":
            return self.attn_tp if self.latent_shard in ("both", "up") else 1
        if group == "draft":
            return self.attn_tp
        raise AssertionError(f"unknown sharding group {group!r}")

    def check(self, config: KimiConfig) -> None:
        """ConfigError if a sharded dimension of `config` does not divide evenly under this layout."""
        attn = self.attn_tp * self.subgroup("attention")
        pairs = [
            (config.kda_num_heads, attn, "KDA heads", "--attn-tp x --tp-subgroup"),
            (config.num_attention_heads, attn, "MLA heads", "--attn-tp x --tp-subgroup"),
            (config.vocab_size, self.attn_tp * self.subgroup("embeddings"), "vocab_size", "--attn-tp"),
        ]
        if config.num_experts is not None:
            pairs += [
                (config.num_experts, self.moe_ep, "num_experts", "--moe-ep"),
                (config.moe_intermediate_size, self.moe_tp, "moe_intermediate_size", "--moe-tp"),
                (config.num_shared_experts * config.moe_intermediate_size,
                 self.attn_tp * self.subgroup("shared_experts"), "shared-expert width", "--attn-tp x --tp-subgroup"),
            ]
        for n, div, what, flag in pairs:
            if n and n % div:
                raise ConfigError(f"{what} ({n}) is not divisible by {flag} = {div}; pick sizes that divide {n}")

    def describe(self) -> str:
        text = (f"{self.world_size} GPUs: attention TP{self.attn_tp} x DP{self.attn_dp}, "
                f"routed experts TP{self.moe_tp} x EP{self.moe_ep}")
        if self.tp_subgroup > 1:
            text += f", TP{self.tp_subgroup} subgroups for {'+'.join(self.subgroup_shards)}"
        return text + f", latent projections sharded: {self.latent_shard}"
