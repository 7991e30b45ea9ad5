"""The per-layer tensors of a multi-layer KDA launch (`ops.kda_replay_layers`) and their device offset table.

One launch over L layers addresses layer l's tensor of each kind as layer 0's tensor + a per-layer element offset:
`offsets[l, j] = (t_l.data_ptr() - t_0.data_ptr()) // t_0.element_size()` for the j-th kind in `LAYER_FIELDS`.
That is only valid when the L tensors of a kind have the same shape, strides, dtype and device and every byte
distance is a whole number of elements (checked on the host, `layer_offsets`). The table is plain torch (no
Triton import) and is built once, outside any CUDA-graph capture, then reused by every launch over the same
tensors (a captured replay graph reads it by address).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class KdaLayerTensors(NamedTuple):
    """One KDA layer's arguments of `ops.kda_decode`, in its positional order (see its contract): the recorded
    inputs qkv [T, 3HD], f [T, H, D] or [T, HD], b [T, H] (views of a merged projection as recorded: any row
    stride, unit column stride, read in place); the weights conv_weight [3HD, 4], A_log [H],
    dt_bias [H, D]; the pools conv_state [S, 3HD, 3] and state [S, H, D, D] fp32 (mutated by a replay)."""

    qkv: Tensor
    f: Tensor
    b: Tensor
    conv_weight: Tensor
    conv_state: Tensor
    A_log: Tensor
    dt_bias: Tensor
    state: Tensor


LAYER_FIELDS: tuple[str, ...] = KdaLayerTensors._fields  # the columns of the offset table, in this order


def layer_offsets(tensors: Sequence[Tensor], name: str = "tensor") -> list[int]:
    """Element offsets of tensors[l] from tensors[0] ([0, ...]). Raises ValueError unless all have the same
    shape, strides, dtype and device and every byte distance is a multiple of the element size."""
    t0 = tensors[0]
    out = []
    for i, t in enumerate(tensors):
        if (t.shape, t.stride(), t.dtype, t.device) != (t0.shape, t0.stride(), t0.dtype, t0.device):
            raise ValueError(f"{name} of layer {i} is {tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.device}; layer 0 "
                             f"is {tuple(t0.shape)}/{t0.stride()}/{t0.dtype}/{t0.device} (layers must be uniform)")
        delta = t.data_ptr() - t0.data_ptr()
        if delta % t0.element_size():
            raise ValueError(f"{name} of layer {i} is {delta} bytes from layer 0's, not a whole number of "
                             f"{t0.element_size()}-byte elements")
        out.append(delta // t0.element_size())
    return out


def _signature(layers: Sequence[KdaLayerTensors]) -> tuple:
    """What a table was built from: every tensor's address, shape and strides (host only)."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride()) for layer in layers for t in layer)


@dataclass(frozen=True, eq=False)
class KdaLayerTable:
    """L KDA layers for one multi-layer launch: `layers` (layer 0 is the base every offset is taken from) and
    `offsets` [L, len(LAYER_FIELDS)] int64 on layer 0's device, or None when the layers are not uniform (then
    `reason` says why and `ops.kda_replay_layers` launches per layer). Holds references to every tensor, so the
    addresses stay valid as long as the table lives. Build with `KdaLayerTable.build`."""

    layers: tuple[KdaLayerTensors, ...]
    offsets: Tensor | None
    reason: str | None
    signature: tuple

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def base(self) -> KdaLayerTensors:
        return self.layers[0]

    @classmethod
    def build(cls, layers: Sequence[KdaLayerTensors], *, strict: bool = False) -> KdaLayerTable:
        """The table of `layers` (at least one). Non-uniform layers give offsets None (strict: ValueError).

        Host work plus one small host -> device copy (through pinned memory on CUDA, no synchronisation): call it
        outside CUDA-graph capture and reuse the result for every launch over the same tensors.
        """
        layers = tuple(KdaLayerTensors(*layer) for layer in layers)
        if not layers:
            raise ValueError("a KDA layer table needs at least one layer")
        try:
            cols = [layer_offsets([layer[j] for layer in layers], name) for j, name in enumerate(LAYER_FIELDS)]
            devices = {t.device for t in layers[0]}
            if len(devices) != 1:
                raise ValueError(f"layer 0's tensors are on several devices: {sorted(map(str, devices))}")
        except ValueError as err:
            if strict:
                raise
            return cls(layers, None, str(err), _signature(layers))
        rows = torch.tensor(cols, dtype=torch.int64).t().contiguous()
        device = layers[0].qkv.device
        if device.type == "cuda":
            rows = rows.pin_memory()
        return cls(layers, rows.to(device, non_blocking=True), None, _signature(layers))

    def matches(self, layers: Sequence[KdaLayerTensors]) -> bool:
        """True when `layers` are the very tensors (addresses, shapes, strides) this table was built from."""
        return _signature(layers) == self.signature
