"""KDA decode / k-token verify in one launch per layer.

For each sequence n (tokens cu_seqlens[n]..cu_seqlens[n+1], any count, normally 1 for decode and k for verify),
its state slot s = state_indices[n], and each head h, one program (per V-block) does, token by token:

    x_t   = qkv[t, {q,k,v} channels of head h]            (strided rows of the merged projection, read in place)
    y     = cast(SiLU(sum_j conv_w[c, j] * x_{t-3+j}), io)  (window from conv_state[s] then the new tokens)
    q, k  = l2norm(y_q) * scale, l2norm(y_k);  v = y_v
    g     = lambda * sigmoid(exp(A_log[h]) * (f + dt_bias))   or   -exp(A_log[h]) * softplus(f + dt_bias)
    beta  = sigmoid(b[t, h])
    S     = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o_t = S^T q

with S [K, V] fp32 held in registers for the whole sequence (read once from state[s, h], written once). That is
`ops.causal_conv1d` + `ops.l2_normalize` + `ops.kda_gate` + sigmoid + `ops.kda_recurrent` fused, with the same
roundings (the conv output is rounded to the io dtype, as the reference's conv returns it).

`update_state=True` (decode): conv_state[s] and state[s] are advanced in place. `update_state=False` (verify):
neither pool is written; `step_states` [T, H, K, V] fp32, if given, receives the state after every token, so
the caller can commit the state after the last accepted token.

CUDA-graph safe: no host synchronisation (lengths and slots are read on the device), a grid that depends only on
tensor shapes, and outputs allocated by shape. A slot < 0 marks a padding row of a graph bucket: its outputs are
zeros and no state is touched.

When the V dimension is split over several programs (BV < V, more parallelism for small batches) every program of
a head computes the q/k conv of that head, so the q/k conv-state columns must be written only after all of them
have read the old ones: each program bumps a per-(sequence, head) counter after its reads (acq_rel atomic) and the
last one writes those columns and resets the counter to zero for the next launch.

Any head dim D: the K axis of the tile is padded to BK = next_pow2(D) and the V axis split into NV = ceil(D / BV)
blocks of a power-of-two BV (tl.arange needs powers of two). Padded lanes are masked on every load and store and
read as zeros (conv input, conv weight, f, dt_bias, state), so they add nothing to the L2 norms, the recurrence or
the outputs, and are never written. When D is a power of two (and BV divides it) the masks are compile-time
no-ops (EVEN_K / EVEN_V): the same code as the unpadded kernel.

`kda_replay_layers` (MULTI_LAYER): the state replay of accepted drafts over all L KDA layers of a model in one
launch, grid (NV, N * H, L). Program (., ., l) adds row l of an int64 [L, 8] element-offset table
(`tokenspeed.ops.kda_layers.KdaLayerTable`, built once on the host) to the layer-0 base pointer of each per-layer
tensor (qkv, f, b, conv weight, conv state, A_log, dt_bias, state); strides, slots, lengths and accepted counts
are shared. With STORE_OUT False the q path (q conv, its norm, o = S^T q and the output store) is skipped: a
replay only advances the pools. The single-layer launch passes MULTI_LAYER False / STORE_OUT True, which compile
those branches away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.dispatch import kda_replay_layers_unsupported
from tokenspeed.ops.kda_layers import KdaLayerTable
from tokenspeed.ops.triton._utils import next_pow2

_COUNTERS: dict[torch.device, Tensor] = {}
_RETIRED: list[Tensor] = []  # outgrown counter buffers, kept alive: graphs captured earlier still address them


def _counters(device: torch.device, size: int) -> Tensor:
    """Zeroed int32 counters, at least `size`; cached per device (allocate before graph capture). A buffer that a
    larger call outgrows is kept alive (never freed and reused for something else under an older graph)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < size:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@triton.jit
def _load_lanes(ptr, lane, EVEN: tl.constexpr):
    """tl.load(ptr) of a padded tile axis: lanes with `lane` False read 0. EVEN (every lane real): unmasked."""
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=lane, other=0.0)
    return x


