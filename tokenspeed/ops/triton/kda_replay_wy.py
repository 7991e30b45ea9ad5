"""The KDA state replay of accepted drafts in the WY chunk form, over all layers in two launches (`kda_replay_layers`
with a window bound, `max_seq_tokens`, and a WY row of `kda_config.MULTI_TABLE`).

The split replay walks each sequence's accepted tokens one by one per [K, BV] tile, so every token's conv, norms and
two reductions over the tile wait on the previous token; at 16 sequences x 32 heads x 20 layers on the H200 it ran at
14% of HBM on the state (benchmarks/README.md). The window's effect on the state has a closed form (the carry of
`kda_verify_wy.py`): with a accepted tokens, G the inclusive cumulative log decay, d = exp(G), rows past a dead,

    U = W1 (V - Kd S),   W1 = (I + A)^-1 diag(beta),   S_new = diag(d_a) S + Kt^T U,   Kt = k * d_a / d,  Kd = k * d

the token-by-token recurrence in another summation order (fp32; ~1e-6 relative to it).

- `_kda_replay_keys_kernel`, grid (N * H, L): per (sequence, head, layer) the key side into fp32 scratch, Kd and
  M = W1^T Kt [TW, D], the head's v conv Yv [TW, D] and d_a [D]; then all of the head's conv-state columns
  advanced by the a tokens.
- `_kda_replay_tiles_kernel`, grid (D / BV, N * H, L): the [D, BV] state tile (read before the PDL wait: only KDA
  launches of earlier steps write the pool), S_new = diag(d_a) S + sum_j M_j (Yv_j - (Kd S)_j)^T from the scratch
  rows, written in place. A tile only streams: on sm_90 at BV 32 and [V, K] pools it compiles to 96 registers and
  1 layout conversion (`kda_compile_sm90.py --only replay`), against 212 and 14 for an earlier tile pass that
  computed the v conv and U = W1 (V - Kd S) per tile, and it is 2.1-2.6x faster (benchmarks/README.md).

Each launch reads only device values (slots, bounds, accepted counts, the layers' offset table: CUDA-graph safe).
Sequences with no accepted token and padding rows (slot < 0) touch nothing. Layers are addressed as
`kda_decode_kernel`'s multi-layer launch does: layer l's tensors are layer 0's plus row l of the offset table. The
scratch is 4 (3 TW D + D) bytes per (sequence, head, layer): 10% of a head's fp32 state at TW 4 and D 128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.kda_decode_kernel import _layer_bases, _pdl_sync, _store_conv_state
from tokenspeed.ops.triton.kda_verify_wy import (
    _conv_rows,
    _key_rows,
    _seq_row,
    _tile_ptrs,
    _unit_lower_inverse,
    window_rows,
)


@triton.jit
def _accepted(SLOTS, CU, LENS, n):
    """Sequence n's slot to use (>= 0), first row and the tokens to apply: LENS[n] clamped to its rows, 0 for a
    padding row."""
    slot_raw, slot, bos, seq_len = _seq_row(SLOTS, CU, n)
    a = tl.maximum(tl.minimum(tl.load(LENS + n).to(tl.int64), seq_len), 0)
    return slot, bos, tl.where(slot_raw >= 0, a, 0)


@triton.jit
def _load_tile(S, stride_ss, slot, h, a, ok, ov, D: tl.constexpr, V_FIRST: tl.constexpr):
    """(pointers, values) of head h's [D, BV] state tile of V columns `ov` in `slot`; zeros, nothing read, when
    a = 0 (the sequence applies no token)."""
    p_s = _tile_ptrs(S, stride_ss, slot, h, ok, ov, D, V_FIRST)
    return p_s, tl.load(p_s, mask=((ok * 0 + a) > 0)[:, None] & ((ov * 0 + 1) > 0)[None, :], other=0.0)


@triton.jit
def _kda_replay_keys_kernel(
    QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, CS, stride_css, stride_csc, stride_csw,
    A_log, DT, SLOTS, CU, LENS, LOFF, SCR, lower_bound,
    H: tl.constexpr, D: tl.constexpr, TW: tl.constexpr, HAS_LB: tl.constexpr, PDL: tl.constexpr,
):
    _pdl_sync(PDL)  # the offset table may have been copied in just before: nothing is read ahead of the wait
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    QKV, F, Bt, CW, CS, A_log, DT, _ = _layer_bases(LOFF, layer, QKV, F, Bt, CW, CS, A_log, DT, QKV)
    OUT_TY = QKV.dtype.element_ty  # the conv output's rounding, as in the split replay
    n = pid // H
    h = pid % H
    slot, bos, a = _accepted(SLOTS, CU, LENS, n)
    if a > 0:  # uniform over the program
        ok = tl.arange(0, D)
        rows = tl.arange(0, TW)
        live = rows < a
        mrk = live[:, None] & ((ok * 0 + 1) > 0)[None, :]
        cs = CS + slot * stride_css
        cq = h * D + ok
        ck = H * D + cq
        dtb = tl.load(DT + h * D + ok[None, :] + rows[:, None] * 0).to(tl.float32)  # [TW, D] rows, as f is loaded
        k, lg, beta = _key_rows(QKV, stride_qkv, F + h * stride_fh, stride_ft, Bt + h * stride_bh, stride_bt, CW, cs,
                                stride_csc, stride_csw, dtb, tl.exp(tl.load(A_log + h).to(tl.float32)), lower_bound,
                                bos, rows, live, mrk, ck, ok, HAS_LB, OUT_TY)
        w3 = tl.exp(tl.minimum(lg[:, None, :] - lg[None, :, :], 0.0))  # d_t / d_i where i <= t
        eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        a_mat = tl.where(rows[:, None] > rows[None, :], tl.sum(k[:, None, :] * k[None, :, :] * w3, axis=2), 0.0)
        w1 = _unit_lower_inverse(a_mat * beta[:, None], eye, TW) * beta[None, :]
        glast = tl.sum(tl.where(rows[:, None] == TW - 1, lg, 0.0), axis=0)  # G at the last live row (no decay past)
        kt = k * tl.exp(glast[None, :] - lg)
        rw = rows[:, None] * D + ok[None, :]
        m = (ok * 0 + a) > 0
        # [Kd, M = W1^T Kt, the head's v conv Yv (TW x D each), d_a]
        base = SCR + (layer * tl.num_programs(0) + pid) * (3 * TW * D + D)
        cv = 2 * H * D + cq
        tl.store(base + 2 * TW * D + rw, _conv_rows(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, rows, cv,
                                                    mrk, OUT_TY))
        tl.store(base + rw, k * tl.exp(lg))
        tl.store(base + TW * D + rw, tl.sum(w1[:, :, None] * kt[:, None, :], axis=0))  # row j: sum_t W1[t, j] Kt_t
        tl.store(base + 3 * TW * D + ok, tl.exp(glast))
        _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, a, cv, m)
        _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, a, cq, m)  # reads, barrier, writes
        _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, a, ck, m)


@triton.jit
def _kda_replay_tiles_kernel(
    S, stride_ss, SLOTS, CU, LENS, LOFF, SCR,
    H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, TW: tl.constexpr, V_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    """The state tiles: the key pass left Kd, M = W1^T Kt and the v conv Yv, so a tile only reads its rows:
    S_new = diag(d_a) S + sum_j M_j (Yv_j - Kd_j S)^T, the key-axis rows (Kd_j, M_j, d_a) loaded as [D, BV] tiles
    broadcast over V, in the layout of a [V, K] pool's tile (no conversion, and the reductions over the key axis
    stay within a warp); no conv state here."""
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    layer = tl.program_id(2)
    # Before the PDL wait: the key pass, the kernel before this one, let it launch only once every key program was
    # past its own wait, so the offset table and the pool's last writers are complete; the key pass writes no state.
    S += tl.load(LOFF + layer * 8 + 7)
    n = pid_nh // H
    h = pid_nh % H
    slot, _, a = _accepted(SLOTS, CU, LENS, n)
    ok = tl.arange(0, D)
    ov = pid_v * BV + tl.arange(0, BV)
    p_s, b_s = _load_tile(S, stride_ss, slot, h, a, ok, ov, D, V_FIRST)
    _pdl_sync(PDL)  # the key pass's scratch from here on

    if a > 0:  # uniform over the program
        base = SCR + (layer * tl.num_programs(1) + pid_nh) * (3 * TW * D + D)
        krow = ok[:, None] + ov[None, :] * 0  # a key-axis row of the scratch, broadcast over the tile's V columns
        acc = tl.load(base + 3 * TW * D + krow) * b_s
        for j in tl.static_range(TW):  # dead rows (j >= a) hold zeros: they add nothing
            r = tl.load(base + 2 * TW * D + j * D + ov) - tl.sum(tl.load(base + j * D + krow) * b_s, axis=0)
            acc += tl.load(base + TW * D + j * D + krow) * r[None, :]  # M_j (Yv_j - (Kd S)_j)^T
        tl.store(p_s, acc)


def launch_replay_wy(qkv: Tensor, f3: Tensor, b: Tensor, cw: Tensor, conv_state: Tensor, A_log: Tensor,
                     dt_bias: Tensor, state: Tensor, offsets: Tensor, num_layers: int, state_indices: Tensor,
                     cu_seqlens: Tensor, seq_lens: Tensor, *, lower_bound: float | None, block_v: int, num_warps: int,
                     max_seq_tokens: int, state_v_first: bool) -> None:
    """The two launches over layer 0's tensors and the layers' offset table (arguments as `kda_replay_layers` checked
    them; every sequence has at most max_seq_tokens <= MAX_WINDOW rows; D a power of two that block_v divides).
    Mutates each layer's conv_state and state at the batch's slots."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    tw = window_rows(max_seq_tokens)
    scratch = torch.empty(num_layers * N * H * (3 * tw * D + D), dtype=torch.float32, device=qkv.device)
    use_pdl = pdl.enabled(qkv.device, "kda")
    _kda_replay_keys_kernel[(N * H, num_layers)](
        qkv, qkv.stride(0), f3, f3.stride(0), f3.stride(1), b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), A_log, dt_bias,
        state_indices, cu_seqlens, seq_lens, offsets, scratch,
        float(lower_bound) if lower_bound is not None else 0.0,
        H=H, D=D, TW=tw, HAS_LB=lower_bound is not None, PDL=use_pdl, num_warps=4,
        **pdl.launch_kwargs(qkv.device, "kda"),
    )
    _kda_replay_tiles_kernel[(D // block_v, N * H, num_layers)](
        state, state.stride(0), state_indices, cu_seqlens, seq_lens, offsets, scratch,
        H=H, D=D, BV=block_v, TW=tw, V_FIRST=bool(state_v_first), PDL=use_pdl, num_warps=num_warps,
        **pdl.launch_kwargs(qkv.device, "kda"),
    )
