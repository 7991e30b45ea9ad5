"""Launch configurations of the routed-experts kernels (`ops/triton/moe_experts.py`): `ExpertsConfig`, the tile
choice per shape (`default_config`, from the H200 sweeps it cites) and its checks. Host-only: no Triton kernel."""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton


@dataclass(frozen=True)
class ExpertsConfig:
    """Launch configuration: the M-block (rows per expert block) and each kernel's tiles, warps and stages, plus
    the prefill variants (program order, a smaller down M-block, a pre-gathered x, TMA loads) and the decode
    threshold of the align-free direct mode; see the module docstring for what each moves. A TMA flag on a call whose tensors a descriptor cannot describe (a non-contiguous
    weight, a row stride that is not a multiple of 16 bytes) falls back to pointer loads."""

    block_m: int = 16
    block_n1: int = 64
    block_k1: int = 128
    num_warps1: int = 4
    num_stages1: int = 4
    block_n2: int = 64
    block_k2: int = 128
    num_warps2: int = 4
    num_stages2: int = 4
    # Prefill variants, all off by default (the defaults compile to the kernels measured before they existed):
    group_m1: int = 0  # > 0: 1-D grid, groups of this many M-blocks sweep all N tiles before the next group
    group_m2: int = 0  # the same for the down GEMM
    block_m2: int = 0  # rows per down-GEMM program (0: block_m); divides block_m, all-padding sub-blocks exit
    gather_x: bool = False  # copy x into expert-sorted padded rows first, so the gate/up A tiles are plain tiles
    tma1: bool = False  # gate/up: W1 / W3 (and the sorted x copy) through host TMA descriptors
    tma2: bool = False  # down: h and W2 through host TMA descriptors
    tail_m1: bool = False  # gate/up: a block whose second half is padding runs a block_m / 2 row tile
    tail_m2: bool = False  # the same for the down GEMM (on its block_m2 blocks)
    # Decode: calls of T <= direct_max_tokens tokens skip the alignment (block p = pair p; see the module docstring).
    direct_max_tokens: int = 0
    # PDL launches (pointer loads): the down kernel L2-prefetches its W2 rows before its wait (`moe_pdl`).
    prefetch_w2: bool = True


# Calls of up to this many tokens take the align-free direct mode under `default_config` (decode-sized calls only).
DIRECT_MAX_TOKENS = 4


