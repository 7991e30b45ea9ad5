"""Launch configurations of the fused KDA decode kernel (`ops/triton/kda_decode_kernel.py`, launched by
`kda_decode.py`): the `KdaConfig` variants a sweep compares, the original default (`legacy_config`) and the
per-program-count decode table (`default_config`).
Host-only: no Triton kernel here."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from tokenspeed.ops.triton._utils import next_pow2


class KdaConfig(NamedTuple):
    """Launch configuration of `_kda_decode_kernel` (the variants a sweep compares; `default_config` picks one).

    block_v: V columns of one state tile, a power of two <= BK = next_pow2(head_dim).
    chunked False (the original kernel): the grid has ceil(D / block_v) programs per (sequence, head), each holding
    one [BK, block_v] tile in registers through all its tokens; with several, every program recomputes the head's
    q / k conv and the last to finish writes their conv state (a counter).
    chunked True: one program per (sequence, head) walks its BK / block_v tiles. Decode (update_state): token by
    token, q / k / gate once, the tiles in a loop that Triton software-pipelines (num_stages - 1 tiles in flight
    through shared memory; num_stages 1: instead the next tile prefetched into registers by hand), each read from
    and written to the pool; the conv state advanced per token. Verify
    (update_state False): tile by tile through all tokens in registers, the next tile prefetched. (block_v = BK
    leaves one tile: the same launch as split.)
    num_warps: 1, 2, 4, 8 or 16. num_stages: Triton's num_stages (also the tile loop's); None: Triton's default, 3
    (the original launches passed none). hints: evict-first state loads and streaming (.cs) state stores.
    prefetch_state (chunked decode and the WY verify): each program starts with an L2 bulk prefetch of its head's
    state rows (sm_90), so the state streams in while the program computes q / k / gate or the window's key side
    (before the PDL wait under PDL), where the GPU and the pool's alignment allow it. Off by default: in decode on
    the H200 it cost 13% at 96 heads x 64 sequences, 9% at 32 x 64, 1% in the batch-4 / 16 decode step and nothing
    at batch 1 (benchmarks/README.md); not timed with WY.
    prefetch_tiles (with prefetch_state, chunked decode only): prefetch only the head's first prefetch_tiles V tiles
    (0: the whole head). Every resident program prefetching its whole 64 KB head (~1,700 programs on 132 SMs at 96
    heads x 64) asks for about twice the L2; the first tiles cover what the pipelined loop reads first.
    max_regs: Triton's `maxnreg` (registers per thread, a multiple of 8 in 24..255; None: the compiler's choice):
    more resident programs per SM for the streaming chunked decode, at the price of spills if set too low.
    preload (chunked decode, num_stages > 1): the head's first V tile loaded into registers before the q / k / gate
    work (and before the PDL wait), so it streams in while the program computes its token inputs instead of after;
    the other tiles go through the pipelined loop as before.
    window (split only; for several tokens per sequence: verify, replay, prompt tails): the conv window and weights
    carried in registers through the token loop and each next token's inputs loaded one token ahead, before this
    token's recurrence (`_split_window_tokens`); the plain loop's arithmetic (equal in the interpreter; on the
    H200 a few bf16-rounded conv outputs differ: 2.6e-4 on a replayed state, 2.4e-7 in fp32), 1.3-1.6x on 4-token
    verify windows (H200).
    wy (verify only: update_state False, no step_states / seq_lens): the chunk form, one program per (sequence,
    head), the window's key side once and one state product per token and V tile of block_v
    (`kda_verify_wy.py`); 2.0-2.2x over the window loop from 16 sequences. A launch it cannot run takes this
    config's split form (so `MULTI_TABLE`'s WY rows set window too).
    gluon (chunked decode): the Gluon kernel of `kda_decode_gluon.py` where it can run the launch (sm_90, Triton
    3.6, one token per sequence, [V, K] pools; its `unusable_reason`), else this config's Triton form (gluon
    dropped). Its num_stages is the number of [block_v, D] shared-memory buffers (None: the whole head), all
    filled from the program's first instruction, before the PDL wait.
    keys_pass (with wy, when the caller bounds every sequence by the window: `max_seq_tokens`): the WY form in two
    launches, the window's key side per (sequence, head) into fp32 scratch, then (V tile, sequence, head) programs
    that only stream the state (`kda_verify_keys.py`); 1.05-1.2x over the one-launch form from 4 sequences x 32 heads
    on the H200 (the default from 96 pairs), slower at 32 x 1 (13.1 vs the window loop's 9.8 us). The replay
    (`kda_replay_layers`) runs any wy config in its own two launches (`kda_replay_wy.py`).
    """

    block_v: int
    chunked: bool = False
    num_warps: int = 4
    num_stages: int | None = None
    hints: bool = False
    prefetch_state: bool = False
    window: bool = False
    wy: bool = False
    keys_pass: bool = False
    prefetch_tiles: int = 0
    max_regs: int | None = None
    preload: bool = False
    gluon: bool = False

    @property
    def label(self) -> str:
        sched = "chunked" if self.chunked else "split"
        s = f"bv{self.block_v}-{sched}-w{self.num_warps}"
        s += f"-s{self.num_stages}" if self.num_stages is not None else ""
        return s + ("-hints" if self.hints else "") + (f"-pf{self.prefetch_tiles or ''}" if self.prefetch_state else "") + (
            "-pl" if self.preload else "") + (
            "-win" if self.window else "") + ("-wy" if self.wy else "") + ("-kp" if self.keys_pass else "") + (
            f"-r{self.max_regs}" if self.max_regs else "") + ("-gl" if self.gluon else "")


def legacy_config(num_programs_nh: int, head_dim: int) -> KdaConfig:
    """The original default: split V, one tile per program; a whole (padded) head below head dim 64, else [K, 32]
    tiles when there are too few (sequence, head) pairs to fill 132 SMs (< 96) and [K, 64] tiles otherwise
    (H200, benchmarks/results/kernels_h200.json: 385 us = 49% of HBM on the state at 96 heads x batch 64)."""
    if head_dim < 64:
        return KdaConfig(next_pow2(head_dim))  # the whole (padded) head in one program
    return KdaConfig(_fit_bv(32 if num_programs_nh < 96 else 64, head_dim))


# Decode (one token per sequence) configurations by program count N * H (N * H * L for the multi-layer replay):
# the last row whose bound is <= the count applies. Written for head dim 128; other head dims adapt block_v with
# `_fit_bv`. To be set from benchmarks/kda_decode_sweep_h200.py (H200); until then a prediction.
DECODE_TABLE: tuple[tuple[int, KdaConfig], ...] = (
    (0, KdaConfig(16)),                                  # under 32 pairs: split V over 8 programs per head
    (32, KdaConfig(32)),                                 # few heads: split V over 4 programs (latency-bound)
    (64, KdaConfig(32, chunked=True, num_stages=3)),     # one program per head, pipelined tiles
    (512, KdaConfig(16, chunked=True, num_stages=4)),    # many heads: narrower tiles, one more in flight
    (4096, KdaConfig(8, chunked=True, num_stages=4)),    # the most heads: 4 KB tiles
)
# From 64 pairs, where it can run (sm_90, Triton 3.6, one token per sequence, [V, K] pools), the Gluon decode
# (`kda_decode_gluon.py`: the head's state copies issued first) by the same rule; a launch it cannot take runs
# DECODE_TABLE's row. Its num_stages: shared-memory buffers of [block_v, D] (None: the whole head).
GLUON_DECODE_TABLE: tuple[tuple[int, KdaConfig], ...] = (
    (64, KdaConfig(32, chunked=True, gluon=True)),                  # the whole head in shared memory (64 KB)
    (512, KdaConfig(16, chunked=True, num_stages=4, gluon=True)),   # a ring of 4 tiles of 8 KB
    (1024, KdaConfig(32, chunked=True, num_stages=2, gluon=True)),  # a ring of 2 tiles of 16 KB
    (4096, KdaConfig(8, chunked=True, num_stages=4, gluon=True)),   # a ring of 4 tiles of 4 KB
)
# From the H200 sweep at ac403b0 ([V, K] pools, fused norm, cold L2 below 120 MB;
# results/kda_decode_sweep_h200_gluon_ac403b0.json), the Gluon row vs DECODE_TABLE's: 32 x 2 8.45 vs 10.25 us,
# 32 x 4 10.21 vs 11.80, 32 x 8 14.34 vs 15.36, 32 x 16 22.98 vs 24.71 (BV 8 / 4 buffers 22.97), 96 x 16 59.98 vs
# 63.42 (BV 8 / 8 buffers 59.71), 32 x 64 76.75 vs 80.78, 96 x 64 214.50 vs 221.47 us = 87.9 vs 85.2% of HBM (BV 8
# / 8 buffers 213.70 = 88.3%).
GLUON_ENV = "TOKENSPEED_KDA_GLUON"  # read per call: "0" keeps decode launches on DECODE_TABLE (A/B timing)
# From the H200 sweep (benchmarks/kda_decode_sweep_h200.py, results/kda_decode_sweep_h200.json, graph replay):
# 32 heads x 1: split BV 32 6.06 us vs chunked 6.98; 32 x 8: chunked 9.71 us vs split BV 64 15.87 (81% of HBM);
# 32 x 16: 17.1 vs 31.4 (92%); 96 x 64: 245 us vs 390 (77%; fla's fused_recurrent_kda 253 us). With the fused
# output norm, cold L2 (dc34ac2): 32 x 2 (64 pairs) chunked 9.04 vs split 10.66 us, 96 x 1 10.43 vs 11.84, but
# 32 x 1 9.32 vs 8.92 and 12 x 1 9.07 vs 8.69, so the chunked row starts at 64 pairs (was 128). On the [V, K]
# pools (7b6bd82, fused norm, cold L2): 12 x 1 (K3's TP8 rank) split BV 16 7.89 us vs BV 32 8.42; 32 x 1 BV 32
# 8.55 vs BV 16 8.74, so BV 16 below 32 pairs. From 1024 pairs BV 16 / 4 stages (3f6f223, [V, K] pools): 32 x 64
# 80.4 vs 81.9 us, 96 x 16 63.2 vs 63.2, 96 x 64 225.4 vs 227.7 (83.7% of HBM; BV 8 / 4 stages 224.3). From 512 pairs
# (was 1024; da2090b+, fused norm, cold L2): 32 x 16 BV 16 / 4 stages 25.3 us vs BV 32 / 3 stages 28.6 (BV 32 capped at
# 128 registers 25.3), 32 x 8 16.6 vs 15.9 (so not lower); the batch-16 decode step 8.885 vs 8.949 ms (x1.007).
# From 4096 pairs BV 8 / 4 stages (8350e11, the conv window shifted before the tiles, [V, K] pools, three runs at 96 x
# 64): 221.9 / 222.9 / 220.9 us = 85.0 / 84.6 / 85.4% of HBM against BV 16 / 4 stages 223.7 / 224.3 / 222.8 us; at
# 2048 pairs (32 x 64) BV 16 stays ahead (80.7 vs 82.6 us), so the row starts between them.
# Not kept (no shape gained): L2 prefetch of a head's first tiles only, registers capped below 128, the first tile
# preloaded before the token inputs (results/kda_decode_sweep_h200_{pftiles,regs,preload}_*.json).


# Several tokens per sequence (verify windows, the replay, prompt tails), by program count N * H like DECODE_TABLE:
# the split loop with the conv window carried in registers, and from 96 pairs the WY verify form in its two launches
# (key pass, then state tiles; one launch when the caller does not bound the window, `max_seq_tokens`). A launch
# the WY kernels cannot run (committing tails, the replay) takes the same row's split form, so the WY row carries the
# window flag too. H200, 4-token verify windows, fused norm, [V, K] pools (f4e39a1 + the [TW, D] weight rows,
# benchmarks/README.md): 32 heads x 1: window 9.76 us, two-launch WY 13.1, one-launch WY 17.7; 32 x 4: two-launch
# BV 16 15.6 vs one-launch BV 32 18.1; 32 x 64: 104.1 vs 106.8 (BV 16); 96 x 16: 79.5 vs 87.1; 96 x 64: 286.7 vs
# 299.7, window 710.6.
MULTI_TABLE: tuple[tuple[int, KdaConfig], ...] = (
    (0, KdaConfig(32, window=True)),
    (96, KdaConfig(16, window=True, wy=True, keys_pass=True)),
)

# The KDA replay's WY form (`kda_replay_wy.py`, taken from MULTI_TABLE's WY row when the caller bounds the window)
# tiles V by its own block_v: H200, 20 layers x 32 heads, 3 of 4 tokens replayed (benchmarks/README.md): 4 / 16 /
# 64 sequences 242 / 784 / 2562 us at BV 32 vs 243 / 785 / 2642 at BV 16 and 256 / 849 / 2773 at BV 64 (6a0daa4);
# 1 / 2 / 4 sequences 146 / 169 / 238 us at BV 32 vs 158 / 190 / 253 at BV 64 and 201 / 180 / 234 at BV 16
# (6c2f592). The window loop it replaced: 278 / 781 / 2588 / 9489 us at 1 / 4 / 16 / 64 sequences.
REPLAY_WY_BLOCK_V = 32

DECODE_ENV = "TOKENSPEED_KDA_DECODE"  # read per call: a `KdaConfig.label` every decode launch takes (A/B timing)
MULTI_ENV = "TOKENSPEED_KDA_VERIFY"  # the same for launches of several tokens per sequence (verify, replay, tails)
_LABEL = re.compile(r"bv(\d+)-(split|chunked)-w(\d+)(?:-s(\d+))?(-hints)?(-pf(\d*))?(-pl)?(-win)?(-wy)?(-kp)?(?:-r(\d+))?(-gl)?")


def config_from_label(label: str) -> KdaConfig:
    """The KdaConfig whose `label` is `label` (e.g. "bv128-split-w8", "bv32-chunked-w4-s3"); ValueError else."""
    m = _LABEL.fullmatch(label.strip())
    if m is None:
        raise ValueError(f"{label!r} is not a KDA decode config label such as bv32-split-w4 or bv32-chunked-w4-s3")
    bv, sched, warps, stages, hints, pf, pf_tiles, pl, win, wy, kp, regs, gl = m.groups()
    return KdaConfig(int(bv), chunked=sched == "chunked", num_warps=int(warps),
                     num_stages=int(stages) if stages else None, hints=bool(hints), prefetch_state=bool(pf),
                     window=bool(win), wy=bool(wy), keys_pass=bool(kp), prefetch_tiles=int(pf_tiles or 0),
                     max_regs=int(regs) if regs else None, preload=bool(pl), gluon=bool(gl))


def default_config(num_programs_nh: int, head_dim: int, tokens_per_seq: int = 1, gluon: bool = True) -> KdaConfig:
    """The launch configuration for `num_programs_nh` = N * H (sequence, head) pairs (times L layers for the
    replay), head dim `head_dim` and `tokens_per_seq` = ceil(T / N). Decode (1 token) reads `DECODE_TABLE`
    (or the label in the DECODE_ENV variable, block_v fitted to head_dim); several tokens per sequence (verify,
    replay, prompt tails) read `MULTI_TABLE` or the label in MULTI_ENV (a launch that cannot run `wy` drops it:
    `kda_decode`, `kda_replay_layers`); head dims below 64 keep `legacy_config`. Decode takes GLUON_DECODE_TABLE's
    row from its first bound unless `gluon` is False (a launch the Gluon kernel cannot run) or GLUON_ENV is "0";
    without `gluon` a forced label loses its gluon flag too."""
    if head_dim < 64:
        return legacy_config(num_programs_nh, head_dim)
    if tokens_per_seq > 1:
        forced = os.environ.get(MULTI_ENV, "").strip()
        cfg = config_from_label(forced) if forced else _row(MULTI_TABLE, num_programs_nh)
        return cfg._replace(block_v=_fit_bv(min(cfg.block_v, next_pow2(head_dim)), head_dim))
    forced = os.environ.get(DECODE_ENV, "").strip()
    if forced:
        cfg = config_from_label(forced)
        cfg = cfg if gluon else cfg._replace(gluon=False)
        return cfg._replace(block_v=_fit_bv(min(cfg.block_v, next_pow2(head_dim)), head_dim))
    if gluon and num_programs_nh >= GLUON_DECODE_TABLE[0][0] and os.environ.get(GLUON_ENV, "").strip() != "0":
        cfg = _row(GLUON_DECODE_TABLE, num_programs_nh)
    else:
        cfg = _row(DECODE_TABLE, num_programs_nh)
    return cfg._replace(block_v=_fit_bv(min(cfg.block_v, next_pow2(head_dim)), head_dim))


def _row(table: tuple[tuple[int, KdaConfig], ...], num_programs_nh: int) -> KdaConfig:
    """The config of the last row of `table` whose bound is <= num_programs_nh."""
    cfg = table[0][1]
    for bound, row in table:
        if num_programs_nh >= bound:
            cfg = row
    return cfg


def replay_wy_block_v(head_dim: int) -> int:
    """The WY replay's V tile for `head_dim` (REPLAY_WY_BLOCK_V, at most the head dim)."""
    return _fit_bv(min(REPLAY_WY_BLOCK_V, next_pow2(head_dim)), head_dim)


def _fit_bv(target: int, head_dim: int) -> int:
    """A power-of-two V block near `target` (a power of two <= head_dim) for head_dim: `target` when it divides
    head_dim (always, for a power-of-two head_dim >= target), else the largest power of two dividing head_dim
    if that is at least 16 (no masked tail), else `target` (the last of ceil(head_dim / target) blocks masked)."""
    if head_dim % target == 0:
        return target
    div = head_dim & -head_dim  # largest power of two dividing head_dim
    return div if div >= 16 else target
