"""Per-GPU cache arithmetic: MLA bytes per token, KDA state bytes per request, speculative-verify workspace.

All figures are bytes held by ONE GPU (k3-architecture.md section 3.1):

- MLA latent rows are replicated on every attention-TP rank: per token, (MLA layers of the target + draft layers)
  x (kv_lora_rank + qk_rope_head_dim) x kv dtype bytes, whatever attn_tp is.
- KDA state is sharded by head over attn_tp: per KDA layer, conv = 3 * H/tp * D * (W - 1) x conv dtype bytes (the
  last W-1 pre-conv inputs) and recurrent = H/tp * D * D x state dtype bytes.
- Speculative verify of P positions: per-position snapshots keep P + 1 state rows (the anchor and one per
  position) per request and KDA layer; replay keeps, per token and KDA layer, only what re-running the accepted
  prefix needs: the pre-conv q|k|v (activation dtype), the rank-D decay-gate input f_a(x) (activation dtype), the
  beta logits (activation dtype) and the per-channel gate (fp32), the [TS] payload.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed.models.config import KimiConfig
from tokenspeed.plan.draft import Eagle3Draft
from tokenspeed.plan.precision import KDA_STATE_DTYPES, KV_CACHE_DTYPES, dtype_bytes


@dataclass(frozen=True)
class MlaTokenBytes:
    """Cache bytes of one token on one GPU: target MLA layers, draft layers, and their sum."""

    target: int
    draft: int

    @property
    def total(self) -> int:
        return self.target + self.draft


def mla_bytes_per_token(config: KimiConfig, kv_cache_dtype: str = "bf16", draft: Eagle3Draft | None = None
                        ) -> MlaTokenBytes:
    """Latent-cache bytes per token per GPU (replicated over attention TP): 24 x 576 x dtype for K3."""
    b = dtype_bytes(kv_cache_dtype, KV_CACHE_DTYPES)
    target = len(config.mla_layers) * config.mla_latent_dim * b
    return MlaTokenBytes(target, draft.cache_values_per_token * b if draft else 0)


@dataclass(frozen=True)
class KdaStateBytes:
    """One request's KDA state on one GPU (`heads` local heads), per KDA layer and for all `layers`."""

    heads: int
    layers: int
    conv_per_layer: int  # 3 * heads * D * (W - 1) * conv dtype bytes
    recurrent_per_layer: int  # heads * D * D * state dtype bytes

    @property
    def per_layer(self) -> int:
        return self.conv_per_layer + self.recurrent_per_layer

    @property
    def per_request(self) -> int:
        """One copy of the whole state (all KDA layers): one state slot or checkpoint."""
        return self.layers * self.per_layer


def kda_state_bytes(config: KimiConfig, attn_tp: int = 1, conv_dtype: str = "bf16", state_dtype: str = "fp32"
                    ) -> KdaStateBytes:
    """KDA state per request per GPU. TP8 K3: 27,648 B conv (bf16) + 786,432 B recurrent (fp32) = 795 KiB/layer."""
    heads = config.kda_num_heads // attn_tp
    d = config.kda_head_dim
    conv = 3 * heads * d * (config.short_conv_kernel_size - 1) * dtype_bytes(conv_dtype, ("bf16", "fp32"))
    recurrent = heads * d * d * dtype_bytes(state_dtype, KDA_STATE_DTYPES)
    return KdaStateBytes(heads, len(config.kda_layers), conv, recurrent)


def replay_bytes_per_token(config: KimiConfig, attn_tp: int = 1, act_dtype: str = "bf16", gate_dtype: str = "fp32"
                           ) -> int:
    """Replay payload per token per KDA layer on one GPU. TP8 K3: 4608*2 + 128*2 + 12*2 + 12*128*4 = 15,640 B."""
    heads, d = config.kda_num_heads // attn_tp, config.kda_head_dim
    act, gate = dtype_bytes(act_dtype), dtype_bytes(gate_dtype)
    return 3 * heads * d * act + d * act + heads * act + heads * d * gate


@dataclass(frozen=True)
class VerifyWorkspace:
    """KDA speculative-verify workspace on one GPU for `seqs` requests verifying `positions` tokens each."""

    seqs: int
    positions: int
    layers: int
    snapshot_row: int  # bytes of one state row (conv + recurrent) per KDA layer
    replay_token: int  # replay payload bytes per token per KDA layer

    @property
    def snapshot_bytes(self) -> int:
        """Anchor + one row per position, per request and KDA layer."""
        return self.seqs * (self.positions + 1) * self.layers * self.snapshot_row

    @property
    def replay_bytes(self) -> int:
        """One payload per verified token, per request and KDA layer."""
        return self.seqs * self.positions * self.layers * self.replay_token

    def bytes(self, mode: str) -> int:
        return self.replay_bytes if mode == "replay" else self.snapshot_bytes


def verify_workspace(config: KimiConfig, attn_tp: int, seqs: int, positions: int, conv_dtype: str = "bf16",
                     state_dtype: str = "fp32") -> VerifyWorkspace:
    """Snapshot vs replay workspace. TP8 K3, 64 seqs x 4 positions: 16.74 GiB vs 0.257 GiB."""
    state = kda_state_bytes(config, attn_tp, conv_dtype, state_dtype)
    return VerifyWorkspace(seqs, positions, state.layers, state.per_layer,
                           replay_bytes_per_token(config, attn_tp, conv_dtype))


@dataclass(frozen=True)
class RequestCache:
    """Cache one request of `context` tokens holds on one GPU: MLA rows plus `kda_copies` KDA state copies."""

    context: int
    mla_bytes: int
    kda_bytes: int

    @property
    def total(self) -> int:
        return self.mla_bytes + self.kda_bytes


def request_cache_bytes(context: int, mla: MlaTokenBytes, kda: KdaStateBytes, kda_copies: int = 2) -> RequestCache:
    """Bytes of one request. `kda_copies`: whole-state copies it keeps (2: the live state page and one
    checkpoint, the [TS] recipe's two rolling pages; the seed's "two BF16 KDA checkpoints")."""
    return RequestCache(context, context * mla.total, kda_copies * kda.per_request)