def default_config(T: int, k: int, E: int, D: int, DI: int, elt_size: int = 2) -> ExpertsConfig:
    """Pick tiles from the average rows per expert (T * k / E) and the grid size.

    Decode (<= 16 rows per expert, e.g. T <= 64 at E=256, k=8): BLOCK_M=16 so every touched expert streams its
    weights once; [16 x 64] tiles, BLOCK_K=128, 4 stages (3 buffers, ~110 KB of shared memory for kernel 1,
    two programs per SM). When fewer than ~264 programs would run (T=1 at k=8) on a wide layer, a narrower BLOCK_N=32
    doubles the programs streaming weights. Prefill: BLOCK_M 32 / 64 / 128 as the expert runs grow. Above 32 rows
    per expert the 16-bit tiles take the variants that won the H200 sweep (benchmarks/moe_prefill_h200.py,
    results/moe_prefill_h200.json, 8K tokens): grouped program order and TMA loads in both GEMMs, and from 128 rows
    up 128-row blocks with half-height gate/up tails and 128 x 256 x 64 down tiles in 3 stages. kimi-linear-48b-a3b
    (256 rows per expert) 2.42 vs 3.10 ms for the tiles before (1.28x), k3-slice 16.2 vs 20.9 ms. The tiles
    underneath were the fastest of five plain tile choices in an earlier sweep: 64 x 256 x 64 for 32..256 rows per expert (kimi-linear-48b-a3b, 8K tokens: 3.56 vs 4.09 ms for the previous
    64 x 128), 128 x 128 x 64 with 4 stages above (k3-slice, 8K tokens: 21.3 vs 23.1 ms). fp32 (validation only)
    keeps the smaller 64 x 128 / 128 x 64 prefill tiles and drops to 2 stages so the tiles fit in shared memory.
    The decode tiles come with direct_max_tokens = DIRECT_MAX_TOKENS: calls of up to 4 tokens skip the alignment
    launch (the direct mode, same tiles, bit-identical results).
    """
    rows = T * k / max(E, 1)
    if rows <= 16:
        cfg = ExpertsConfig(16, 64, 128, 4, 4, 64, 128, 4, 4)
    elif rows <= 32:
        cfg = ExpertsConfig(32, 64, 128, 4, 4, 64, 128, 4, 4)
    elif elt_size > 2:  # fp32: the 16-bit prefill tiles would not fit in shared memory
        cfg = ExpertsConfig(64, 128, 64, 8, 3, 128, 64, 4, 4) if rows <= 256 else ExpertsConfig(
            128, 64, 64, 8, 3, 128, 64, 8, 3)
    elif rows <= 128:  # 64 x 256 tiles; grouped program order and TMA loads in both GEMMs, 4-stage down
        cfg = ExpertsConfig(64, 256, 64, 8, 3, 256, 64, 8, 4, group_m1=8, group_m2=8, tma1=True, tma2=True)
    else:  # 128-row blocks, half-height tails for gate/up, 128 x 256 x 64 down tiles in 3 stages
        cfg = ExpertsConfig(128, 128, 64, 8, 4, 256, 64, 8, 3, group_m1=8, group_m2=8, tma1=True, tma2=True,
                            tail_m1=True)
    if rows <= 16:
        cfg = replace(cfg, direct_max_tokens=DIRECT_MAX_TOKENS)
    P = T * k
    max_blocks = P // cfg.block_m + min(E + 1, P)
    if DI >= 512 and max_blocks * triton.cdiv(DI, cfg.block_n1) < 264:
        cfg = replace(cfg, block_n1=32)
    if D >= 512 and max_blocks * triton.cdiv(D, cfg.block_n2) < 264:
        cfg = replace(cfg, block_n2=32)
    if elt_size > 2:
        cfg = replace(cfg, num_stages1=min(cfg.num_stages1, 2), num_stages2=min(cfg.num_stages2, 2))
    return cfg


def _check_config(cfg: ExpertsConfig) -> None:
    bm, bm2 = cfg.block_m, cfg.block_m2 or cfg.block_m
    tiles = (bm, bm2, cfg.block_n1, cfg.block_k1, cfg.block_n2, cfg.block_k2)
    if any(b < 16 or b & (b - 1) for b in tiles):
        raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot); got {cfg}")
    if bm2 > bm:
        raise ValueError(f"block_m2 must divide block_m (a down block stays inside one expert block); got {cfg}")
    if cfg.group_m1 < 0 or cfg.group_m2 < 0:
        raise ValueError(f"group_m1 / group_m2 must be >= 0; got {cfg}")
    if (cfg.tail_m1 and bm < 32) or (cfg.tail_m2 and bm2 < 32):
        raise ValueError(f"a half-block tail needs an M-block of at least 32 rows; got {cfg}")
    if cfg.direct_max_tokens < 0:
        raise ValueError(f"direct_max_tokens must be >= 0; got {cfg}")


def variant_token_counts(k: int, E: int, D: int, DI: int, max_tokens: int, elt_size: int = 2) -> list[int]:
    """The token counts T in 1..max_tokens where the routed-experts launch `default_config` picks (with the direct
    mode's T <= direct_max_tokens) changes from T - 1's: a call at each T compiles every kernel variant the default
    tiles take up to max_tokens rows (the engine's warm-up runs one prompt of each length). Host-only."""
    counts, last = [], None
    for T in range(1, max_tokens + 1):
        cfg = default_config(T, k, E, D, DI, elt_size)
        key = (cfg, T <= cfg.direct_max_tokens)
        if key != last:
            counts.append(T)
            last = key
    return counts