@triton.jit
def _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, p, ch, m):
    """Pre-conv input of channels `ch` at position p of the sequence (p < 0: column 3 + p of the old conv state)."""
    pv = ch * 0 + p
    xs = tl.load(QKV + (bos + tl.maximum(p, 0)) * stride_qkv + ch, mask=m & (pv >= 0), other=0.0)
    xc = tl.load(cs + ch * stride_csc + (3 + tl.minimum(p, -1)) * stride_csw, mask=m & (pv < 0), other=0.0)
    return xs.to(tl.float32) + xc.to(tl.float32)  # exactly one of the two is loaded


@triton.jit
def _conv_tap(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, J: tl.constexpr, ch, m, lane,
              EVEN: tl.constexpr):
    """w[ch, J] * x_{i-3+J}, one tap of the width-4 conv. Lanes outside `m` read a zero input; padded lanes
    (`lane` False, masked only when not EVEN) also a zero weight, so they give exactly 0 and read nothing."""
    w = _load_lanes(CW + ch * 4 + J, lane, EVEN)
    return w * _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, i + (J - 3), ch, m)


@triton.jit
def _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, ch, m, lane, EVEN: tl.constexpr,
               OUT_TY: tl.constexpr):
    """cast(SiLU(sum_j w[ch, j] x_{i-3+j}), OUT_TY) as fp32, the reference conv's rounding; 0 on padded lanes."""
    y = _conv_tap(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, 0, ch, m, lane, EVEN)
    y += _conv_tap(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, 1, ch, m, lane, EVEN)
    y += _conv_tap(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, 2, ch, m, lane, EVEN)
    y += _conv_tap(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, 3, ch, m, lane, EVEN)
    return (y / (1.0 + tl.exp(-y))).to(OUT_TY).to(tl.float32)


@triton.jit
def _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ch, m):
    """New conv state of channels `ch`: the last 3 inputs of [old state, new tokens], all read before any write."""
    x0 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len - 3, ch, m)
    x1 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len - 2, ch, m)
    x2 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len - 1, ch, m)
    tl.debug_barrier()
    ty = cs.dtype.element_ty
    tl.store(cs + ch * stride_csc + 0 * stride_csw, x0.to(ty), mask=m)
    tl.store(cs + ch * stride_csc + 1 * stride_csw, x1.to(ty), mask=m)
    tl.store(cs + ch * stride_csc + 2 * stride_csw, x2.to(ty), mask=m)


