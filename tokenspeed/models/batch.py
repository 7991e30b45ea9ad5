"""What one model forward consumes: a flat batch of sequences and the cache buffers they continue from.

Every forward is the same call: N sequences, each with some cached context (MLA latent rows in pages, KDA
conv/recurrent state in a slot) and q_len >= 0 new tokens. Prefill, chunked-prefill continuation, one-token decode
and k-token verification differ only in the numbers. The caller (executor) owns allocation: it assigns pages and
slots, and it zeroes (or restores from a checkpoint) a KDA slot before a sequence's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tokenspeed.models.config import KimiConfig


@dataclass
class ForwardBatch:
    """The flat varlen batch. Tensors are on the model's device; the `*_host` lists mirror them on the CPU."""

    input_ids: Tensor  # [T] int64: the new tokens of all sequences, back to back
    positions: Tensor  # [T] int64: absolute position of each new token in its sequence
    cu_seqlens: Tensor  # [N+1] int64: offsets of each sequence's new tokens in input_ids
    kv_lens: Tensor  # [N] int64: context length after this step (cached + new)
    page_table: Tensor  # [N, max_pages] int32: MLA page ids of each sequence (entries past its length unused)
    slot_mapping: Tensor  # [T] int64: flat MLA cache row (page * page_size + offset) of each new token
    kda_slots: Tensor  # [N] int64: KDA state slot of each sequence (read, then updated in place)
    cu_seqlens_host: list[int]  # N+1 host copy of cu_seqlens
    kv_lens_host: list[int]  # N host copy of kv_lens
    verify: bool = False  # speculative verification: KDA states are read, not written (see KDAAttention.replay)
    uniform_query_len: int | None = None  # q_len shared by every sequence (decode: 1, verify: k), else None.
    # When set, layers take their device-only paths (no host list is read), which CUDA graphs require.

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_host[-1]

    @property
    def query_lens_host(self) -> list[int]:
        c = self.cu_seqlens_host
        return [c[i + 1] - c[i] for i in range(len(c) - 1)]

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        num_cached: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        kda_slots: Sequence[int],
        page_size: int,
        device: torch.device | str = "cpu",
        verify: bool = False,
    ) -> "ForwardBatch":
        """Assemble a batch from per-sequence host data. page_tables[n] must cover num_cached[n] + len(new)."""
        cu, positions, slots, kv_lens = [0], [], [], []
        for toks, cached, pages in zip(new_tokens, num_cached, page_tables, strict=True):
            kv_len = cached + len(toks)
            if len(pages) * page_size < kv_len:
                raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {kv_len} tokens")
            positions.extend(range(cached, kv_len))
            slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(cached, kv_len))
            cu.append(cu[-1] + len(toks))
            kv_lens.append(kv_len)
        qlens = {len(toks) for toks in new_tokens}
        width = max((len(p) for p in page_tables), default=0)
        table = [list(p) + [0] * (width - len(p)) for p in page_tables]

        def t(data: list, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(data, dtype=dtype, device=device)

        return cls(
            input_ids=t([tok for toks in new_tokens for tok in toks]),
            positions=t(positions),
            cu_seqlens=t(cu),
            kv_lens=t(kv_lens),
            page_table=t(table, torch.int32).reshape(len(table), width),
            slot_mapping=t(slots),
            kda_slots=t(list(kda_slots)),
            cu_seqlens_host=cu,
            kv_lens_host=kv_lens,
            verify=verify,
            uniform_query_len=qlens.pop() if len(qlens) == 1 else None,
        )


@dataclass
class ReplayInputs:
    """What a verify forward records per KDA layer so the accepted tokens can be replayed into the state: the raw
    projections, from which `ops.kda_decode` redoes conv, gate and recurrence (no GEMM is recomputed)."""

    projected: Tensor  # [T, 3 * channels] q/k/v projections before the short conv (model dtype)
    f: Tensor  # [T, channels] gate logits before the K3 / softplus gate (model dtype)
    b: Tensor  # [T, heads] beta logits before the sigmoid (model dtype)


@dataclass
class CacheBuffers:
    """Device buffers of the per-request model state, indexed by the ordinal of a layer among its kind.

    mla_latent[i]: [num_pages, page_size, kv_lora_rank + rope_dim] (bf16, fp32 or fp8 e4m3 with mla_kv_scale)
    kda_conv[i]: [num_slots, 3 * local KDA channels, conv_kernel - 1] (activation dtype; last column newest)
    kda_recurrent[i]: [num_slots, local KDA heads, head_dim, head_dim] fp32 ([K, V] per head)
    """

    page_size: int
    mla_latent: list[Tensor]
    kda_conv: list[Tensor]
    kda_recurrent: list[Tensor]
    mla_kv_scale: float = 1.0
    replay: dict[int, ReplayInputs] = field(default_factory=dict)  # KDA layer ordinal -> last verify's inputs

    @classmethod
    def allocate(
        cls,
        config: KimiConfig,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        kv_cache_dtype: torch.dtype | None = None,
        tp_size: int = 1,
    ) -> "CacheBuffers":
        """Zero-filled buffers for every MLA and KDA layer of `config` (KDA heads split over tp_size)."""
        heads = config.kda_num_heads // tp_size
        channels = 3 * heads * config.kda_head_dim
        d = config.kda_head_dim
        kv_dtype = kv_cache_dtype or dtype
        return cls(
            page_size=page_size,
            mla_latent=[
                torch.zeros(num_pages, page_size, config.mla_latent_dim, dtype=kv_dtype, device=device)
                for _ in config.mla_layers
            ],
            kda_conv=[
                torch.zeros(num_slots, channels, config.short_conv_kernel_size - 1, dtype=dtype, device=device)
                for _ in config.kda_layers
            ],
            kda_recurrent=[
                torch.zeros(num_slots, heads, d, d, dtype=torch.float32, device=device) for _ in config.kda_layers
            ],
        )

    def reset_slots(self, slots: Sequence[int]) -> None:
        """Zero the KDA state of `slots` (a sequence starting from token 0). Mutates the buffers."""
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.kda_conv[0].device) if self.kda_conv else None
        for conv, rec in zip(self.kda_conv, self.kda_recurrent, strict=False):
            conv[idx] = 0
            rec[idx] = 0
