"""CUDA graphs of the decode forward: captured once per batch size of a ladder, replayed every decode step.

A decode step (every sequence has exactly one new token, no verification) has shapes that depend only on the
number of sequences, and every layer's decode path reads device values only (`ForwardBatch.uniform_query_len`).
So the whole forward, embedding to logits, is captured for batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to
`max_batch_size`, into one shared memory pool (largest first). A step of N sequences copies its inputs into the
static tensors of the smallest size B >= N and replays that graph; rows N..B-1 are padding:

- `kda_slots = -1`: the fused KDA kernel writes zeros for them and touches no state;
- `kv_lens = 0`: MLA decode gives zeros and reads no cache row;
- `slot_mapping` points at a scratch page that no sequence owns (the runner allocates one extra page), so their
  new latent rows land nowhere that matters.

The logits of a replay live in the graph pool and are valid until the next replay: consume them first.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import Tensor

from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM

logger = logging.getLogger(__name__)


def batch_size_ladder(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond; always ending at max_batch_size."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)
    sizes.append(max_batch_size)
    return sizes


class DecodeGraphs:
    """Decode-step graphs of one model over its cache buffers.

    max_pages_per_seq: page-table width of the static batch (ceil(max_model_len / page_size));
    scratch_page: a page id no sequence is given (padding rows write their latent rows there).
    """

    def __init__(
        self,
        model: KimiForCausalLM,
        buffers: CacheBuffers,
        max_batch_size: int,
        max_pages_per_seq: int,
        scratch_page: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = batch_size_ladder(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_pages_per_seq = max_pages_per_seq
        self.scratch_row = scratch_page * buffers.page_size
        dev, b = model.device, max_batch_size
        i64 = {"dtype": torch.int64, "device": dev}
        self.input_ids = torch.zeros(b, **i64)
        self.positions = torch.zeros(b, **i64)
        self.cu_seqlens = torch.arange(b + 1, **i64)
        self.kv_lens = torch.zeros(b, **i64)
        self.page_table = torch.zeros(b, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((b,), self.scratch_row, **i64)
        self.kda_slots = torch.full((b,), -1, **i64)
        self.logits_indices = torch.arange(b, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], cu_seqlens=self.cu_seqlens[: bs + 1],
            kv_lens=self.kv_lens[:bs], page_table=self.page_table[:bs], slot_mapping=self.slot_mapping[:bs],
            kda_slots=self.kda_slots[:bs], cu_seqlens_host=list(range(bs + 1)), kv_lens_host=[0] * bs,
            uniform_query_len=1,
        )

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels) and capture every size, largest first, in one memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for bs in reversed(self.sizes):
            batch = self._static_batch(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(batch, self.buffers, self.logits_indices[:bs])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(batch, self.buffers, self.logits_indices[:bs])
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - start)

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a pure decode step that fits the captured shapes."""
        return (batch.uniform_query_len == 1 and not batch.verify and 0 < batch.num_seqs <= self.max_batch_size
                and batch.page_table.shape[1] <= self.max_pages_per_seq)

    def run(self, batch: ForwardBatch) -> Tensor:
        """Logits [N, vocab] fp32 of the decode `batch` (row n: sequence n). Mutates the cache like the eager
        forward would; the result is a view into the graph's pool (valid until the next replay)."""
        n = batch.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = batch.page_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.kv_lens[:n].copy_(batch.kv_lens)
        self.page_table[:n, :width].copy_(batch.page_table)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.kda_slots[:n].copy_(batch.kda_slots)
        if bs > n:
            self.kv_lens[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(self.scratch_row)
            self.kda_slots[n:bs].fill_(-1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