@triton.jit
def _load_state(p_s, lane, EVEN: tl.constexpr, HINTS: tl.constexpr):
    """The [BK, BV] state tile; padded lanes (`lane` False, only when not EVEN) read 0. HINTS: evict-first."""
    if EVEN:
        if HINTS:
            x = tl.load(p_s, eviction_policy="evict_first")
        else:
            x = tl.load(p_s)
    else:
        if HINTS:
            x = tl.load(p_s, mask=lane, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(p_s, mask=lane, other=0.0)
    return x


@triton.jit
def _kda_decode_kernel(
    QKV, stride_qkv,
    F, stride_ft, stride_fh,
    Bt, stride_bt, stride_bh,
    CW, CS, stride_css, stride_csc, stride_csw,
    A_log, DT,
    S, stride_ss,
    SLOTS, CU, LENS,
    O, STEP, CNT, LOFF,
    lower_bound, scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_V: tl.constexpr,
    HAS_LB: tl.constexpr,
    UPDATE: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    HINTS: tl.constexpr,
    HAS_LENS: tl.constexpr,
    MULTI_LAYER: tl.constexpr = False,
    STORE_OUT: tl.constexpr = True,
):
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    if MULTI_LAYER:  # one launch over L layers: layer l's tensors are layer 0's + row l of the offset table
        layer = tl.program_id(2)
        row = LOFF + layer * 8  # columns: kda_layers.LAYER_FIELDS
        QKV += tl.load(row + 0)
        F += tl.load(row + 1)
        Bt += tl.load(row + 2)
        CW += tl.load(row + 3)
        CS += tl.load(row + 4)
        A_log += tl.load(row + 5)
        DT += tl.load(row + 6)
        S += tl.load(row + 7)
        CNT += layer * tl.num_programs(1)  # a V-split counter per (layer, sequence, head)
    n = pid_nh // H
    h = pid_nh % H
    HD = H * D
    OUT_TY = O.dtype.element_ty

    bos = tl.load(CU + n).to(tl.int64)
    seq_len = tl.load(CU + n + 1).to(tl.int64) - bos
    if HAS_LENS:  # only the first LENS[n] tokens of the sequence's rows (KDA replay of accepted drafts)
        seq_len = tl.maximum(tl.minimum(tl.load(LENS + n).to(tl.int64), seq_len), 0)
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)

    ok = tl.arange(0, BK)                # key channel within the head (BK = D unless D is padded)
    ov = pid_v * BV + tl.arange(0, BV)   # value channel within the head
    lk = ok < D                          # real lanes; used only when padded (not EVEN_*)
    lv = ov < D
    # Masks as full vectors (scalar & vector masks trip the CPU interpreter).
    mk = (ok * 0 + slot_raw) >= 0
    mv = (ov * 0 + slot_raw) >= 0
    if not EVEN_K:
        mk = mk & lk
    if not EVEN_V:
        mv = mv & lv
    cq = h * D + ok                      # conv channels of q, k, v
    ck = HD + cq
    cv = 2 * HD + h * D + ov
    cs = CS + slot * stride_css

    # Recurrent state [K, BV] of this head / V-block: read once, kept in registers, written once.
    p_s = S + slot * stride_ss + h * D * D + ok[:, None] * D + ov[None, :]
    ms = mk[:, None] & mv[None, :]
    b_s = _load_state(p_s, lk[:, None] & lv[None, :], EVEN_K and EVEN_V, HINTS)
    b_s = tl.where(ms, b_s, 0.0)  # a padding row reads slot 0 (lanes only, unmasked when even), then zeros

    rate = tl.exp(tl.load(A_log + h).to(tl.float32))

    for i in range(seq_len):
        t = bos + i
        # Short conv + SiLU: the window is re-read per token (L1/L2 hits) instead of carried in registers.
        if STORE_OUT:  # the q path (conv, norm, o = S^T q): a state replay (STORE_OUT False) needs none of it
            yq = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cq, mk, lk, EVEN_K, OUT_TY)
        yk = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, ck, mk, lk, EVEN_K, OUT_TY)
        yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cv, mv, lv, EVEN_V, OUT_TY)
        f = _load_lanes(F + t * stride_ft + h * stride_fh + ok, lk, EVEN_K).to(tl.float32)
        braw = tl.load(Bt + t * stride_bt + h * stride_bh).to(tl.float32)

        if STORE_OUT:
            q = yq * tl.rsqrt(tl.sum(yq * yq, axis=0) + 1e-6) * scale
        k = yk * tl.rsqrt(tl.sum(yk * yk, axis=0) + 1e-6)
        xg = f + _load_lanes(DT + h * D + ok, lk, EVEN_K).to(tl.float32)
        if HAS_LB:
            g = lower_bound / (1.0 + tl.exp(-(rate * xg)))
        else:
            sp = tl.where(xg > 20.0, xg, tl.log(1.0 + tl.exp(tl.minimum(xg, 20.0))))
            g = -rate * sp
        beta = 1.0 / (1.0 + tl.exp(-braw))

        b_s = b_s * tl.exp(g)[:, None]
        pred = tl.sum(b_s * k[:, None], axis=0)
        nu = beta * (yv - pred)
        b_s = b_s + k[:, None] * nu[None, :]
        if STORE_OUT:
            o = tl.sum(b_s * q[:, None], axis=0)
            o = tl.where(mv, o, 0.0)
            if EVEN_V:
                tl.store(O + (t * H + h) * D + ov, o.to(OUT_TY))
            else:
                tl.store(O + (t * H + h) * D + ov, o.to(OUT_TY), mask=lv)
        if STORE_STEPS:
            tl.store(STEP + (t * H + h) * D * D + ok[:, None] * D + ov[None, :], b_s, mask=ms,
                     cache_modifier=".cs")

    if UPDATE:
        mkl = mk & ((ok * 0 + seq_len) > 0)   # live: a real slot and at least one token
        mvl = mv & ((ov * 0 + seq_len) > 0)
        mlast = mkl
        if NV > 1:
            # All NV programs of this (sequence, head) read the old q/k columns in their loops; the last to arrive
            # writes them. Arrive before the big state store, so the release fence waits only on loads.
            tl.debug_barrier()  # every warp of this program is past its reads before the release
            arrived = tl.atomic_add(CNT + pid_nh, 1, sem="acq_rel")
            tl.atomic_xchg(CNT + pid_nh, 0, mask=arrived == NV - 1)
            mlast = mkl & ((ok * 0 + arrived) == NV - 1)
        if HINTS:
            tl.store(p_s, b_s, mask=mkl[:, None] & mvl[None, :], cache_modifier=".cs")
        else:
            tl.store(p_s, b_s, mask=mkl[:, None] & mvl[None, :])
        _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cv, mvl)
        _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cq, mlast)
        _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ck, mlast)


