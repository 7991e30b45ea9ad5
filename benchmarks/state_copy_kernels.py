"""Copy kernels that move a KDA decode's state bytes with its access pattern and none of its arithmetic: where the
decode kernel's gap to the HBM rate comes from (benchmarks/kda_decode_sweep_h200.py times them beside it).

`state_rmw(state, slots, H, D, block_v, contiguous)` reads every (sequence, head) state of `slots` and writes it
back in place, one program per pair walking D / block_v tiles through a `num_stages` software pipeline, as the
chunked decode does:
- contiguous False: the decode kernel's tiles, [D (K rows), block_v (V columns)] of the [K, V] row-major head
  state: D pieces of block_v * 4 bytes, D * 4 bytes apart;
- contiguous True: the same bytes per tile as one contiguous block of D * block_v values (what a V-tile-major
  layout of the pool would give).
If the first runs near torch's copy, the pattern is not what caps the decode; if only the second does, the
layout is. `out` (a second pool of the same shape): the tiles are read from `state` and written to `out` instead of
in place (a ping-pong pool's pattern): does writing over the bytes just read cost by itself? `state_rmw_tma` walks
the contiguous tiles through a host TMA descriptor (the loads of the TMA decode tried at c230e20), written back by
plain stores (tma 1) or TMA stores (tma 2); `mini_decode` is the chunked decode's tile loop part by part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(numel: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, rand: bool = False):
    """A buffer made once per (size, device, dtype, kind) and reused: no allocation or fill inside a timed call."""
    key = (numel, str(device), dtype, rand)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = (torch.rand(numel, device=device) if rand else torch.zeros(numel, device=device)).to(dtype)
        _SCRATCH[key] = buf
    return buf


@triton.jit
def _state_rmw_kernel(S, OUT, SLOTS, stride_ss, X, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
                      CONTIG: tl.constexpr, STAGES: tl.constexpr, TPP: tl.constexpr = 0, PRE: tl.constexpr = 0):
    NT: tl.constexpr = D // BV
    SPAN: tl.constexpr = NT if TPP == 0 else TPP  # tiles a program walks
    PARTS: tl.constexpr = NT // SPAN
    pid = tl.program_id(0)
    pair = pid // PARTS
    part = pid % PARTS
    slot = tl.load(SLOTS + pair // H).to(tl.int64)
    bump = slot * 0
    for i in tl.static_range(PRE):  # PRE dependent loads of a 512-value row first (a decode's per-head inputs)
        xr = tl.load(X + (pair * PRE + i) * 512 + bump + tl.arange(0, 512)).to(tl.float32)
        # 0, but only known once the row has arrived; a multiple of 1024 so the tile addresses keep their alignment
        bump = (tl.sum(xr, axis=0) > 1e30).to(tl.int64) * 1024
    base = S + slot * stride_ss + (pair % H) * D * D + bump
    dst = OUT + slot * stride_ss + (pair % H) * D * D + bump
    rows = tl.arange(0, D)
    cols = tl.arange(0, BV)
    for j in tl.range(part * SPAN, part * SPAN + SPAN, num_stages=STAGES):
        if CONTIG:
            offs = j * D * BV + rows[:, None] * BV + cols[None, :]
        else:
            offs = rows[:, None] * D + j * BV + cols[None, :]
        tl.store(dst + offs, tl.load(base + offs) * 1.0)


@triton.jit
def _state_rmw_tma_kernel(SD, S, SLOTS, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, TMA: tl.constexpr,
                          STAGES: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.load(SLOTS + pid // H).to(tl.int64)
    row0 = (slot * H + pid % H) * D
    rows = tl.arange(0, BV)
    cols = tl.arange(0, D)
    for j in tl.range(0, D // BV, num_stages=STAGES):
        r = (row0 + j * BV).to(tl.int32)
        x = SD.load([r, 0]) * 1.0
        if TMA == 2:
            SD.store([r, 0], x)
        else:
            tl.store(S + (row0 + j * BV + rows[:, None]) * D + cols[None, :], x)


def state_rmw_tma(state: torch.Tensor, slots: torch.Tensor, H: int, D: int, block_v: int = 32, tma: int = 1,
                  num_stages: int = 3) -> None:
    """`state_rmw` of contiguous [block_v, D] row tiles read through a TMA descriptor of the pool (state: [S, H, D,
    D] contiguous fp32), written back by plain stores (tma 1) or TMA stores (tma 2). Values are unchanged."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (H, D, D):
        raise ValueError(f"state must be a contiguous fp32 [S, {H}, {D}, {D}] pool")
    desc = TensorDescriptor.from_tensor(state.view(-1, D), [block_v, D])
    _state_rmw_tma_kernel[(slots.numel() * H,)](desc, state, slots, H=H, D=D, BV=block_v, TMA=tma,
                                              STAGES=num_stages, num_warps=4)


