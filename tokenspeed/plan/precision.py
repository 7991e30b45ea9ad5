"""Byte rates of the weight formats and cache dtypes the planner knows, and the byte units it prints.

Weight formats (bytes of one stored matrix, scales included; `tensor_bytes` is exact, `bytes_per_param` the
nominal rate for large matrices):

- `bf16` 2 B/param; `fp32` 4 B/param.
- `fp8`: e4m3 with one fp32 scale per 128x128 block (the NVIDIA NVFP4 checkpoint's "FP8_PB_WO" attention
  projections) -> 1 + 4/128**2 = 1.000244 B/param.
- `nvfp4`: e2m1 (0.5 B) + one fp8 e4m3 scale per 16 inputs (1/16 B) = 0.5625 B/param, plus one fp32 global scale
  per matrix.
- `mxfp4`: e2m1 (0.5 B) + one UE8M0 scale per 32 inputs (1/32 B) = 0.53125 B/param (the official checkpoint's
  routed experts).

Vectors (norm gains, biases) are never quantized: they keep their storage dtype (bf16 or fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed.errors import ConfigError

KB, MB, GB = 10**3, 10**6, 10**9
KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class WeightFormat:
    """How a [rows, cols] matrix (rows = outputs, cols = inputs) is stored.

    element_bits: bits of one quantized value.
    group: inputs sharing one scale along a row (0: no group scales); group_scale_bytes: bytes of one such scale.
    block: edge of the square block sharing one scale (0: none); block_scale_bytes: bytes of one block scale.
    tensor_scale_bytes: bytes of per-matrix scales (e.g. NVFP4's fp32 global scale).
    """

    name: str
    element_bits: int
    group: int = 0
    group_scale_bytes: int = 0
    block: int = 0
    block_scale_bytes: int = 0
    tensor_scale_bytes: int = 0

    def bytes_per_param(self) -> float:
        """Nominal bytes per parameter of a large matrix (per-matrix scales ignored)."""
        rate = self.element_bits / 8
        if self.group:
            rate += self.group_scale_bytes / self.group
        if self.block:
            rate += self.block_scale_bytes / self.block**2
        return rate

    def tensor_bytes(self, rows: int, cols: int) -> int:
        """Exact bytes of one [rows, cols] matrix: values + scales (partial groups/blocks round up)."""
        total = rows * cols * self.element_bits
        assert total % 8 == 0, f"{self.name}: {rows}x{cols} is not a whole number of bytes"
        total //= 8
        if self.group:
            total += rows * -(-cols // self.group) * self.group_scale_bytes
        if self.block:
            total += -(-rows // self.block) * -(-cols // self.block) * self.block_scale_bytes
        return total + self.tensor_scale_bytes


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 32),
    "bf16": WeightFormat("bf16", 16),
    "fp8": WeightFormat("fp8", 8, block=128, block_scale_bytes=4),
    "nvfp4": WeightFormat("nvfp4", 4, group=16, group_scale_bytes=1, tensor_scale_bytes=4),
    "mxfp4": WeightFormat("mxfp4", 4, group=32, group_scale_bytes=1),
}
QUANTIZED_FORMATS = ("nvfp4", "mxfp4", "fp8", "bf16")  # what a user may pick for a weight component

# Element sizes of cached values and activations.
DTYPE_BYTES: dict[str, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
KV_CACHE_DTYPES = ("fp8", "bf16", "fp32")  # fp32: the CPU engine's float32 models
KDA_STATE_DTYPES = ("fp32", "bf16")


def weight_format(name: str) -> WeightFormat:
    """The format named `name`; ConfigError listing the known ones otherwise."""
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown weight format {name!r}; known: {', '.join(WEIGHT_FORMATS)}") from None


def dtype_bytes(name: str, allowed: tuple[str, ...] | None = None) -> int:
    """Bytes of one element of dtype `name` (fp8 1, bf16 2, fp32 4); ConfigError if not in `allowed`."""
    if name not in DTYPE_BYTES or (allowed is not None and name not in allowed):
        raise ConfigError(f"unsupported dtype {name!r}; choose one of: {', '.join(allowed or tuple(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def fmt_bytes(n: float, unit: str = "auto") -> str:
    """Human form of a byte count: '173.060 GB', '49.000 MiB', ... ('auto' picks GB/MB/KB, decimal)."""
    units = {"B": 1, "KB": KB, "MB": MB, "GB": GB, "KiB": KiB, "MiB": MiB, "GiB": GiB}
    if unit == "auto":
        unit = next((u for u in ("GB", "MB", "KB") if abs(n) >= units[u]), "B")
    if unit == "B":
        return f"{int(n):,} B"
    return f"{n / units[unit]:.3f} {unit}"