def default_config(num_programs_nh: int, head_dim: int) -> tuple[int, int]:
    """(BV, num_warps); BV is a power of two <= next_pow2(head_dim). Measured on H200
    (benchmarks/results/kernels_h200.json) for power-of-two head dims: a whole [128, 128] state per program
    spills; [128, 64] or [128, 32] tiles with 4 warps stream best, the narrower ones when there are too few
    (sequence, head) pairs to fill 132 SMs. Other head dims take the same choice adjusted by `_fit_bv`."""
    if head_dim < 64:
        return next_pow2(head_dim), 4  # the whole (padded) head in one program
    return _fit_bv(32 if num_programs_nh < 96 else 64, head_dim), 4


def _fit_bv(target: int, head_dim: int) -> int:
    """A power-of-two V block near `target` (a power of two <= head_dim) for head_dim: `target` when it divides
    head_dim (always, for a power-of-two head_dim >= target), else the largest power of two dividing head_dim
    if that is at least 16 (no masked tail), else `target` (the last of ceil(head_dim / target) blocks masked)."""
    if head_dim % target == 0:
        return target
    div = head_dim & -head_dim  # largest power of two dividing head_dim
    return div if div >= 16 else target


def _check_layer(qkv: Tensor, f: Tensor, b: Tensor, conv_weight: Tensor, conv_state: Tensor, dt_bias: Tensor,
                 state: Tensor, N: int, cu_seqlens: Tensor, seq_lens: Tensor | None) -> Tensor:
    """Validate one layer's arguments of `kda_decode` (N sequences); returns f as a [T, H, D] view."""
    H, D = dt_bias.shape
    T = qkv.shape[0]
    if qkv.shape != (T, 3 * H * D) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {3 * H * D}] with unit column stride; got {tuple(qkv.shape)}")
    if conv_weight.shape != (3 * H * D, 4):
        raise ValueError(f"the fused kernel needs a width-4 conv weight [C, 4]; got {tuple(conv_weight.shape)}")
    f3 = f.view(T, H, D) if f.dim() == 2 else f
    if f3.shape != (T, H, D) or f3.stride(2) != 1:
        raise ValueError(f"f must be [T, H, D] with unit last stride; got {tuple(f.shape)}")
    if b.shape != (T, H):
        raise ValueError(f"b must be [T, {H}]; got {tuple(b.shape)}")
    if state.shape[1:] != (H, D, D) or state.dtype != torch.float32 or state.stride()[1:] != (D * D, D, 1):
        raise ValueError(f"state must be an fp32 pool [S, {H}, {D}, {D}] with contiguous slots")
    if cu_seqlens.shape != (N + 1,):
        raise ValueError(f"cu_seqlens must be [{N + 1}]")
    if conv_state.shape[1:] != (3 * H * D, 3):
        raise ValueError(f"conv_state must be [S, {3 * H * D}, 3]; got {tuple(conv_state.shape)}")
    if seq_lens is not None and seq_lens.shape != (N,):
        raise ValueError(f"seq_lens must be [{N}]")
    return f3


def _split(num_programs_nh: int, D: int, BV: int | None, num_warps: int | None) -> tuple[int, int, int, int]:
    """(BK, BV, NV, num_warps) of a launch: defaults from `default_config`, overrides checked."""
    bv_default, nw_default = default_config(num_programs_nh, D)
    bv = BV or bv_default
    bk = next_pow2(D)  # the K axis of the tile, padded (masked) past D
    if bv <= 0 or bv & (bv - 1) or bv > bk:
        raise ValueError(f"BV must be a power of two <= {bk} (head dim {D} rounded up); got {bv}")
    return bk, bv, triton.cdiv(D, bv), num_warps or nw_default  # NV: the last V block masked past D if uneven


