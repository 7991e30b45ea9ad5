"""CUDA graphs of decode and verify forwards: captured once per batch size of a ladder, replayed every step.

A decode step (every sequence has exactly one new token) or a verify step (every sequence has the same k + 1
tokens: its last token and k drafts) has shapes that depend only on the number of sequences, and every layer's
path for such a batch reads device values only (`ForwardBatch.uniform_query_len`). One `DecodeGraphs` holds the
graphs of one query length.
So the whole forward, embedding to logits, is captured for batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to
`max_batch_size`, into one shared memory pool (largest first). A step of N sequences copies its inputs into the
static tensors of the smallest size B >= N and replays that graph; rows N..B-1 are padding:

- `kda_slots = -1`: the fused KDA kernel writes zeros for them and touches no state;
- `kv_lens = 0`: MLA decode gives zeros and reads no cache row;
- `slot_mapping` points at a scratch page that no sequence owns (the runner allocates one extra page), so their
  new latent rows land nowhere that matters.

The logits of a replay live in the graph pool and are valid until the next replay: consume them first. With an
EAGLE3 drafter the graphs also output the target features of the layers it reads (`last_features`). A verify
graph also re-registers the KDA replay inputs its capture recorded (`CacheBuffers.replay`), so the runner's
`replay_kda` after acceptance reads this replay's projections; `replay_state` then advances the KDA state by the
accepted tokens through a second captured graph per size (one `ops.kda_replay_layers` launch over all KDA layers
and the verify graph's own recorded rows, addressed through a layer table built at capture; the accepted counts in
a static device tensor). `use_graphs=False` runs the same padded static batches eagerly (the CPU tests check
the padding semantics with it).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM
from tokenspeed.ops import KdaLayerTable

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
    scratch_page: a page id no sequence is given (padding rows write their latent rows there);
    query_len: new tokens per sequence (1: decode; k + 1: verify, KDA states read but not written).
    """

    def __init__(
        self,
        model: KimiForCausalLM,
        buffers: CacheBuffers,
        max_batch_size: int,
        max_pages_per_seq: int,
        scratch_page: int,
        query_len: int = 1,
        use_graphs: bool = True,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.capture_layers = capture_layers  # EAGLE3: target layers whose features each replay also outputs
        self.buffers = buffers
        self.sizes = batch_size_ladder(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_pages_per_seq = max_pages_per_seq
        self.scratch_row = scratch_page * buffers.page_size
        self.query_len = q = query_len
        self.verify = query_len > 1
        self.use_graphs = use_graphs
        dev, b = model.device, max_batch_size
        i64 = {"dtype": torch.int64, "device": dev}
        self.input_ids = torch.zeros(b * q, **i64)
        self.positions = torch.zeros(b * q, **i64)
        self.cu_seqlens = torch.arange(b + 1, **i64) * q
        self.kv_lens = torch.zeros(b, **i64)
        self.page_table = torch.zeros(b, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((b * q,), self.scratch_row, **i64)
        self.kda_slots = torch.full((b,), -1, **i64)
        self.logits_indices = torch.arange(b * q, **i64)
        self.num_accepted = torch.zeros(b, **i64)  # verify: tokens to replay per sequence (padding rows: 0)
        self.last_size = 0  # the bucket of the last `run` (what `replay_state` continues)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replay_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # verify: KDA state replay of each size
        self.outputs: dict[int, Tensor] = {}
        self.features: dict[int, Tensor] = {}  # EAGLE3: [bs * query_len, num_aux * hidden] captured features
        self.replay_inputs: dict[int, dict] = {}  # verify: the KDA replay inputs each size's capture recorded
        self.replay_tables: dict[int, KdaLayerTable | None] = {}  # verify: each size's KDA layer table

    def _static_batch(self, bs: int) -> ForwardBatch:
        q = self.query_len
        return ForwardBatch(
            input_ids=self.input_ids[: bs * q], positions=self.positions[: bs * q],
            cu_seqlens=self.cu_seqlens[: bs + 1], kv_lens=self.kv_lens[:bs], page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[: bs * q], kda_slots=self.kda_slots[:bs],
            cu_seqlens_host=[i * q for i in range(bs + 1)], kv_lens_host=[0] * bs, verify=self.verify,
            uniform_query_len=q,
        )

    def _forward(self, bs: int) -> Tensor:
        rows = self.logits_indices[: bs * self.query_len]
        if not self.capture_layers:
            return self.model(self._static_batch(bs), self.buffers, rows)
        logits, captured = self.model(self._static_batch(bs), self.buffers, rows, capture_layers=self.capture_layers)
        self.features[bs] = torch.cat(captured, dim=-1)
        return logits

    def _replay(self, bs: int) -> None:
        """The KDA state replay of size bs: one `ops.kda_replay_layers` over all KDA layers, through the table
        built at capture (a graph's recorded inputs keep their addresses) or, eagerly, a fresh one."""
        self.model.replay_kda(self.buffers, self._static_batch(bs), self.num_accepted[:bs],
                              table=self.replay_tables.get(bs))

    def _capture_replay(self, bs: int, pool, stream: torch.cuda.Stream) -> None:
        """Capture the KDA state replay that follows a verify graph of size bs (static slots are all -1 while
        capturing, so the warm-up touches no state). Its layer table (device offsets of the verify graph's recorded
        inputs, weights and pools) is built here, outside the capture, and read by every replay of the graph."""
        with torch.cuda.stream(stream):
            self.buffers.replay.update(self.replay_inputs[bs])
            self.replay_tables[bs] = self.model.kda_replay_table(self.buffers)
            for _ in range(2):
                self.buffers.replay.update(self.replay_inputs[bs])
                self._replay(bs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.buffers.replay.update(self.replay_inputs[bs])
        with torch.cuda.graph(graph, pool=pool):
            self._replay(bs)
        self.buffers.replay.clear()
        self.replay_graphs[bs] = graph

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels) and capture every size, largest first, in one memory pool."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for bs in reversed(self.sizes):
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.buffers.replay.clear()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            self.replay_inputs[bs] = dict(self.buffers.replay)
            self.buffers.replay.clear()
            self.graphs[bs] = graph
            if self.verify and self.replay_inputs[bs]:
                self._capture_replay(bs, pool, stream)
        torch.cuda.synchronize()
        logger.info("captured %s CUDA graphs (%d tokens per sequence) for batch sizes %s in %.1f s",
                    "verify" if self.verify else "decode", self.query_len, self.sizes, time.perf_counter() - start)

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a step of this query length (decode, or verify) that fits the captured shapes."""
        return (batch.uniform_query_len == self.query_len and batch.verify == self.verify
                and 0 < batch.num_seqs <= self.max_batch_size and batch.page_table.shape[1] <= self.max_pages_per_seq)

    def run(self, batch: ForwardBatch) -> Tensor:
        """Logits [N * query_len, vocab] fp32 of `batch` (the rows of its tokens, in order). Mutates the cache
        like the eager forward would (verify: new MLA rows only, and the KDA replay inputs are registered); the
        result is a view into the graph's pool (valid until the next replay)."""
        n, q = batch.num_seqs, self.query_len
        bs = self.last_size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = batch.page_table.shape[1]
        self.input_ids[: n * q].copy_(batch.input_ids)
        self.positions[: n * q].copy_(batch.positions)
        self.kv_lens[:n].copy_(batch.kv_lens)
        self.page_table[:n, :width].copy_(batch.page_table)
        self.slot_mapping[: n * q].copy_(batch.slot_mapping)
        self.kda_slots[:n].copy_(batch.kda_slots)
        if bs > n:
            self.kv_lens[n:bs].zero_()
            self.slot_mapping[n * q : bs * q].fill_(self.scratch_row)
            self.kda_slots[n:bs].fill_(-1)
        if not self.use_graphs:
            return self._forward(bs)[: n * q]
        self.graphs[bs].replay()
        self.buffers.replay.update(self.replay_inputs[bs])
        return self.outputs[bs][: n * q]

    def last_features(self, num_tokens: int) -> Tensor:
        """EAGLE3: the captured target features of the last `run`'s first num_tokens rows (a view into the graph
        pool, valid until the next replay: copy what must outlive it)."""
        return self.features[self.last_size][:num_tokens]

    def replay_state(self, num_accepted: Sequence[int]) -> None:
        """After `run` of a verify step of N sequences: advance each one's committed KDA state by its first
        num_accepted[n] tokens (N host ints, 0..query_len), from the rows that replay recorded. Mutates the KDA
        conv and recurrent state of the step's slots only (padding rows replay nothing)."""
        n, bs = len(num_accepted), self.last_size
        self.num_accepted[:n].copy_(torch.tensor(list(num_accepted), dtype=torch.int64), non_blocking=True)
        self.num_accepted[n:bs].zero_()
        graph = self.replay_graphs.get(bs) if self.use_graphs else None
        if graph is None:  # eager: the forward registered its replay inputs (or run() re-registered the graph's)
            self._replay(bs)
        else:
            graph.replay()
        self.buffers.replay.clear()
