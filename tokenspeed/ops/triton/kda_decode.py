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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_COUNTERS: dict[torch.device, Tensor] = {}


def _counters(device: torch.device, size: int) -> Tensor:
    """Zeroed int32 counters, at least `size`; cached per device (allocate before graph capture)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < size:
        buf = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@triton.jit
def _kda_decode_kernel(
    QKV, stride_qkv,
    F, stride_ft, stride_fh,
    Bt, stride_bt, stride_bh,
    CW, CS, stride_css, stride_csc, stride_csw,
    A_log, DT,
    S, stride_ss,
    SLOTS, CU,
    O, STEP, CNT,
    lower_bound, scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    HAS_LB: tl.constexpr,
    UPDATE: tl.constexpr,
    STORE_STEPS: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    n = pid_nh // H
    h = pid_nh % H
    HD = H * D

    bos = tl.load(CU + n).to(tl.int64)
    seq_len = tl.load(CU + n + 1).to(tl.int64) - bos
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)

    ok = tl.arange(0, D)                 # key channel within the head
    ov = pid_v * BV + tl.arange(0, BV)   # value channel within the head
    # Masks as full vectors (scalar & vector masks trip the CPU interpreter).
    mk = (ok * 0 + slot_raw) >= 0
    mv = (ov * 0 + slot_raw) >= 0
    cq = h * D + ok                      # conv channels of q, k, v
    ck = HD + cq
    cv = 2 * HD + h * D + ov

    # Conv weights [C, 4] fp32 (column 3 multiplies the current token).
    wq0 = tl.load(CW + cq * 4 + 0)
    wq1 = tl.load(CW + cq * 4 + 1)
    wq2 = tl.load(CW + cq * 4 + 2)
    wq3 = tl.load(CW + cq * 4 + 3)
    wk0 = tl.load(CW + ck * 4 + 0)
    wk1 = tl.load(CW + ck * 4 + 1)
    wk2 = tl.load(CW + ck * 4 + 2)
    wk3 = tl.load(CW + ck * 4 + 3)
    wv0 = tl.load(CW + cv * 4 + 0)
    wv1 = tl.load(CW + cv * 4 + 1)
    wv2 = tl.load(CW + cv * 4 + 2)
    wv3 = tl.load(CW + cv * 4 + 3)

    # Conv windows: the 3 previous pre-conv inputs (oldest first) from the slot's conv state.
    cs = CS + slot * stride_css
    xq0 = tl.load(cs + cq * stride_csc + 0 * stride_csw, mask=mk, other=0.0).to(tl.float32)
    xq1 = tl.load(cs + cq * stride_csc + 1 * stride_csw, mask=mk, other=0.0).to(tl.float32)
    xq2 = tl.load(cs + cq * stride_csc + 2 * stride_csw, mask=mk, other=0.0).to(tl.float32)
    xk0 = tl.load(cs + ck * stride_csc + 0 * stride_csw, mask=mk, other=0.0).to(tl.float32)
    xk1 = tl.load(cs + ck * stride_csc + 1 * stride_csw, mask=mk, other=0.0).to(tl.float32)
    xk2 = tl.load(cs + ck * stride_csc + 2 * stride_csw, mask=mk, other=0.0).to(tl.float32)
    xv0 = tl.load(cs + cv * stride_csc + 0 * stride_csw, mask=mv, other=0.0).to(tl.float32)
    xv1 = tl.load(cs + cv * stride_csc + 1 * stride_csw, mask=mv, other=0.0).to(tl.float32)
    xv2 = tl.load(cs + cv * stride_csc + 2 * stride_csw, mask=mv, other=0.0).to(tl.float32)

    # Recurrent state [K, BV] of this head / V-block.
    p_s = S + slot * stride_ss + h * D * D + ok[:, None] * D + ov[None, :]
    ms = mk[:, None] & mv[None, :]
    b_s = tl.load(p_s, mask=ms, other=0.0)

    rate = tl.exp(tl.load(A_log + h).to(tl.float32))
    dt = tl.load(DT + h * D + ok).to(tl.float32)

    for i in range(0, seq_len):
        t = bos + i
        row = QKV + t * stride_qkv
        xq3 = tl.load(row + cq).to(tl.float32)
        xk3 = tl.load(row + ck).to(tl.float32)
        xv3 = tl.load(row + cv).to(tl.float32)
        f = tl.load(F + t * stride_ft + h * stride_fh + ok).to(tl.float32)
        braw = tl.load(Bt + t * stride_bt + h * stride_bh).to(tl.float32)

        yq = wq0 * xq0 + wq1 * xq1 + wq2 * xq2 + wq3 * xq3
        yk = wk0 * xk0 + wk1 * xk1 + wk2 * xk2 + wk3 * xk3
        yv = wv0 * xv0 + wv1 * xv1 + wv2 * xv2 + wv3 * xv3
        yq = (yq / (1.0 + tl.exp(-yq))).to(O.dtype.element_ty).to(tl.float32)
        yk = (yk / (1.0 + tl.exp(-yk))).to(O.dtype.element_ty).to(tl.float32)
        yv = (yv / (1.0 + tl.exp(-yv))).to(O.dtype.element_ty).to(tl.float32)
        xq0 = xq1
        xq1 = xq2
        xq2 = xq3
        xk0 = xk1
        xk1 = xk2
        xk2 = xk3
        xv0 = xv1
        xv1 = xv2
        xv2 = xv3

        q = yq * tl.rsqrt(tl.sum(yq * yq, axis=0) + 1e-6) * scale
        k = yk * tl.rsqrt(tl.sum(yk * yk, axis=0) + 1e-6)
        xg = f + dt
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
        o = tl.sum(b_s * q[:, None], axis=0)
        o = tl.where(mv, o, 0.0)
        tl.store(O + (t * H + h) * D + ov, o.to(O.dtype.element_ty))
        if STORE_STEPS:
            tl.store(STEP + (t * H + h) * D * D + ok[:, None] * D + ov[None, :], b_s, mask=ms)

    if UPDATE:
        mkl = mk & ((ok * 0 + seq_len) > 0)
        mvl = mv & ((ov * 0 + seq_len) > 0)
        tl.store(p_s, b_s, mask=mkl[:, None] & mvl[None, :])
        dt_cs = CS.dtype.element_ty
        tl.store(cs + cv * stride_csc + 0 * stride_csw, xv0.to(dt_cs), mask=mvl)
        tl.store(cs + cv * stride_csc + 1 * stride_csw, xv1.to(dt_cs), mask=mvl)
        tl.store(cs + cv * stride_csc + 2 * stride_csw, xv2.to(dt_cs), mask=mvl)
        if NV > 1:
            # All NV programs of this (sequence, head) read the old q/k columns above; the last to arrive writes.
            arrived = tl.atomic_add(CNT + pid_nh, 1, sem="acq_rel")
            tl.atomic_xchg(CNT + pid_nh, 0, mask=arrived == NV - 1)
            mkl = mkl & ((ok * 0 + arrived) == NV - 1)
        tl.store(cs + cq * stride_csc + 0 * stride_csw, xq0.to(dt_cs), mask=mkl)
        tl.store(cs + cq * stride_csc + 1 * stride_csw, xq1.to(dt_cs), mask=mkl)
        tl.store(cs + cq * stride_csc + 2 * stride_csw, xq2.to(dt_cs), mask=mkl)
        tl.store(cs + ck * stride_csc + 0 * stride_csw, xk0.to(dt_cs), mask=mkl)
        tl.store(cs + ck * stride_csc + 1 * stride_csw, xk1.to(dt_cs), mask=mkl)
        tl.store(cs + ck * stride_csc + 2 * stride_csw, xk2.to(dt_cs), mask=mkl)


def default_config(num_programs_nh: int, head_dim: int) -> tuple[int, int]:
    """(BV, num_warps): split V when there are too few (sequence, head) pairs to fill the GPU."""
    if num_programs_nh >= 264 or head_dim < 64:
        return head_dim, 8 if head_dim >= 128 else 4
    bv = max(32, head_dim // 4)
    return bv, 4


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
    out: Tensor | None = None,
) -> Tensor:
    """Triton `ops.kda_decode` (same contract); BV / num_warps override the launch configuration."""
    H, D = dt_bias.shape
    T = qkv.shape[0]
    N = state_indices.numel()
    if qkv.shape != (T, 3 * H * D) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {3 * H * D}] with unit column stride; got {tuple(qkv.shape)}")
    if conv_weight.shape != (3 * H * D, 4):
        raise ValueError(f"the fused kernel needs a width-4 conv weight [C, 4]; got {tuple(conv_weight.shape)}")
    if D & (D - 1):
        raise ValueError(f"head dim must be a power of two; got {D}")
    f3 = f.view(T, H, D) if f.dim() == 2 else f
    if f3.shape != (T, H, D) or f3.stride(2) != 1:
        raise ValueError(f"f must be [T, H, D] with unit last stride; got {tuple(f.shape)}")
    if b.shape != (T, H):
        raise ValueError(f"b must be [T, {H}]; got {tuple(b.shape)}")
    if state.shape[1:] != (H, D, D) or state.dtype != torch.float32 or state.stride()[1:] != (D * D, D, 1):
        raise ValueError(f"state must be an fp32 pool [S, {H}, {D}, {D}] with contiguous slots")
    if cu_seqlens.shape != (N + 1,):
        raise ValueError(f"cu_seqlens must be [{N + 1}]")
    cw = conv_weight if conv_weight.is_contiguous() and conv_weight.dtype == torch.float32 \
        else conv_weight.float().contiguous()
    if conv_state.shape[1:] != (3 * H * D, 3):
        raise ValueError(f"conv_state must be [S, {3 * H * D}, 3]; got {tuple(conv_state.shape)}")
    if out is None:
        out = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (T, H, D) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [T, {H}, {D}] tensor of qkv's dtype")
    if step_states is not None:
        if update_state:
            raise ValueError("step_states is for verify (update_state=False)")
        if step_states.shape != (T, H, D, D) or not step_states.is_contiguous() or step_states.dtype != torch.float32:
            raise ValueError(f"step_states must be a contiguous fp32 [T, {H}, {D}, {D}]")
    if N == 0 or T == 0:
        return out
    bv_default, nw_default = default_config(N * H, D)
    bv = BV or bv_default
    nw = num_warps or nw_default
    cnt = _counters(qkv.device, N * H) if (update_state and bv < D) else cu_seqlens
    grid = (D // bv, N * H)
    _kda_decode_kernel[grid](
        qkv, qkv.stride(0),
        f3, f3.stride(0), f3.stride(1),
        b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(),
        state, state.stride(0),
        state_indices, cu_seqlens,
        out, step_states if step_states is not None else state, cnt,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale),
        H=H, D=D, BV=bv, NV=D // bv, HAS_LB=lower_bound is not None, UPDATE=bool(update_state),
        STORE_STEPS=step_states is not None, num_warps=nw,
    )
    return out
