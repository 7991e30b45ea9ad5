"""The KDA decode as a Gluon kernel (Hopper): one program a (sequence, head) whose state copies into shared memory
start at the program's first instruction, before the PDL wait and before the token's q / k / v work.

Same function as the chunked decode of `kda_decode_kernel._kda_decode_kernel` (decode only: one token per
sequence, the pools advanced in place, [V, K] state pools, a head dim that is a multiple of 32 * num_warps
(128 at 4 warps), optionally the gated RMSNorm epilogue and the low-rank gates' up projections):

    y     = cast(SiLU(sum_j conv_w[c, j] x_{t-3+j}), io)   over [conv_state[s, c, 0..2], qkv[t, c]]
    q, k  = l2norm(y_q) * scale, l2norm(y_k);  v = y_v;  g from f + dt_bias;  beta = sigmoid(b)
    S     = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q;  [o = gated_rms_norm(o, gate, w, eps)]

with the reference's roundings (the conv output rounded to the io dtype; o rounded before the norm). Its sums may
associate differently from the Triton kernel's, so results are held to it within fp32 rounding (in the model's
decode-step A/B on the H200 the logits came out bit-equal).

Why (docs/kernels.md, "KDA decode"). The Triton chunked decode reaches ~85% of HBM at 96 heads x 64 sequences
while a Triton walk of the same tiles without the per-head work reaches ~91%: its software-pipelined loop issues
the first state tiles only after the head's conv, norms and gate, and the program has no state bytes in flight
during them. Here the copies come first: program (n, h) issues cp.async copies of its head's first NBUF tiles of
[BV, D] fp32 (BV contiguous rows of the [V, K] pool) into NBUF shared buffers as soon as it knows its slot, then
waits for the previous kernel (PDL), computes the token's inputs, and walks its NT = D / BV tiles as they land:
each is read into registers, updated, written straight back to the pool, and its buffer refilled with the tile
NBUF ahead. NBUF = NT holds the whole head (64 KB at D 128: 3 programs an SM).

Layouts (NW warps): a state tile [BV, D] has one row of D values per warp at a time, 4 consecutive values a
thread (16-byte copies and stores, a warp's row 512 contiguous bytes), so both reductions over the key axis stay
inside a warp. The q / k / v channels ([D] each) are held without replication, so every conv-state element is
read and then written by the same thread: the shift needs no barrier. v goes through a small shared buffer to
each tile's [BV] row layout; o's rows go to another for the norm.

Low-rank gates (LOW_RANK_F / LOW_RANK_G, `kda_decode(f_low_rank=, gate_low_rank=)`): the head's rows of the
[H * D, RANK] up weights are copied into shared memory (one commit group, before the state tiles') before the wait;
after it, f (and the norm gate) = cast(w @ a[t]) from the low-rank input row, fp32 over RANK, rounded once as the
GEMV it replaces stores it. Built and compiled for sm_90; not yet timed on the GPU, and no table row takes it.

PDL (`tokenspeed.ops.triton.pdl`): before the wait the program reads its slot and bounds (copied in before the
step's first kernel), the two pools (written only by KDA ops of earlier steps), A_log, the conv weight, dt_bias,
the norm weight and the low-rank up weights; qkv, f (or f_a), b and the norm gate (or g_a), the projections'
outputs, after it. Every program waits (none
exits early; a padding row, slot < 0, runs masked and touches no pool), then triggers its dependents.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.triton.gluon_common import hopper as _hopper

try:  # Gluon's API changes between Triton releases: `unusable_reason` refuses other versions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

SMEM_PER_PROGRAM = 227 * 1024  # sm_90's dynamic shared memory per block


def smem_bytes(D: int, block_v: int, num_buffers: int, up_ranks: tuple[int, ...] = ()) -> int:
    """Shared memory of one program: the state buffers plus the staged v and o rows (fp32), and the head's rows of
    each low-rank up weight (16-bit, one [D, rank] buffer a weight)."""
    return (num_buffers * block_v * D + 2 * D) * 4 + sum(D * r * 2 for r in up_ranks)


def unusable_reason(qkv: Tensor, state: Tensor, D: int, block_v: int, num_buffers: int, num_warps: int, *, T: int,
                    N: int, update_state: bool, step_states: Tensor | None, seq_lens: Tensor | None,
                    max_seq_tokens: int | None, state_v_first: bool, low_rank: tuple[Tensor, ...] = ()
                    ) -> str | None:
    """Why this kernel cannot run a `kda_decode` call (None: it can): Gluon of TRITON_VERSIONS on an sm_90 GPU; a
    decode (update_state, no step_states / seq_lens) of one token per sequence (T == N, bounded by the caller:
    max_seq_tokens == 1); [V, K] pools; a 16-bit qkv; a power-of-two head dim that is a multiple of 32 *
    num_warps (1, 2 or 4: every channel one thread's); block_v a power of two in num_warps..32; the buffers within
    1..D / block_v and a block's shared memory. low_rank: the up weights [H * D, R] of the low-rank gate inputs the
    call passes (`kda_decode(f_low_rank=, gate_low_rank=)`): qkv's dtype, R 32, 64 or 128, 16-byte aligned."""
    if not (qkv.is_cuda and _hopper(qkv.device)):
        return "needs Gluon (Triton 3.6) on an sm_90 GPU"
    why = call_unusable_reason(T=T, N=N, update_state=update_state, step_states=step_states, seq_lens=seq_lens,
                               max_seq_tokens=max_seq_tokens, state_v_first=state_v_first)
    if why is not None:
        return why
    if qkv.dtype not in (torch.bfloat16, torch.float16):
        return "16-bit qkv only"
    if D & (D - 1) or D % (32 * num_warps) or num_warps not in (1, 2, 4):
        return (f"head dim ({D}) must be a power of two and a multiple of 32 * num_warps (num_warps 1, 2 or 4: "
                f"{num_warps})")
    if block_v & (block_v - 1) or not num_warps <= block_v <= 32 or D % block_v:
        return f"block_v ({block_v}) must be a power of two in {num_warps}..32 dividing {D}"
    if not 1 <= num_buffers <= D // block_v:
        return f"num_buffers must be in 1..{D // block_v}; got {num_buffers}"
    for w in low_rank:
        if w.dtype != qkv.dtype or w.shape[1] not in (32, 64, 128) or w.data_ptr() % 16:
            return "low-rank up weights must be qkv's dtype, of rank 32, 64 or 128, 16-byte aligned"
    need = smem_bytes(D, block_v, num_buffers, tuple(w.shape[1] for w in low_rank))
    if need > SMEM_PER_PROGRAM:
        return f"{need} B of shared memory > {SMEM_PER_PROGRAM}"
    if state.data_ptr() % 16 or state.stride(0) % 4:
        return "the state pool's slots must be 16-byte aligned"
    return None


def call_unusable_reason(*, T: int, N: int, update_state: bool, step_states: Tensor | None, seq_lens: Tensor | None,
                         max_seq_tokens: int | None, state_v_first: bool) -> str | None:
    """The part of `unusable_reason` that depends on the call, not on the device or the tensors: a decode of one
    token per sequence on [V, K] pools (None), else why not."""
    if not update_state or step_states is not None or seq_lens is not None:
        return "decode only (update_state, no step_states or seq_lens)"
    if T != N or max_seq_tokens != 1:
        return "one token per sequence only (T == N and max_seq_tokens == 1)"
    if not state_v_first:
        return "[V, K] state pools only (state_v_first)"
    return None


if gluon is not None:
    from tokenspeed.ops.triton.gluon_common import grid_dependency as _grid_dependency

    @gluon.jit
    def _issue_tile(s_s, p_head, c, buf, rv, kk, live, BV: gl.constexpr, D: gl.constexpr):
        """cp.async of V tile c of the head (rows c * BV + rv of the [V, K] slot at p_head) into buffer `buf`; lanes
        off `live` (a padding row) zero-filled, nothing read. One commit group."""
        ptrs = p_head + (c * BV + rv)[:, None] * D + kk[None, :]
        cp.async_copy_global_to_shared(s_s.index(buf), ptrs, mask=live, cache_modifier=".cg")
        cp.commit_group()

    @gluon.jit
    def _conv_silu(x, s0, s1, s2, CW, ch, OUT_TY: gl.constexpr):
        """cast(SiLU(w0 s0 + w1 s1 + w2 s2 + w3 x), OUT_TY) as fp32 (the Triton kernel's products and order): the
        width-4 conv of channels `ch` over the old conv-state taps s0..s2 and the new input x."""
        y = gl.load(CW + ch * 4 + 0) * s0
        y += gl.load(CW + ch * 4 + 1) * s1
        y += gl.load(CW + ch * 4 + 2) * s2
        y += gl.load(CW + ch * 4 + 3) * x
        return (y / (1.0 + gl.exp(-y))).to(OUT_TY).to(gl.float32)

    @gluon.jit
    def _old_taps(cs, ch, stride_csc, stride_csw, live):
        """The conv state's three taps of channels `ch` (fp32; 0 off `live`)."""
        p = cs + ch * stride_csc
        s0 = gl.load(p, mask=live, other=0.0).to(gl.float32)
        s1 = gl.load(p + stride_csw, mask=live, other=0.0).to(gl.float32)
        s2 = gl.load(p + 2 * stride_csw, mask=live, other=0.0).to(gl.float32)
        return s0, s1, s2

    @gluon.jit
    def _shift_taps(cs, ch, stride_csc, stride_csw, live, s1, s2, x):
        """The conv state of channels `ch` advanced by one input x: [s1, s2, x] (the caller read s0..s2 first, in
        the same thread)."""
        p = cs + ch * stride_csc
        ty = cs.dtype.element_ty
        gl.store(p, s1.to(ty), mask=live)
        gl.store(p + stride_csw, s2.to(ty), mask=live)
        gl.store(p + 2 * stride_csw, x.to(ty), mask=live)

    @gluon.jit
    def _issue_up(w_s, W, h, D: gl.constexpr, RANK: gl.constexpr, NW: gl.constexpr):
        """cp.async of the head's rows h * D .. h * D + D - 1 of a contiguous [H * D, RANK] low-rank up weight into
        w_s [D, RANK] (16 bytes a copy; no commit: the caller's group)."""
        LC: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (RANK // 8), RANK // 8], [NW, 1], [1, 0])
        rows = gl.arange(0, D, layout=gl.SliceLayout(1, LC))
        cols = gl.arange(0, RANK, layout=gl.SliceLayout(0, LC))
        cp.async_copy_global_to_shared(w_s, W + (h * D + rows).to(gl.int64)[:, None] * RANK + cols[None, :])

    @gluon.jit
    def _up_row(w_s, A, row_off, D: gl.constexpr, RANK: gl.constexpr, NW: gl.constexpr, OUT_TY: gl.constexpr,
                L1: gl.constexpr):
        """cast(w @ A[row]) [D] as fp32 in layout L1: the low-rank up projection of one input row (at element offset
        row_off of A) by the head's weight rows in w_s [D, RANK], fp32 over RANK in 32-column chunks, rounded once to
        OUT_TY as the GEMV it replaces stores it (its summation order may differ)."""
        LW: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])  # a warp: 8 rows x 32 columns
        acc = gl.zeros([D], gl.float32, gl.SliceLayout(1, LW))
        for c in gl.static_range(RANK // 32):
            w = w_s.slice(c * 32, 32, dim=1).load(LW).to(gl.float32)
            a = gl.load(A + row_off + c * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, LW))).to(gl.float32)
            acc += gl.sum(w * a[None, :], axis=1)
        return gl.convert_layout(acc.to(OUT_TY).to(gl.float32), L1)

    @gluon.jit(do_not_specialize=["lower_bound", "scale", "norm_eps"])
    def _kda_decode_gluon_kernel(
        QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh,
        CW, CS, stride_css, stride_csc, stride_csw, A_log, DT, S, stride_ss, SLOTS, CU,
        O, G, stride_gt, stride_gh, NWT, FB, GA, stride_ga, GB, lower_bound, scale, norm_eps,
        H: gl.constexpr, D: gl.constexpr, BV: gl.constexpr, NBUF: gl.constexpr, HAS_LB: gl.constexpr,
        NORM: gl.constexpr, PDL: gl.constexpr, NW: gl.constexpr, LOW_RANK_F: gl.constexpr = False,
        LOW_RANK_G: gl.constexpr = False, RANK: gl.constexpr = 32,
    ):
        NT: gl.constexpr = D // BV
        # state tiles [BV, D]: a warp a row, 4 consecutive keys a thread; key vectors are its dim-0 slice
        LT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        LK: gl.constexpr = gl.SliceLayout(0, LT)
        LR: gl.constexpr = gl.SliceLayout(1, LT)
        # [D] channel vectors (q, k, v, gate), D / (32 NW) a thread, no replication
        L1: gl.constexpr = gl.BlockedLayout([D // (32 * NW)], [32], [NW], [0])
        SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SH1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        pid = gl.program_id(0)
        n = pid // H
        h = pid % H
        HD = H * D
        OUT_TY = O.dtype.element_ty

        # before the wait: slot and bounds, the state copies, the conv-state taps, the constant weights
        slot_raw = gl.load(SLOTS + n).to(gl.int64)
        slot = gl.maximum(slot_raw, 0)
        t = gl.load(CU + n).to(gl.int64)
        seq_len = gl.load(CU + n + 1).to(gl.int64) - t
        rv = gl.arange(0, BV, layout=LR)
        kk = gl.arange(0, D, layout=LK)
        live_t = (((rv * 0 + slot_raw) >= 0) & ((rv * 0 + seq_len) > 0))[:, None]  # [BV, 1]: a padding row
        p_head = S + slot * stride_ss + h * D * D
        if LOW_RANK_F or LOW_RANK_G:  # the up weights' rows first (one group, older than the state tiles')
            SW: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
            fb_s = gl.allocate_shared_memory(FB.dtype.element_ty, [D, RANK], SW)
            gb_s = gl.allocate_shared_memory(GB.dtype.element_ty, [D, RANK], SW)
            if LOW_RANK_F:
                _issue_up(fb_s, FB, h, D, RANK, NW)
            if LOW_RANK_G:
                _issue_up(gb_s, GB, h, D, RANK, NW)
            cp.commit_group()
        s_s = gl.allocate_shared_memory(gl.float32, [NBUF, BV, D], SH)
        for c in gl.static_range(NBUF):
            _issue_tile(s_s, p_head, c, c, rv, kk, live_t, BV, D)

        ck = gl.arange(0, D, layout=L1)
        live1 = ((ck * 0 + slot_raw) >= 0) & ((ck * 0 + seq_len) > 0)
        cq = h * D + ck
        ckk = HD + cq
        cv = 2 * HD + cq
        cs = CS + slot * stride_css
        q0, q1, q2 = _old_taps(cs, cq, stride_csc, stride_csw, live1)
        k0, k1, k2 = _old_taps(cs, ckk, stride_csc, stride_csw, live1)
        v0, v1, v2 = _old_taps(cs, cv, stride_csc, stride_csw, live1)
        rate = gl.exp(gl.load(A_log + h).to(gl.float32))
        dtb = gl.load(DT + h * D + ck).to(gl.float32)
        if PDL:
            _grid_dependency(pid)

        # the token's inputs (qkv, f, b: the projections' outputs)
        xq = gl.load(QKV + t * stride_qkv + cq, mask=live1, other=0.0).to(gl.float32)
        xk = gl.load(QKV + t * stride_qkv + ckk, mask=live1, other=0.0).to(gl.float32)
        xv = gl.load(QKV + t * stride_qkv + cv, mask=live1, other=0.0).to(gl.float32)
        if LOW_RANK_F or LOW_RANK_G:
            cp.wait_group(NBUF)  # the up weights (only the state tiles' groups may still be in flight)
            gl.thread_barrier()
        if LOW_RANK_F:  # F: the low-rank input f_a [T, RANK] (row stride stride_ft)
            f = _up_row(fb_s, F, t * stride_ft, D, RANK, NW, OUT_TY, L1)
        else:
            f = gl.load(F + t * stride_ft + h * stride_fh + ck, mask=live1, other=0.0).to(gl.float32)
        if LOW_RANK_G:  # the output norm's gate from g_a [T, RANK]
            gate_lr = _up_row(gb_s, GA, t * stride_ga, D, RANK, NW, OUT_TY, L1)
        braw = gl.load(Bt + t * stride_bt + h * stride_bh).to(gl.float32)
        yq = _conv_silu(xq, q0, q1, q2, CW, cq, OUT_TY)
        yk = _conv_silu(xk, k0, k1, k2, CW, ckk, OUT_TY)
        yv = _conv_silu(xv, v0, v1, v2, CW, cv, OUT_TY)
        _shift_taps(cs, cq, stride_csc, stride_csw, live1, q1, q2, xq)
        _shift_taps(cs, ckk, stride_csc, stride_csw, live1, k1, k2, xk)
        _shift_taps(cs, cv, stride_csc, stride_csw, live1, v1, v2, xv)
        q = yq * gl.rsqrt(gl.sum(yq * yq, axis=0) + 1e-6) * scale
        k = yk * gl.rsqrt(gl.sum(yk * yk, axis=0) + 1e-6)
        xg = f + dtb
        if HAS_LB:
            g = lower_bound / (1.0 + gl.exp(-(rate * xg)))
        else:
            sp = gl.where(xg > 20.0, xg, gl.log(1.0 + gl.exp(gl.minimum(xg, 20.0))))
            g = -rate * sp
        beta = 1.0 / (1.0 + gl.exp(-braw))
        qt = gl.convert_layout(q, LK)
        kt = gl.convert_layout(k, LK)
        dt = gl.convert_layout(gl.exp(g), LK)
        v_s = gl.allocate_shared_memory(gl.float32, [D], SH1)
        v_s.store(yv)
        o_s = gl.allocate_shared_memory(gl.float32, [D], SH1)
        gl.thread_barrier()  # v staged for every warp

        p_rows = p_head + rv[:, None] * D + kk[None, :]
        for c in gl.static_range(NT):
            # tile c's group done: groups are committed in tile order, NBUF before the loop, one per refill
            if c + NBUF < NT:
                cp.wait_group(NBUF - 1)
            else:
                cp.wait_group(NT - c - 1)
            gl.thread_barrier()  # every thread's copies of it visible to all
            b_s = s_s.index(c % NBUF).load(LT)
            yvc = v_s.slice(c * BV, BV).load(LR)
            b_s = b_s * dt[None, :]
            pred = gl.sum(b_s * kt[None, :], axis=1)
            nu = beta * (yvc - pred)
            b_s = b_s + nu[:, None] * kt[None, :]
            o = gl.sum(b_s * qt[None, :], axis=1).to(OUT_TY)
            gl.store(p_rows + c * BV * D, b_s, mask=live_t)
            if NORM:
                o_s.slice(c * BV, BV).store(o.to(gl.float32))
            else:
                gl.store(O + (t * H + h) * D + c * BV + rv, o, mask=(rv * 0 + seq_len) > 0)
            if c + NBUF < NT:
                gl.thread_barrier()  # every warp is done with the buffer before it is refilled
                _issue_tile(s_s, p_head, c + NBUF, c % NBUF, rv, kk, live_t, BV, D)

        if NORM:  # o rounded as stored, then y = o * rsqrt(mean(o^2) + eps) * w * sigmoid(gate), one rounding
            gl.thread_barrier()
            x = o_s.load(L1)
            if LOW_RANK_G:
                gate = gate_lr
            else:
                gate = gl.load(G + t * stride_gt + h * stride_gh + ck, mask=live1, other=0.0).to(gl.float32)
            w = gl.load(NWT + ck).to(gl.float32)
            inv = gl.rsqrt(gl.sum(x * x, axis=0) / D + norm_eps)
            y = x * inv * w * (1.0 / (1.0 + gl.exp(-gate)))
            gl.store(O + (t * H + h) * D + ck, y.to(OUT_TY), mask=(ck * 0 + seq_len) > 0)


def launch(qkv: Tensor, f: Tensor, b: Tensor, cw: Tensor, conv_state: Tensor, A_log: Tensor, dt_bias: Tensor,
           state: Tensor, state_indices: Tensor, cu_seqlens: Tensor, out: Tensor, gate: Tensor | None,
           norm_weight: Tensor | None, *, lower_bound: float | None, scale: float, norm_eps: float, block_v: int,
           num_buffers: int, num_warps: int, pdl_on: bool, f_up: Tensor | None = None,
           gate_low_rank: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """out [T, H, D] (written) = the decode of a call `unusable_reason` accepts; advances conv_state and state in
    place for the rows with a slot >= 0. cw: the fp32 [C, 4] conv weight, contiguous. f: [T, H, D] (unit last
    stride), or with f_up (the [H * D, R] up weight) the low-rank input f_a [T, R]. norm_weight [D] turns the norm
    epilogue on, its gate either `gate` [T, H, D] (unit last stride) or gate_low_rank's cast(g_a @ w^T)."""
    H, D = dt_bias.shape
    N = state_indices.numel()
    norm = norm_weight is not None
    g = gate if gate is not None else out
    ga, gb = gate_low_rank if gate_low_rank is not None else (qkv, f_up)
    fb = f_up if f_up is not None else gb  # (an unused weight stands in for the other: the same dtype)
    up = fb if fb is not None else A_log
    rank = up.shape[1] if fb is not None else 32
    _kda_decode_gluon_kernel[(N * H,)](
        qkv, qkv.stride(0), f, f.stride(0), f.stride(1) if f_up is None else 0, b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), A_log,
        dt_bias.contiguous(), state, state.stride(0), state_indices, cu_seqlens,
        out, g, g.stride(0), g.stride(1), norm_weight.contiguous() if norm else A_log,
        up, ga, ga.stride(0), gb if gb is not None else up,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale), float(norm_eps),
        H=H, D=D, BV=block_v, NBUF=num_buffers, HAS_LB=lower_bound is not None, NORM=norm, PDL=pdl_on,
        NW=num_warps, LOW_RANK_F=f_up is not None, LOW_RANK_G=gate_low_rank is not None, RANK=rank,
        num_warps=num_warps, **({"launch_pdl": True} if pdl_on else {}))
    return out