def state_rmw(state: torch.Tensor, slots: torch.Tensor, H: int, D: int, block_v: int = 32,
              contiguous: bool = False, num_stages: int = 3, out: torch.Tensor | None = None,
              tiles_per_program: int = 0, pre_loads: int = 0, num_warps: int = 4) -> None:
    """Reads and rewrites in place (or into `out`, a pool like `state`) the [H, D, D] fp32 states of `slots`
    (state: [S, H, D, D] contiguous fp32; D a power of two, block_v dividing it). Values are unchanged.
    tiles_per_program (0: all D / block_v tiles of a head, as the chunked decode): each program walks that many
    consecutive tiles of one head (grid pairs x tiles / that, in address order). pre_loads: each program first
    makes that many dependent loads of a 1 KB row (a 0 added to the state addresses once each arrives), as the
    decode's per-head inputs come before its first tile."""
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (H, D, D):
        raise ValueError(f"state must be a contiguous fp32 [S, {H}, {D}, {D}] pool")
    if D & (D - 1) or D % block_v:
        raise ValueError(f"D ({D}) must be a power of two and block_v ({block_v}) must divide it")
    if out is not None and (out.shape != state.shape or out.dtype != state.dtype or not out.is_contiguous()):
        raise ValueError("out must be a contiguous pool of state's shape and dtype")
    nt = D // block_v
    span = tiles_per_program or nt
    if nt % span:
        raise ValueError(f"tiles_per_program ({tiles_per_program}) must divide the {nt} tiles of a head")
    x = _scratch(max(pre_loads, 1) * slots.numel() * H * 512, state.device)
    _state_rmw_kernel[(slots.numel() * H * (nt // span),)](
        state, state if out is None else out, slots, state.stride(0), x, H=H, D=D, BV=block_v, CONTIG=contiguous,
        STAGES=num_stages, TPP=tiles_per_program, PRE=pre_loads, num_warps=num_warps)


@triton.jit
def _mini_decode_kernel(S, SLOTS, stride_ss, X, O, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
                        STAGES: tl.constexpr, MATH: tl.constexpr, YV: tl.constexpr, OST: tl.constexpr,
                        PRE: tl.constexpr):
    """The chunked decode's tile loop on a [V, K] pool with its parts switched on one by one (`mini_decode`)."""
    NT: tl.constexpr = D // BV
    pid = tl.program_id(0)
    slot = tl.load(SLOTS + pid // H).to(tl.int64)
    ok = tl.arange(0, D)
    ov = tl.arange(0, BV)
    bump = slot * 0
    for i in tl.static_range(PRE):  # dependent loads first, as the decode's per-head inputs
        xr = tl.load(X + (pid * PRE + i) * 512 + bump + tl.arange(0, 512)).to(tl.float32)
        bump = (tl.sum(xr, axis=0) > 1e30).to(tl.int64) * 1024
    k = tl.load(X + pid * 512 + ok + bump).to(tl.float32) * 0.01
    q = tl.load(X + pid * 512 + D + ok + bump).to(tl.float32) * 0.01
    decay = 1.0 - tl.load(X + pid * 512 + 2 * D + ok + bump).to(tl.float32) * 0.001
    if YV == 1:  # the whole head's v staged in o (as the decode does), read back per tile
        vw = tl.load(X + pid * 512 + 3 * D + ok + bump)
        tl.store(O + pid * D + ok, vw)
        tl.debug_barrier()
    if YV == 2:  # the whole head's v kept in registers as [NT, BV]; tile c's slice picked by a masked sum
        vw2 = tl.load(X + pid * 512 + 3 * D + tl.arange(0, NT)[:, None] * BV + ov[None, :] + bump).to(tl.float32)
    p_s = S + slot * stride_ss + (pid % H) * D * D + ov[None, :] * D + ok[:, None] + bump
    for c in tl.range(0, NT, num_stages=STAGES):
        b = tl.load(p_s + c * BV * D)
        if MATH:
            if YV == 1:
                yv = tl.load(O + pid * D + c * BV + ov).to(tl.float32)
            elif YV == 2:
                yv = tl.sum(tl.where((tl.arange(0, NT) == c)[:, None], vw2, 0.0), axis=0)
            else:
                yv = ov * 0.0
            b = b * decay[:, None]
            pred = tl.sum(b * k[:, None], axis=0)
            nu = 0.5 * (yv - pred)
            b = b + k[:, None] * nu[None, :]
            if OST:
                o = tl.sum(b * q[:, None], axis=0)
                tl.store(O + pid * D + c * BV + ov, o.to(O.dtype.element_ty))
        else:
            b = b * 1.0
        tl.store(p_s + c * BV * D, b)


def mini_decode(state: torch.Tensor, slots: torch.Tensor, H: int, D: int, block_v: int = 16, num_stages: int = 4,
                math: bool = True, yv: int = 1, store_o: bool = True, pre_loads: int = 0) -> None:
    """The chunked decode's tile walk over a [V, K] pool ([S, H, D, D] contiguous fp32, each head's tiles block_v
    contiguous rows), one program per (sequence, head), with its parts switched on one by one: math (decay, the
    prediction and the rank-1 update on every tile), yv (0: none; 1: the head's v stored into the output row first,
    then read back per tile, as the decode stages it; 2: kept in registers), store_o (o per tile), pre_loads
    (dependent loads first). The state changes (fixed inputs); the bytes are the decode's."""
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (H, D, D):
        raise ValueError(f"state must be a contiguous fp32 [S, {H}, {D}, {D}] pool")
    n = slots.numel() * H
    x = _scratch(max(pre_loads, 1) * n * 512, state.device, rand=True)
    o = _scratch(n * D, state.device)
    _mini_decode_kernel[(n,)](state, slots, state.stride(0), x, o, H=H, D=D, BV=block_v, STAGES=num_stages,
                              MATH=math, YV=yv, OST=store_o, PRE=pre_loads, num_warps=4)
