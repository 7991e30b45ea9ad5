"""What one model forward consumes: a flat batch of sequences and the cache buffers they continue from.

Every forward is the same call: N sequences, each with some cached context (MLA latent rows in pages, KDA
conv/recurrent state in a slot) and q_len >= 0 new tokens. Prefill, chunked-prefill continuation, one-token decode
and k-token verification differ only in the numbers. The caller (executor) owns allocation: it assigns pages and
slots, and it zeroes (or restores from a checkpoint) a KDA slot before a sequence's first token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np
import torch
from torch import Tensor

from tokenspeed.models.config import KimiConfig
from tokenspeed.ops.h2d import device_longs


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
    # Verify batches: the sequences whose new tokens carry no drafts (a prompt chunk beside the verified windows).
    # A KDA layer that runs them through the chunked scan commits their state in the forward (`ReplayInputs`).
    prompt_rows_host: tuple[int, ...] = ()
    uniform_query_len: int | None = None  # q_len shared by every sequence (decode: 1, verify: k), else None.
    # When set, layers take their device-only paths (no host list is read), which CUDA graphs require.

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_host[-1]

    @functools.cached_property
    def query_lens_host(self) -> list[int]:
        """New tokens per sequence (host ints), computed once per batch (every layer of a forward asks)."""
        c = self.cu_seqlens_host
        return [c[i + 1] - c[i] for i in range(len(c) - 1)]

    @functools.cached_property
    def prompt_rows(self) -> Tensor:
        """prompt_rows_host as an int64 device tensor (built once per batch)."""
        return device_longs(list(self.prompt_rows_host), self.kda_slots.device)

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
        prompt_rows: Sequence[int] = (),
    ) -> ForwardBatch:
        """Assemble a batch from per-sequence host data. page_tables[n] must cover num_cached[n] + len(new).

        Host cost: the fields are written (vectorised, numpy) into one int64 host buffer (pinned when `device` is
        CUDA) that goes to the device in a single non-blocking copy; the tensors are views into that one device
        buffer (each field starts 64-byte aligned; the int32 page table is a reinterpreted int64 span). Page
        tables that keep an int32 copy of themselves (`tokenspeed.cache.PageList`, the cache manager's) are copied
        without converting their Python ints. `prompt_rows` (verify only): the sequences without drafts.
        """
        n = len(new_tokens)
        if len(num_cached) != n or len(page_tables) != n:
            raise ValueError(f"new_tokens, num_cached and page_tables differ in length: "
                             f"{n}, {len(num_cached)}, {len(page_tables)}")
        qlens = [len(toks) for toks in new_tokens]
        cu = list(accumulate(qlens, initial=0))
        num_tokens = cu[-1]
        kv_lens = [c + q for c, q in zip(num_cached, qlens)]
        lens_list = [len(p) for p in page_tables]
        width = max(lens_list, default=0)
        uniform = qlens[0] if n and qlens.count(qlens[0]) == n else None
        small = n <= _SMALL_BATCH  # per-sequence Python beats numpy's fixed costs
        if small:
            short = [i for i, (pages, kv) in enumerate(zip(lens_list, kv_lens)) if pages * page_size < kv]
        else:
            short = np.flatnonzero(np.array(lens_list) * page_size < np.array(kv_lens)).tolist()
        if short:
            i = short[0]
            raise ValueError(f"{lens_list[i]} pages of {page_size} cannot hold {kv_lens[i]} tokens")

        # One int64 host buffer holds every field, each starting _ALIGN-aligned: cu_seqlens, kv_lens, kda_slots,
        # input_ids, positions, slot_mapping, then the int32 page table packed two entries per int64.
        sizes = (n + 1, n, len(kda_slots), num_tokens, num_tokens, num_tokens)
        splits = []
        for size in sizes:
            splits += (size, -size % _ALIGN)
        splits.append(-(-n * width // 2))
        dev = torch.device(device)
        host = torch.empty(sum(splits), dtype=torch.int64, pin_memory=dev.type == "cuda" and torch.cuda.is_available())
        buf = host.numpy()
        # The per-sequence fields, and for a decode step the positions (and for a small one the cache rows), in one
        # conversion, padding included.
        fields = [cu, kv_lens, kda_slots, chain.from_iterable(new_tokens)]
        if uniform == 1:
            fields.append(num_cached)
            if small:
                fields.append([pages[c // page_size] * page_size + c % page_size
                               for pages, c in zip(page_tables, num_cached)])
        head: list[int] = []
        for values, pad in zip(fields, splits[1::2]):
            head.extend(values)
            head.extend(_ZEROS[:pad])
        buf[: len(head)] = head
        offsets = list(accumulate(splits, initial=0))
        table = buf[offsets[12] :].view(np.int32)[: n * width].reshape(n, width)
        _fill_page_table(table, page_tables, lens_list, width)
        if num_tokens and len(fields) < 6:  # cache rows, vectorised: page of each position, times page_size + offset
            pos = buf[offsets[8] : offsets[8] + num_tokens]
            slot_mapping = buf[offsets[10] : offsets[10] + num_tokens]
            if uniform == 1:
                seq = np.arange(n)
            else:
                seq = np.repeat(np.arange(n), qlens)
                pos[:] = np.arange(num_tokens)
                pos += np.repeat(np.array(kv_lens) - np.array(cu[1:]), qlens)  # cached - start of each sequence
            np.multiply(table[seq, pos // page_size], page_size, out=slot_mapping)
            slot_mapping += pos % page_size

        dev_buf = host if dev.type == "cpu" else host.to(dev, non_blocking=True)
        parts = dev_buf.split_with_sizes(splits)
        page_table = parts[12].view(torch.int32)
        if page_table.shape[0] != n * width:  # an odd entry count leaves half an int64 over
            page_table = page_table[: n * width]
        return cls(
            input_ids=parts[6],
            positions=parts[8],
            cu_seqlens=parts[0],
            kv_lens=parts[2],
            page_table=page_table.view(n, width),
            slot_mapping=parts[10],
            kda_slots=parts[4],
            cu_seqlens_host=cu,
            kv_lens_host=kv_lens,
            verify=verify,
            prompt_rows_host=tuple(prompt_rows),
            uniform_query_len=uniform,
        )


_ALIGN = 8  # int64 elements (64 bytes): where each field of the shared host / device buffer may start
_ZEROS = [0] * _ALIGN
_SMALL_BATCH = 16  # up to this many sequences, build checks lengths and maps decode cache rows in Python


def _fill_page_table(table: np.ndarray, page_tables: Sequence[Sequence[int]], lens: list[int], width: int) -> None:
    """Write the page tables (of lengths `lens`) into `table` [N, width] int32, padding rows with zeros.

    Tables that keep an int32 copy of themselves (`host_array()`, see `tokenspeed.cache.PageList`) are
    concatenated as arrays; otherwise the Python ints are converted (O(total pages))."""
    if not table.size:
        return
    try:
        arrays = [p.host_array() for p in page_tables]
    except AttributeError:  # plain lists
        arrays = [None]
    if all(a is not None for a in arrays):
        flat = np.concatenate(arrays)
    else:
        flat = np.fromiter(chain.from_iterable(page_tables), np.int32, sum(lens))
    if min(lens) == width:  # no padding
        table.reshape(-1)[:] = flat
    else:
        table.fill(0)
        table[np.arange(width) < np.array(lens)[:, None]] = flat


@dataclass
class ReplayInputs:
    """What a verify forward records per KDA layer so the accepted tokens can be replayed into the state: the raw
    projections, from which `ops.kda_decode` redoes conv, gate and recurrence (no GEMM is recomputed)."""

    projected: Tensor  # [T, 3 * channels] q/k/v projections before the short conv (model dtype)
    f: Tensor  # [T, channels] gate logits before the K3 / softplus gate (model dtype)
    b: Tensor  # [T, heads] beta logits before the sigmoid (model dtype)
    # Sequences (batch rows) whose state the forward already committed (prompt chunks beside the verified windows,
    # run through the chunked scan): the replay applies none of their tokens.
    committed: tuple[int, ...] = ()


# The KDA recurrent pools hold each head's state as [V, K]: the fused decode kernel's [K, block_v] tiles are then
# block_v contiguous rows. H200 at 3f6f223 (benchmarks/README.md): 96 heads x 64 sequences 224-228 us (83-84% of
# HBM) against 243 us for [K, V] in the same run; 32 x 64 80 vs 89 us.
KDA_STATE_V_FIRST = True


@dataclass
class CacheBuffers:
    """Device buffers of the per-request model state, indexed by the ordinal of a layer among its kind.

    mla_latent[i]: [num_pages, page_size, kv_lora_rank + rope_dim] (bf16, fp32 or fp8 e4m3 with mla_kv_scale)
    kda_conv[i]: [num_slots, 3 * local KDA channels, conv_kernel - 1] (activation dtype; last column newest)
    kda_recurrent[i]: [num_slots, local KDA heads, head_dim, head_dim] fp32, each head's state transposed ([V, K],
    element (k, v) at v * head_dim + k) when kda_state_v_first (the default, KDA_STATE_V_FIRST), else [K, V]; the
    KDA ops take the layout as `state_v_first`. Slots are copied (prefix checkpoints, offload) as opaque bytes.
    """

    page_size: int
    mla_latent: list[Tensor]
    kda_conv: list[Tensor]
    kda_recurrent: list[Tensor]
    mla_kv_scale: float = 1.0
    kda_state_v_first: bool = KDA_STATE_V_FIRST  # the kda_recurrent layout every KDA op of the model is told
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
    ) -> CacheBuffers:
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
        """Zero the KDA state of `slots` (a sequence starting from token 0). Mutates the buffers; no host sync."""
        idx = device_longs(list(slots), self.kda_conv[0].device) if self.kda_conv else None
        for conv, rec in zip(self.kda_conv, self.kda_recurrent, strict=False):
            conv.index_fill_(0, idx, 0)  # `conv[idx] = 0` would copy the 0 to the device and synchronise
            rec.index_fill_(0, idx, 0)
