"""The Kimi causal LM (K3 text model and Kimi Linear): embedding, decoder stack, final mix/norm, lm_head.

Module names mirror the checkpoint (`model.embed_tokens`, `model.layers.{l}`, `model.norm`, `lm_head`), so a
parameter's path is its checkpoint name (after the `language_model.` prefix of a kimi_k3 checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.kimi.attn_res import ResidualStream, depth_query, mix_and_norm
from tokenspeed.models.kimi.decoder import DecoderLayer
from tokenspeed.models.layers import Linear, RMSNorm, weight


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = weight((vocab, hidden), dtype, device)

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight[ids]


class KimiModel(nn.Module):
    """Embedding + decoder stack + final (AttnRes-mixed) norm. Returns final hidden states [T, hidden]."""

    def __init__(self, config: KimiConfig, parallel: ParallelContext, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, d, dtype, device)
        mla_index = {layer: i for i, layer in enumerate(config.mla_layers)}
        kda_index = {layer: i for i, layer in enumerate(config.kda_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, mla_index.get(i, kda_index.get(i, -1)), parallel, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        if config.uses_attn_res:
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            self.output_attn_res_proj = Linear(d, 1, dtype, device)

    def forward(
        self, batch: ForwardBatch, cache: CacheBuffers, capture_layers: Sequence[int] = ()
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Run all layers over the batch; mutates the cache (new MLA rows, advanced KDA states).

        capture_layers: 1-based layers after which to capture a target feature for an EAGLE3 draft (duplicates
        allowed): the AttnRes partial sum P (K3) or the residual stream h (plain residual). When given, returns
        (hidden, features) with one [T, hidden] tensor per entry, in the order asked.
        """
        embeddings = self.embed_tokens(batch.input_ids)
        c = self.config
        wanted = _capture_slots(capture_layers, c.num_hidden_layers)
        captured: list[Tensor] = [embeddings] * len(capture_layers)
        if c.attn_res_block_size is None:
            first_norm = self.layers[0].input_layernorm if len(self.layers) else self.norm
            hidden, x = embeddings, first_norm(embeddings)
            for i, layer in enumerate(self.layers):
                norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                hidden, x = layer.forward_plain(hidden, x, batch, cache, norm)  # h += Attn, FFN; next input norm
                for slot in wanted.get(i, ()):
                    captured[slot] = hidden
            out = x
        else:
            stream = ResidualStream.start(embeddings, math.ceil(c.num_hidden_layers / c.attn_res_block_size))
            for i, layer in enumerate(self.layers):
                layer.forward_attn_res(stream, batch, cache)
                for slot in wanted.get(i, ()):
                    captured[slot] = stream.partial
            query = depth_query(self.output_attn_res_norm, self.output_attn_res_proj)
            out = mix_and_norm(stream, query, c.rms_norm_eps, self.norm)
        return (out, tuple(captured)) if capture_layers else out


def _capture_slots(capture_layers: Sequence[int], num_layers: int) -> dict[int, list[int]]:
    """{0-based layer: [output slots]} for 1-based `capture_layers` (each in 1..num_layers)."""
    slots: dict[int, list[int]] = {}
    for slot, layer in enumerate(capture_layers):
        if not 1 <= layer <= num_layers:
            raise ValueError(f"capture layer {layer} is outside 1..{num_layers} (1-based, after that layer)")
        slots.setdefault(layer - 1, []).append(slot)
    return slots