def kda_decode(
    qkv: Tensor,
    f: Tensor,
    b: Tensor,
    conv_weight: Tensor,
    conv_state: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    *,
    lower_bound: float | None,
    scale: float,
    update_state: bool = True,
    step_states: Tensor | None = None,
    BV: int | None = None,
    num_warps: int | None = None,
    hints: bool = False,
    out: Tensor | None = None,
    seq_lens: Tensor | None = None,
) -> Tensor:
    """Triton `ops.kda_decode` (same contract); BV / num_warps / hints (evict-first state load, streaming state
    store) override the launch configuration."""
    H, D = dt_bias.shape
    T, N = qkv.shape[0], state_indices.numel()
    f3 = _check_layer(qkv, f, b, conv_weight, conv_state, dt_bias, state, N, cu_seqlens, seq_lens)
    cw = conv_weight if conv_weight.is_contiguous() and conv_weight.dtype == torch.float32 \
        else conv_weight.float().contiguous()
    if out is None:  # with seq_lens the rows past each count are not written: zeros
        out = (torch.zeros if seq_lens is not None else torch.empty)(T, H, D, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (T, H, D) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [T, {H}, {D}] tensor of qkv's dtype")
    if step_states is not None:
        if update_state:
            raise ValueError("step_states is for verify (update_state=False)")
        if step_states.shape != (T, H, D, D) or not step_states.is_contiguous() or step_states.dtype != torch.float32:
            raise ValueError(f"step_states must be a contiguous fp32 [T, {H}, {D}, {D}]")
    if N == 0 or T == 0:
        return out
    bk, bv, nv, nw = _split(N * H, D, BV, num_warps)
    cnt = _counters(qkv.device, N * H) if (update_state and nv > 1) else cu_seqlens
    _kda_decode_kernel[(nv, N * H)](
        qkv, qkv.stride(0),
        f3, f3.stride(0), f3.stride(1),
        b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(),
        state, state.stride(0),
        state_indices, cu_seqlens, seq_lens if seq_lens is not None else cu_seqlens,
        out, step_states if step_states is not None else state, cnt, cu_seqlens,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale),
        H=H, D=D, BK=bk, BV=bv, NV=nv, EVEN_K=bk == D, EVEN_V=D % bv == 0, HAS_LB=lower_bound is not None,
        UPDATE=bool(update_state), STORE_STEPS=step_states is not None, HINTS=bool(hints),
        HAS_LENS=seq_lens is not None, MULTI_LAYER=False, STORE_OUT=True, num_warps=nw,
    )
    return out


def kda_replay_layers(
    table: KdaLayerTable,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor | None,
    *,
    lower_bound: float | None,
    BV: int | None = None,
    num_warps: int | None = None,
    hints: bool = False,
) -> None:
    """Triton `ops.kda_replay_layers` (same contract): every layer of `table` in one launch, grid
    (NV, N * H, L), no outputs (the q path is not computed); BV / num_warps / hints as in `kda_decode` (the
    default split is chosen for the N * H * L programs of a V block). Raises ValueError when
    `dispatch.kda_replay_layers_unsupported(table)` names a reason."""
    why = kda_replay_layers_unsupported(table)
    if why is not None:
        raise ValueError(f"kda_replay_layers: {why}")
    qkv, f, b, cw, conv_state, A_log, dt_bias, state = table.base
    H, D = dt_bias.shape
    T, N, L = qkv.shape[0], state_indices.numel(), table.num_layers
    f3 = _check_layer(qkv, f, b, cw, conv_state, dt_bias, state, N, cu_seqlens, seq_lens)
    if N == 0 or T == 0:
        return
    bk, bv, nv, nw = _split(N * H * L, D, BV, num_warps)
    cnt = _counters(qkv.device, L * N * H) if nv > 1 else cu_seqlens
    _kda_decode_kernel[(nv, N * H, L)](
        qkv, qkv.stride(0),
        f3, f3.stride(0), f3.stride(1),
        b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias,
        state, state.stride(0),
        state_indices, cu_seqlens, seq_lens if seq_lens is not None else cu_seqlens,
        qkv, state, cnt, table.offsets,  # O: unused (STORE_OUT False), typed like the io dtype for the roundings
        float(lower_bound) if lower_bound is not None else 0.0, 1.0,
        H=H, D=D, BK=bk, BV=bv, NV=nv, EVEN_K=bk == D, EVEN_V=D % bv == 0, HAS_LB=lower_bound is not None,
        UPDATE=True, STORE_STEPS=False, HINTS=bool(hints), HAS_LENS=seq_lens is not None,
        MULTI_LAYER=True, STORE_OUT=False, num_warps=nw,
    )