class KimiForCausalLM(nn.Module):
    """The model plus its (untied unless the config ties it) lm_head."""

    def __init__(
        self,
        config: KimiConfig,
        parallel: ParallelContext | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.dtype = dtype
        self.model = KimiModel(config, self.parallel, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def warm_up_token_counts(self, max_tokens: int) -> list[int]:
        """Token counts up to max_tokens at which a kernel of this model's forward changes launch variant with the
        step's row count (the routed experts' tiles: `ops.moe_variant_token_counts`); the engine's warm-up runs a
        prompt of each length."""
        shapes = {(*m.experts_launch_shape(), m.w1.dtype) for m in self.modules() if hasattr(m, "experts_launch_shape")}
        counts: set[int] = set()
        for k, E, D, DI, dtype in shapes:
            counts.update(ops.moe_variant_token_counts(k, E, D, DI, max_tokens, dtype))
        return sorted(counts)

    def warm_attention_plans(self, max_q: int, max_kv: int) -> int:
        """Build the attention plans the expanded MLA form can meet for chunks of up to max_q new tokens on up to
        max_kv keys (`ops.mla_expanded_warm_plans`: cuDNN's, per length bucket); returns the calls made."""
        shapes = {(m.num_heads, m.nope + m.rope, m.v_dim) for m in self.modules() if hasattr(m, "_expand_per_head")}
        return sum(ops.mla_expanded_warm_plans(*s, max_q, max_kv, self.dtype, self.device) for s in sorted(shapes))

    def _kda_replay_layers(self, cache: CacheBuffers) -> list[ops.KdaLayerTensors]:
        """Every KDA layer's replay tensors (`KDAAttention.replay_tensors`), in layer order (host only)."""
        return [layer.self_attn.replay_tensors(cache) for layer in self.model.layers
                if hasattr(layer.self_attn, "replay_tensors")]

    def _committed_rows(self, cache: CacheBuffers) -> frozenset[int]:
        """The batch rows whose KDA state the recorded verification committed (the same in every KDA layer)."""
        return frozenset(next((rec.committed for rec in cache.replay.values()), ()))

    def kda_replay_table(self, cache: CacheBuffers) -> ops.KdaLayerTable | None:
        """The layer table of a KDA state replay of the verification now recorded in `cache.replay` (None when the
        model has no KDA layer). Host work plus one small host -> device copy: build it outside CUDA-graph capture
        (a verify graph's recorded inputs keep their addresses, so one table per captured size serves every
        replay) and pass it to `replay_kda`."""
        layers = self._kda_replay_layers(cache)
        return ops.KdaLayerTable.build(layers) if layers else None

    def replay_kda(self, cache: CacheBuffers, batch: ForwardBatch, num_accepted: Sequence[int] | Tensor,
                   table: ops.KdaLayerTable | None = None) -> None:
        """After a verify forward of `batch`: advance every KDA layer's committed state of each sequence by its
        first num_accepted[n] tokens (N host ints, or an [N] int64 device tensor: then no host work, graph-safe),
        from the inputs the verification recorded (`cache.replay`, consumed): one `ops.kda_replay_layers` over all
        KDA layers (one launch on CUDA when the layers are uniform). `table`: a prebuilt `kda_replay_table` of the
        same recorded tensors (required inside CUDA-graph capture; ValueError if it was built from others);
        None builds one now. Rows the verification already committed (`ReplayInputs.committed`: prompt chunks of
        the chunked scan) apply no token, whatever num_accepted says."""
        layers = self._kda_replay_layers(cache)
        if not layers:
            return
        if table is None:
            table = ops.KdaLayerTable.build(layers)
        elif not table.matches(layers):
            raise ValueError("the KDA replay table was built from other tensors than the recorded verification's")
        committed = self._committed_rows(cache)
        if committed and isinstance(num_accepted, Tensor):
            raise ValueError("a verification that committed prompt rows is replayed from host counts only")
        accepted = num_accepted if isinstance(num_accepted, Tensor) else torch.tensor(
            [0 if n in committed else a for n, a in enumerate(num_accepted)], dtype=torch.int64,
            device=batch.cu_seqlens.device)
        ops.kda_replay_layers(table, batch.kda_slots, batch.cu_seqlens, accepted,
                              lower_bound=self.config.gate_lower_bound, state_v_first=cache.kda_state_v_first,
                              max_seq_tokens=batch.uniform_query_len)
        for layer in self.model.layers:
            if hasattr(layer.self_attn, "replay_tensors"):
                cache.replay.pop(layer.self_attn.cache_index)

    def forward(
        self,
        batch: ForwardBatch,
        cache: CacheBuffers,
        logits_indices: Tensor | None = None,
        capture_layers: Sequence[int] = (),
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Logits [T or len(logits_indices), vocab] fp32 (the head runs in the model dtype, as the reference).

        With capture_layers (1-based, see KimiModel.forward) returns (logits, features): the features cover all T
        tokens of the batch, whatever logits_indices selects.
        """
        if capture_layers:
            hidden, features = self.model(batch, cache, capture_layers)
        else:
            hidden, features = self.model(batch, cache), None
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        logits = self.lm_head(hidden).float()
        return logits if features is None else (logits, features)
