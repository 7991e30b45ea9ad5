"""The fused KDA decode kernel `_kda_decode_kernel` and its jit helpers: KDA decode / k-token verify in one launch per
layer, and the multi-layer state replay. The host wrappers (`kda_decode`, `kda_replay_layers`), their argument
checks and launch constants are in `tokenspeed.ops.triton.kda_decode`.

For each sequence n (tokens cu_seqlens[n]..cu_seqlens[n+1], any count, normally 1 for decode and k for verify),
its state slot s = state_indices[n], and each head h, the kernel does, token by token:

    x_t   = qkv[t, {q,k,v} channels of head h]            (strided rows of the merged projection, read in place)
    y     = cast(SiLU(sum_j conv_w[c, j] * x_{t-3+j}), io)  (window from conv_state[s] then the new tokens)
    q, k  = l2norm(y_q) * scale, l2norm(y_k);  v = y_v
    g     = lambda * sigmoid(exp(A_log[h]) * (f + dt_bias))   or   -exp(A_log[h]) * softplus(f + dt_bias)
    beta  = sigmoid(b[t, h])
    S     = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o_t = S^T q

That is `ops.causal_conv1d` + `ops.l2_normalize` + `ops.kda_gate` + sigmoid + `ops.kda_recurrent` fused, with the
same roundings (the conv output is rounded to the io dtype, as the reference's conv returns it). Two schedules
(`KdaConfig.chunked`, chosen per launch by `default_config`):

- split (the original): program (v, n*H + h) holds the [K, BV] slice v of S in registers for the whole sequence
  (read once from state[s, h], written once). Few programs per SM at large N * H: a [128, 64] tile needs 203
  registers per thread (sm_90; 221 with Triton 3.6: 2 CTAs of 4 warps per SM, 64 KB of state in flight), a
  [128, 32] tile 127 (4 CTAs, 64 KB), and a program has its state read in flight only between its slot load and
  its first reduction: the rest of its life (conv, norms, counter, conv-state epilogue) moves no state.
- chunked: program (0, n*H + h) walks the NC = BK / BV tiles of the head. Decode and replay (update_state):
  token by token, q / k / gate computed once, then the tiles in a `tl.range(num_stages=STAGES)` loop that Triton
  software-pipelines (STAGES - 1 tiles in flight through shared memory via cp.async while one is updated), each
  read from and written back to the pool; each token shifts the head's conv state in place, so the next
  token again reads its window as token 0 (compile-time tap masks) and nothing is live across the q / k work but
  one tile. v is computed for the whole head with q / k and staged in o[t, h] (rounded to o's dtype, as the
  reference rounds it); each tile reads its slice back and overwrites it with o. The head's conv window is shifted
  right after that staging (the shift's barrier publishes it), so nothing but a barrier follows the tiles (the
  replay, which convolves v per tile, shifts it after them). 125 registers at BV 32 (128 with
  Triton 3.6; 4 CTAs), 95 at BV 16 (120), 72 at BV 8 (87); no V-split counter, no recomputed q / k conv. Several
  tokens pass the state between tokens through the pool (one read and write per token; the default keeps such
  launches on split, or for verify the WY kernel of `kda_verify_wy.py`). The replay (no outputs) convolves v per tile instead. Verify (update_state False): tile by
  tile, each carried through all tokens in registers, the next tile prefetched into registers.

`update_state=True` (decode): conv_state[s] and state[s] are advanced in place. `update_state=False` (verify):
neither pool is written; `step_states` [T, H, K, V] fp32, if given, receives the state after every token, so
the caller can commit the state after the last accepted token.

CUDA-graph safe: no host synchronisation (lengths and slots are read on the device), a grid that depends only on
tensor shapes, and outputs allocated by shape. A slot < 0 marks a padding row of a graph bucket: its outputs are
zeros and no state is touched.

When the V dimension is split over several programs (split, BV < V: more parallelism for small batches) every
program of a head computes the q/k conv of that head, so the q/k conv-state columns must be written only after all
of them have read the old ones: each program bumps a per-(sequence, head) counter after its reads (acq_rel atomic)
and the last one writes those columns and resets the counter to zero for the next launch.

Any head dim D: the K axis of the tile is padded to BK = next_pow2(D) and the V axis split into NV = ceil(D / BV)
blocks of a power-of-two BV (tl.arange needs powers of two). Padded lanes are masked on every load and store and
read as zeros (conv input, conv weight, f, dt_bias, state), so they add nothing to the L2 norms, the recurrence or
the outputs, and are never written. When D is a power of two (and BV divides it) the masks are compile-time
no-ops (EVEN_K / EVEN_V): the same code as the unpadded kernel.

Norm epilogue (NORM, `kda_decode(norm_gate=, norm_weight=, norm_eps=)`): the KDA output norm
`gated_rms_norm(o, gate, w, eps)` applied in the kernel, in place on the o rows it wrote, by the formula and
operation order of `triton.norm.gated_rms_norm` (fp32 from the rounded o as stored, one rounding at the end), so
it equals that kernel after the plain launch up to the order of the fp32 sum of squares (bit-identical in the
interpreter; on the GPU the two reductions may associate differently: within 1 ulp of the io dtype where they do).
Split with NV > 1: the head's o row is spread over NV programs, so the counter pass above also picks the program
that norms it: the last to arrive, after its acq_rel atomic, reads the rows back through L2 (.cg). Verify
launches take the counter too (they write no conv state), and the last arriver still resets it: one pass serves
both uses. NV = 1 and chunked: the program owns the head; a CTA barrier orders its o stores before the reads.
BR = NORM_ROWS rows are normed per step (several tokens per sequence: verify, prompt tails).

Low-rank gates (LOW_RANK_F / LOW_RANK_G, `kda_decode(f_low_rank=, gate_low_rank=)`; one token per sequence, split
without the window loop, and chunked decode): the up projections of the low-rank gates run in the kernel instead of
a GEMV launch before it. LOW_RANK_F: F is the low-rank input f_a [T, RANK] (stride_ft its row stride) and FB the up
weight [H * D, RANK] (RANK <= 128): every program loads its head's rows of FB into registers before the PDL wait, in
NCH chunks of RC columns, and computes each token's f where it would have read it (`_f_lanes`: fp32 over RANK,
rounded to the io dtype as the GEMV's output is), so its loads overlap the q / k conv's. LOW_RANK_G: GA / GB the
same for the output-norm gate, of the value lanes a program norms or owns (split: its BV lanes, chunked: the head),
computed after the token's recurrence and stored into G (the host's [T, H, D] scratch), which the norm epilogue
reads back after the barriers / counter that already order the o stores. Host rule: decode launches of exactly one
token per sequence (T == N, `max_seq_tokens=1`), so the token loops run one trip (folded at compile time).

PDL (`tokenspeed.ops.triton.pdl`; Hopper, compiled code only): before `gdc_wait` a single-layer launch reads only its
slot and bounds (`state_indices[n]`, `cu_seqlens[n:n+2]`), the recurrent-state pool (split: its [BK, BV] tile into
registers; chunked verify: the first tile; chunked decode: a bulk L2 prefetch of the head's state rows, PF_STATE,
issued with or without PDL on sm_90 when the rows are 16-byte aligned and `KdaConfig.prefetch_state` asks; off by
default), A_log, and issues L2 prefetch hints for the conv weight, conv state, dt_bias and norm weight rows it
reads first. Prefetch hints are correct whatever wrote the memory (no data is consumed). The state pool is
written only by KDA ops of earlier steps (never by either of the two launches before this one). Slots and bounds come
from a host-to-device copy, which the protocol allows pre-wait only when it was written at least two launches earlier:
in the model the batch's slots and cu_seqlens are copied in before the step's first kernel (one copy of the batch's host
buffer; a graph's static buffers are filled before its replay) and no kernel writes them, while embedding, norms,
in_proj and the gate projection run before a KDA layer (in_proj a cuBLAS launch, which starts only after everything
before it completed). The caller contract of `kda_decode` states it. seq_lens (the replay's accepted counts, produced by
the kernel just before), the projections, the gate and every write come after the wait, and `gdc_launch_dependents`
right after it. No program exits early (padding rows run masked), so every program waits. The multi-layer replay waits
first thing (its offset table may have been copied in just before by an eager replay; as the only kernel of its graph it
overlaps nothing anyway). The V-split counters are touched only after the wait, so consecutive launches sharing them are
ordered.

`kda_replay_layers` (MULTI_LAYER): the state replay of accepted drafts over all L KDA layers of a model in one
launch, grid (NV, N * H, L). Program (., ., l) adds row l of an int64 [L, 8] element-offset table
(`tokenspeed.ops.kda_layers.KdaLayerTable`, built once on the host) to the layer-0 base pointer of each per-layer
tensor (qkv, f, b, conv weight, conv state, A_log, dt_bias, state); strides, slots, lengths and accepted counts
are shared. With STORE_OUT False the q path (q conv, its norm, o = S^T q and the output store) is skipped: a
replay only advances the pools. The single-layer launch passes MULTI_LAYER False / STORE_OUT True, which compile
those branches away.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton.kda_low_rank import _store_gate, _up_apply, _up_weights


@triton.jit
def _pdl_sync(PDL: tl.constexpr):
    """PDL: wait for the previous kernel of the stream (completed, its memory visible), then let the next one be
    scheduled (`tokenspeed.ops.triton.pdl`). No-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _layer_bases(LOFF, layer, QKV, F, Bt, CW, CS, A_log, DT, S):
    """A multi-layer launch's pointers for `layer`: layer 0's plus row `layer` of the offset table (element
    offsets; columns: kda_layers.LAYER_FIELDS)."""
    row = LOFF + layer * 8
    return (QKV + tl.load(row + 0), F + tl.load(row + 1), Bt + tl.load(row + 2), CW + tl.load(row + 3),
            CS + tl.load(row + 4), A_log + tl.load(row + 5), DT + tl.load(row + 6), S + tl.load(row + 7))


@triton.jit
def _prefetch_l2(ptrs, mask, base):
    """An L2 prefetch hint for every address of `ptrs` (lanes outside `mask` prefetch `base`, a valid address).
    Nothing is read into registers, so it is correct whatever wrote (or later writes) the memory: L2 is the point
    of coherence, and `prefetch.global.L2` fills no L1 line. Compiled code only (inline PTX)."""
    p = tl.where(mask, ptrs, base)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [p], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _prefetch_l2_bulk(ptrs, nbytes, mask):
    """`cp.async.bulk.prefetch.L2` of `nbytes` (a multiple of 16) from each 16-byte aligned address of `ptrs`
    where `mask` (sm_90; a hint like `_prefetch_l2`: fire and forget, no registers held)."""
    n = tl.where(mask, nbytes, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, n], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_lanes(ptr, lane, EVEN: tl.constexpr):
    """tl.load(ptr) of a padded tile axis: lanes with `lane` False read 0. EVEN (every lane real): unmasked."""
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=lane, other=0.0)
    return x


@triton.jit
def _f_lanes(F, stride_ft, stride_fh, wf0, wf1, wf2, wf3, t, h, D: tl.constexpr, ok, lk, EVEN_K: tl.constexpr,
             LOW_RANK_F: tl.constexpr, RANK: tl.constexpr, RC: tl.constexpr, NCH: tl.constexpr):
    """Token t's decay-gate logits f [BK] fp32 of head h: read from F [T, H, D], or (LOW_RANK_F) computed from the
    low-rank input row F[t] (stride_ft its row stride) and the head's up-weight chunks held in registers."""
    if LOW_RANK_F:
        f = _up_apply(F, t * stride_ft, wf0, wf1, wf2, wf3, t * 0 + 1, RANK, RC, NCH)
    else:
        f = _load_lanes(F + t * stride_ft + h * stride_fh + ok, lk, EVEN_K).to(tl.float32)
    return f


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
def _conv_weights(CW, ch, lane, EVEN: tl.constexpr):
    """The four taps w[ch, 0..3] of the width-4 conv as fp32 vectors (padded lanes 0; `_conv_tap`'s loads)."""
    return (_load_lanes(CW + ch * 4 + 0, lane, EVEN), _load_lanes(CW + ch * 4 + 1, lane, EVEN),
            _load_lanes(CW + ch * 4 + 2, lane, EVEN), _load_lanes(CW + ch * 4 + 3, lane, EVEN))


@triton.jit
def _row_input(QKV, stride_qkv, t, ch, m):
    """Pre-conv input of channels `ch` at token row t as fp32; 0 off `m` (padded lanes, rows past the sequence)."""
    return tl.load(QKV + t * stride_qkv + ch, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _silu_window(w0, w1, w2, w3, x0, x1, x2, x3, OUT_TY: tl.constexpr):
    """`_conv_silu` from a window held in registers: the same products, summed in the same order, same rounding."""
    y = w0 * x0
    y += w1 * x1
    y += w2 * x2
    y += w3 * x3
    return (y / (1.0 + tl.exp(-y))).to(OUT_TY).to(tl.float32)


@triton.jit
def _conv_tail(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ch, m):
    """The last 3 inputs of [old state, new tokens] of channels `ch`: the new conv state, read (not yet written)."""
    x0 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len - 3, ch, m)
    x1 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len - 2, ch, m)
    x2 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len - 1, ch, m)
    return x0, x1, x2


@triton.jit
def _write_conv_tail(cs, stride_csc, stride_csw, ch, m, x0, x1, x2):
    """Store a `_conv_tail` as the conv state of channels `ch`."""
    ty = cs.dtype.element_ty
    tl.store(cs + ch * stride_csc + 0 * stride_csw, x0.to(ty), mask=m)
    tl.store(cs + ch * stride_csc + 1 * stride_csw, x1.to(ty), mask=m)
    tl.store(cs + ch * stride_csc + 2 * stride_csw, x2.to(ty), mask=m)


@triton.jit
def _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ch, m):
    """New conv state of channels `ch`: the last 3 inputs of [old state, new tokens], all read before any write."""
    x0, x1, x2 = _conv_tail(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ch, m)
    tl.debug_barrier()
    _write_conv_tail(cs, stride_csc, stride_csw, ch, m, x0, x1, x2)


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
def _store_out(O, t, H, h, D, ov, o, lv, EVEN_V: tl.constexpr):
    """o[t, h, ov] = o in O's dtype (padded lanes, `lv` False, masked unless EVEN_V)."""
    if EVEN_V:
        tl.store(O + (t * H + h) * D + ov, o.to(O.dtype.element_ty))
    else:
        tl.store(O + (t * H + h) * D + ov, o.to(O.dtype.element_ty), mask=lv)


@triton.jit
def _store_state(p_s, b_s, mask, HINTS: tl.constexpr):
    """The state tile back to the pool; HINTS: a streaming (.cs) store."""
    if HINTS:
        tl.store(p_s, b_s, mask=mask, cache_modifier=".cs")
    else:
        tl.store(p_s, b_s, mask=mask)


@triton.jit
def _store_conv_states3(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cv, mv, cq, ck, mqk):
    """`_store_conv_state` of the v channels `cv` (mask mv) and the q / k channels (mask mqk): all nine inputs read,
    then one barrier, then the writes."""
    v0, v1, v2 = _conv_tail(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cv, mv)
    q0, q1, q2 = _conv_tail(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cq, mqk)
    k0, k1, k2 = _conv_tail(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ck, mqk)
    tl.debug_barrier()
    _write_conv_tail(cs, stride_csc, stride_csw, cv, mv, v0, v1, v2)
    _write_conv_tail(cs, stride_csc, stride_csw, cq, mqk, q0, q1, q2)
    _write_conv_tail(cs, stride_csc, stride_csw, ck, mqk, k0, k1, k2)


@triton.jit
def _gate(xg, rate, lower_bound, HAS_LB: tl.constexpr):
    """The log decay g from x = f + dt_bias (fp32): K3's lower_bound * sigmoid(rate * x), else -rate * softplus(x)."""
    if HAS_LB:
        g = lower_bound / (1.0 + tl.exp(-(rate * xg)))
    else:
        sp = tl.where(xg > 20.0, xg, tl.log(1.0 + tl.exp(tl.minimum(xg, 20.0))))
        g = -rate * sp
    return g


@triton.jit
def _token_inputs(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh,
                  DT, h, bos, i, cq, ck, ok, mk, lk, rate, lower_bound, scale, D: tl.constexpr, EVEN_K: tl.constexpr,
                  HAS_LB: tl.constexpr, STORE_OUT: tl.constexpr, OUT_TY: tl.constexpr, wf0, wf1, wf2, wf3,
                  LOW_RANK_F: tl.constexpr, RANK: tl.constexpr, RC: tl.constexpr, NCH: tl.constexpr):
    """Token i's per-head vectors (q, k, exp(g)) [BK] and beta: q/k conv + SiLU + L2 norm (q scaled), the gate (f
    read or, LOW_RANK_F, computed: `_f_lanes`). Without STORE_OUT the q path is skipped and q is a placeholder (k)."""
    t = bos + i
    if STORE_OUT:
        yq = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cq, mk, lk, EVEN_K, OUT_TY)
    yk = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, ck, mk, lk, EVEN_K, OUT_TY)
    f = _f_lanes(F, stride_ft, stride_fh, wf0, wf1, wf2, wf3, t, h, D, ok, lk, EVEN_K, LOW_RANK_F, RANK, RC, NCH)
    braw = tl.load(Bt + t * stride_bt + h * stride_bh).to(tl.float32)
    k = yk * tl.rsqrt(tl.sum(yk * yk, axis=0) + 1e-6)
    if STORE_OUT:
        q = yq * tl.rsqrt(tl.sum(yq * yq, axis=0) + 1e-6) * scale
    else:
        q = k
    g = _gate(f + _load_lanes(DT + h * D + ok, lk, EVEN_K).to(tl.float32), rate, lower_bound, HAS_LB)
    beta = 1.0 / (1.0 + tl.exp(-braw))
    return q, k, tl.exp(g), beta


@triton.jit
def _delta_step(b_s, q, k, decay, beta, yv, mv, STORE_OUT: tl.constexpr):
    """One token on a [BK, BV] state tile: S = diag(decay) S; S += k (beta (v - S^T k))^T; o = S^T q (0 off mv)."""
    b_s = b_s * decay[:, None]
    pred = tl.sum(b_s * k[:, None], axis=0)
    nu = beta * (yv - pred)
    b_s = b_s + k[:, None] * nu[None, :]
    if STORE_OUT:
        o = tl.where(mv, tl.sum(b_s * q[:, None], axis=0), 0.0)
    else:
        o = nu  # unused
    return b_s, o


@triton.jit
def _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, num_rows, h, H, D: tl.constexpr, ok, lk,
               BR: tl.constexpr):
    """The gated RMSNorm epilogue, in place on rows o[bos .. bos + num_rows - 1, h, :D] (lanes `ok`, real where
    `lk`), BR rows at a time: y = x * rsqrt(sum(x^2) / D + eps) * w * sigmoid(gate) in fp32 from the rounded o x as
    stored, rounded once to o's dtype (`triton.norm.gated_rms_norm`'s formula and order). The rows are read through
    L2 (.cg): other programs of the head wrote parts of them (the caller orders those writes before this read); the
    gate is read through L2 (.cg) too."""
    w = tl.load(NW + ok, mask=lk, other=0.0).to(tl.float32)
    r = tl.arange(0, BR)
    for r0 in range(0, num_rows, BR):
        t = bos + r0 + r
        m = (r0 + r < num_rows)[:, None] & lk[None, :]
        p = O + (t * H + h)[:, None] * D + ok[None, :]
        x = tl.load(p, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        g = tl.load(G + (t * stride_gt + h * stride_gh)[:, None] + ok[None, :], mask=m, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + norm_eps)
        y = x * inv[:, None] * w[None, :] * tl.sigmoid(g)
        tl.store(p, y.to(O.dtype.element_ty), mask=m)


@triton.jit
def _prefetch_inputs(CW, cs, stride_csc, stride_csw, DT, NW, h, D: tl.constexpr, ok, cq, ck, cvx, mk, mvx,
                     NORM: tl.constexpr):
    """L2 prefetch (before the PDL wait) of the weights and the conv-state rows this program reads first: conv
    weight and conv state of its q / k channels (`cq`, `ck`, mask `mk`) and v channels (`cvx`, mask `mvx`),
    dt_bias and the norm weight (NORM) of the head's key lanes `ok`."""
    _prefetch_l2(CW + cq * 4, mk, CW)
    _prefetch_l2(CW + ck * 4, mk, CW)
    _prefetch_l2(CW + cvx * 4, mvx, CW)
    for j in tl.static_range(3):
        _prefetch_l2(cs + cq * stride_csc + j * stride_csw, mk, cs)
        _prefetch_l2(cs + ck * stride_csc + j * stride_csw, mk, cs)
        _prefetch_l2(cs + cvx * stride_csc + j * stride_csw, mvx, cs)
    _prefetch_l2(DT + h * D + ok, mk, DT)
    if NORM:
        _prefetch_l2(NW + ok, mk, NW)


@triton.jit
def _split_window_tokens(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs, stride_csc,
                         stride_csw, DT, O, STEP, b_s, h, H, D: tl.constexpr, bos, seq_len, ok, ov, cq, ck, cv, mk, mv,
                         lk, lv, ms, s_off, rate, lower_bound, scale, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
                         HAS_LB: tl.constexpr, STORE_OUT: tl.constexpr, STORE_STEPS: tl.constexpr,
                         OUT_TY: tl.constexpr):
    """The split schedule's token loop with the conv window carried (WINDOW, for several tokens per sequence):
    the conv weights and dt_bias loaded once, the window's three older inputs kept in registers, and each next
    token's new input row, f and b loaded one token ahead, before this token's recurrence, so their latency
    overlaps it. Same arithmetic as the plain loop (equal in the interpreter; compiled, the conv's products may
    contract differently, so a bf16-rounded conv output can round the other way). Returns the [BK, BV] tile after
    the last token; writes o (STORE_OUT) and the per-token states (STORE_STEPS) as the plain loop does."""
    live = (ok * 0 + seq_len) > 0
    livev = (ov * 0 + seq_len) > 0
    if STORE_OUT:
        wq0, wq1, wq2, wq3 = _conv_weights(CW, cq, lk, EVEN_K)
        q0 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -3, cq, mk)
        q1 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -2, cq, mk)
        q2 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -1, cq, mk)
        q3 = _row_input(QKV, stride_qkv, bos, cq, mk & live)
    wk0, wk1, wk2, wk3 = _conv_weights(CW, ck, lk, EVEN_K)
    k0 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -3, ck, mk)
    k1 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -2, ck, mk)
    k2 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -1, ck, mk)
    k3 = _row_input(QKV, stride_qkv, bos, ck, mk & live)
    wv0, wv1, wv2, wv3 = _conv_weights(CW, cv, lv, EVEN_V)
    v0 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -3, cv, mv)
    v1 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -2, cv, mv)
    v2 = _conv_input(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, -1, cv, mv)
    v3 = _row_input(QKV, stride_qkv, bos, cv, mv & livev)
    dtb = _load_lanes(DT + h * D + ok, lk, EVEN_K).to(tl.float32)
    f = tl.load(F + bos * stride_ft + h * stride_fh + ok, mask=lk & live, other=0.0).to(tl.float32)
    braw = tl.load(Bt + bos * stride_bt + h * stride_bh, mask=seq_len > 0, other=0.0).to(tl.float32)
    for i in range(seq_len):
        t = bos + i
        # token i + 1's raw inputs first (zeros past the sequence): in flight during token i's recurrence
        nk = (ok * 0 + i + 1) < seq_len
        if STORE_OUT:
            qx = _row_input(QKV, stride_qkv, t + 1, cq, mk & nk)
        kx = _row_input(QKV, stride_qkv, t + 1, ck, mk & nk)
        vx = _row_input(QKV, stride_qkv, t + 1, cv, mv & ((ov * 0 + i + 1) < seq_len))
        fx = tl.load(F + (t + 1) * stride_ft + h * stride_fh + ok, mask=lk & nk, other=0.0).to(tl.float32)
        bx = tl.load(Bt + (t + 1) * stride_bt + h * stride_bh, mask=i + 1 < seq_len, other=0.0).to(tl.float32)

        yk = _silu_window(wk0, wk1, wk2, wk3, k0, k1, k2, k3, OUT_TY)
        yv = _silu_window(wv0, wv1, wv2, wv3, v0, v1, v2, v3, OUT_TY)
        k = yk * tl.rsqrt(tl.sum(yk * yk, axis=0) + 1e-6)
        if STORE_OUT:
            yq = _silu_window(wq0, wq1, wq2, wq3, q0, q1, q2, q3, OUT_TY)
            q = yq * tl.rsqrt(tl.sum(yq * yq, axis=0) + 1e-6) * scale
        else:
            q = k  # placeholder: the replay computes no output
        beta = 1.0 / (1.0 + tl.exp(-braw))
        b_s, o = _delta_step(b_s, q, k, tl.exp(_gate(f + dtb, rate, lower_bound, HAS_LB)), beta, yv, mv, STORE_OUT)
        if STORE_OUT:
            _store_out(O, t, H, h, D, ov, o, lv, EVEN_V)
        if STORE_STEPS:
            tl.store(STEP + (t * H + h) * D * D + s_off, b_s, mask=ms, cache_modifier=".cs")
        if STORE_OUT:
            q0, q1, q2, q3 = q1, q2, q3, qx
        k0, k1, k2, k3 = k1, k2, k3, kx
        v0, v1, v2, v3 = v1, v2, v3, vx
        f, braw = fx, bx
    return b_s


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
    G, stride_gt, stride_gh, NW,
    FB, GA, stride_ga, GB,
    lower_bound, scale, norm_eps,
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
    CHUNKS: tl.constexpr = 1,
    STAGES: tl.constexpr = 1,
    NORM: tl.constexpr = False,
    NORM_ROWS: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    PF_STATE: tl.constexpr = False,
    V_FIRST: tl.constexpr = False,
    WINDOW: tl.constexpr = False,
    PF_TILES: tl.constexpr = 0,
    PRELOAD: tl.constexpr = 0,
    LOW_RANK_F: tl.constexpr = False,
    LOW_RANK_G: tl.constexpr = False,
    RANK: tl.constexpr = 0,
    RC: tl.constexpr = 1,
    NCH: tl.constexpr = 1,
):
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    if MULTI_LAYER:  # one launch over L layers: layer l's tensors are layer 0's + row l of the offset table
        # The table may have been copied in just before (an eager replay builds a fresh one): nothing is read
        # before the PDL wait in this launch (the replay graph's only kernel gains nothing from it anyway).
        _pdl_sync(PDL)
        layer = tl.program_id(2)
        QKV, F, Bt, CW, CS, A_log, DT, S = _layer_bases(LOFF, layer, QKV, F, Bt, CW, CS, A_log, DT, S)
        CNT += layer * tl.num_programs(1)  # a V-split counter per (layer, sequence, head)
    n = pid_nh // H
    h = pid_nh % H
    HD = H * D
    OUT_TY = O.dtype.element_ty

    # Single-layer launch: up to `_pdl_sync` below, only reads allowed before the PDL wait (module docstring,
    # "PDL"): the slot and the sequence bounds, the recurrent-state pool and the weights.
    slot_raw = tl.load(SLOTS + n).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)
    bos = tl.load(CU + n).to(tl.int64)
    seq_len = tl.load(CU + n + 1).to(tl.int64) - bos

    ok = tl.arange(0, BK)                # key channel within the head (BK = D unless D is padded)
    ov = pid_v * (CHUNKS * BV) + tl.arange(0, BV)   # value channel within the head (chunked: of the first tile)
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
    # Element (k, v) of a head's state: k * D + v ([K, V] pools), or v * D + k (V_FIRST: [V, K] pools, where a
    # [K, BV] tile is BV contiguous rows). vstep: the offset of the next V tile.
    if V_FIRST:
        s_off = ov[None, :] * D + ok[:, None]
        vstep = BV * D
    else:
        s_off = ok[:, None] * D + ov[None, :]
        vstep = BV
    p_s = S + slot * stride_ss + h * D * D + s_off
    ms = mk[:, None] & mv[None, :]
    if CHUNKS == 1:
        b_s = _load_state(p_s, lk[:, None] & lv[None, :], EVEN_K and EVEN_V, HINTS)
        b_s = tl.where(ms, b_s, 0.0)  # a padding row reads slot 0 (lanes only, unmasked when even), then zeros
    elif not UPDATE:  # chunked verify: the first tile (the pool is not written by this launch)
        nxt = _load_state(p_s, lk[:, None] & lv[None, :], EVEN_K and EVEN_V, HINTS)

    if CHUNKS > 1 and UPDATE and PRELOAD:  # the first tile streams in during the token-input work below
        first = _load_state(p_s, lk[:, None] & lv[None, :], EVEN_K and EVEN_V, HINTS)

    rate = tl.exp(tl.load(A_log + h).to(tl.float32))
    if CHUNKS > 1 and UPDATE and PF_STATE and not MULTI_LAYER:
        # the head's state (read tile by tile in the pipelined loop below), by rows, into L2: it streams in while
        # the program computes q / k / gate (with or without PDL; sm_90, chosen on the host)
        if PF_TILES == 0:  # the whole head: D rows of D values
            _prefetch_l2_bulk(S + slot * stride_ss + h * D * D + ok * D, D * 4, mk)
        elif V_FIRST:  # the first PF_TILES tiles: the head's first PF_TILES * BV rows
            _prefetch_l2_bulk(S + slot * stride_ss + h * D * D + ok * D, D * 4, mk & (ok < PF_TILES * BV))
        else:  # [K, V]: the first PF_TILES * BV values of every row
            _prefetch_l2_bulk(S + slot * stride_ss + h * D * D + ok * D, PF_TILES * BV * 4, mk)
    if PDL and not MULTI_LAYER:  # L2 prefetch hints for what the first token reads next to the state
        if CHUNKS == 1:
            _prefetch_inputs(CW, cs, stride_csc, stride_csw, DT, NW, h, D, ok, cq, ck, cv, mk, mv, NORM)
        else:
            cw_all = 2 * HD + h * D + ok  # the head's v channels (CHUNKS * BV = BK)
            _prefetch_inputs(CW, cs, stride_csc, stride_csw, DT, NW, h, D, ok, cq, ck, cw_all, mk, mk, NORM)
    # LOW_RANK_F / _G: the head's rows of the low-rank up weights, into registers (constant: safe before the wait)
    if LOW_RANK_F:
        wf0, wf1, wf2, wf3 = _up_weights(FB, h, D, ok, lk, RANK, RC, NCH)
    else:  # placeholders
        wf0, wf1, wf2, wf3 = ok, ok, ok, ok
    if CHUNKS == 1:  # the gate lanes a program norms (split: its own) or owns (chunked: the head's)
        gl, glm = ov, lv
    else:
        gl, glm = ok, lk
    if LOW_RANK_G:
        wg0, wg1, wg2, wg3 = _up_weights(GB, h, D, gl, glm, RANK, RC, NCH)
    if not MULTI_LAYER:
        _pdl_sync(PDL)

    if HAS_LENS:  # only the first LENS[n] tokens of the sequence's rows (KDA replay of accepted drafts)
        seq_len = tl.maximum(tl.minimum(tl.load(LENS + n).to(tl.int64), seq_len), 0)
    if LOW_RANK_F or LOW_RANK_G:  # one token per sequence (the host's rule): a loop of one trip, folded away, so
        n_tok = 1                 # nothing is kept live across tokens (the up weights die after their use)
    else:
        n_tok = seq_len

    if CHUNKS == 1 and WINDOW:
        b_s = _split_window_tokens(QKV, stride_qkv, F, stride_ft, stride_fh, Bt, stride_bt, stride_bh, CW, cs,
                                   stride_csc, stride_csw, DT, O, STEP, b_s, h, H, D, bos, seq_len, ok, ov, cq, ck,
                                   cv, mk, mv, lk, lv, ms, s_off, rate, lower_bound, scale, EVEN_K, EVEN_V, HAS_LB,
                                   STORE_OUT, STORE_STEPS, OUT_TY)
    elif CHUNKS == 1:
        for i in range(n_tok):  # (the original code, kept verbatim: the same SASS as before the chunked paths)
            t = bos + i
            # Short conv + SiLU: the window is re-read per token (L1/L2 hits) instead of carried in registers.
            if STORE_OUT:  # the q path (conv, norm, o = S^T q): a state replay (STORE_OUT False) needs none of it
                yq = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cq, mk, lk, EVEN_K, OUT_TY)
            yk = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, ck, mk, lk, EVEN_K, OUT_TY)
            yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cv, mv, lv, EVEN_V, OUT_TY)
            f = _f_lanes(F, stride_ft, stride_fh, wf0, wf1, wf2, wf3, t, h, D, ok, lk, EVEN_K, LOW_RANK_F, RANK, RC,
                         NCH)
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
                tl.store(STEP + (t * H + h) * D * D + s_off, b_s, mask=ms,
                         cache_modifier=".cs")
            if LOW_RANK_G:  # off the recurrence's critical path; ordered before the norm by the epilogue's counter
                _store_gate(GA, stride_ga, wg0, wg1, wg2, wg3, G, stride_gt, stride_gh, t, h, gl, glm, RANK, RC, NCH)
    elif UPDATE:
        # Chunked, one program per head (decode, replay): token by token. The token's q / k / gate once, then the
        # CHUNKS V tiles in a software-pipelined loop (STAGES > 1: the next tiles' state in flight, through shared
        # memory, while this one is updated), each read from and written back to the pool slot; then the head's conv
        # state advanced by this token. So the state and the conv window pass between tokens through the pools, every
        # token reads its window as token 0 (compile-time tap masks) and no tile is live across the q / k work: the
        # registers of one tile. One token (decode): each tile read and written once.
        ow = tl.arange(0, CHUNKS * BV)  # the head's value channels (CHUNKS * BV >= D)
        mw = ((ow * 0 + slot_raw) >= 0) & (ow < D)
        for i in range(n_tok):
            t = bos + i
            q, k, decay, beta = _token_inputs(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, F, stride_ft, stride_fh,
                                              Bt, stride_bt, stride_bh, DT, h, t, 0, cq, ck, ok, mk, lk, rate,
                                              lower_bound, scale, D, EVEN_K, HAS_LB, STORE_OUT, OUT_TY,
                                              wf0, wf1, wf2, wf3, LOW_RANK_F, RANK, RC, NCH)
            if STORE_OUT:
                # v for the whole head with q / k, staged in o[t, h] (it is rounded to o's dtype anyway): the tile
                # loop reads its slice back and overwrites it with o, instead of a v conv per tile
                yw = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, t, 0, 2 * HD + h * D + ow, mw,
                                ow < D, EVEN_V, OUT_TY)
                tl.store(O + (t * H + h) * D + ow, yw.to(OUT_TY), mask=ow < D)
                # the head's conv window shifted now, before the tiles (which read no conv state here): its barrier
                # also publishes the staged v to the threads that read it back, and nothing but the end-of-token
                # barrier follows the last tile (1.0-1.4 points of HBM at 96 heads x 64, H200: docs/kernels.md)
                _store_conv_states3(QKV, stride_qkv, cs, stride_csc, stride_csw, t, 1, 2 * HD + h * D + ow, mw, cq, ck,
                                    mk)
            if STAGES == 1:  # no Triton pipelining: the next tile prefetched into registers by hand
                nxt = _load_state(p_s, lk[:, None] & lv[None, :], EVEN_K and EVEN_V, HINTS)
            if PRELOAD:  # tile 0 from the registers loaded before the token inputs (the loop's c = 0, as written)
                b_s = tl.where(ms, first, 0.0)
                if STORE_OUT:
                    yv = _load_lanes(O + (t * H + h) * D + ov, lv, EVEN_V).to(tl.float32)
                else:
                    yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, t, 0, cv, mv, lv, EVEN_V, OUT_TY)
                b_s, o = _delta_step(b_s, q, k, decay, beta, yv, mv, STORE_OUT)
                if STORE_OUT:
                    _store_out(O, t, H, h, D, ov, o, lv, EVEN_V)
                _store_state(p_s, b_s, ms, HINTS)
            for c in tl.range(PRELOAD, CHUNKS, num_stages=STAGES):
                ovc = ov + c * BV
                lvc = ovc < D
                mvc = mv
                if not EVEN_V:
                    mvc = mv & lvc
                msc = mk[:, None] & mvc[None, :]
                if STAGES == 1:
                    b_s = tl.where(msc, nxt, 0.0)
                    more = (ovc * 0 + c + 1) < CHUNKS  # none after the last tile
                    if not EVEN_V:
                        more = more & (ovc + BV < D)
                    nxt = tl.load(p_s + (c + 1) * vstep, mask=lk[:, None] & more[None, :], other=0.0)
                else:
                    b_s = _load_state(p_s + c * vstep, lk[:, None] & lvc[None, :], EVEN_K and EVEN_V, HINTS)
                    b_s = tl.where(msc, b_s, 0.0)
                if STORE_OUT:
                    yv = _load_lanes(O + (t * H + h) * D + ovc, lvc, EVEN_V).to(tl.float32)
                else:
                    yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, t, 0, cv + c * BV, mvc, lvc,
                                    EVEN_V, OUT_TY)
                b_s, o = _delta_step(b_s, q, k, decay, beta, yv, mvc, STORE_OUT)
                if STORE_OUT:
                    _store_out(O, t, H, h, D, ovc, o, lvc, EVEN_V)
                _store_state(p_s + c * vstep, b_s, msc, HINTS)
            if LOW_RANK_G:  # ordered before the norm epilogue's reads by the barriers below
                _store_gate(GA, stride_ga, wg0, wg1, wg2, wg3, G, stride_gt, stride_gh, t, h, gl, glm, RANK, RC, NCH)
            if not STORE_OUT:  # (the replay: its tiles convolve v from the window, so it is shifted after them)
                # this token's window reads (all threads) -> barrier -> the shifted window written -> barrier
                _store_conv_states3(QKV, stride_qkv, cs, stride_csc, stride_csw, t, 1, 2 * HD + h * D + ow, mw, cq,
                                    ck, mk)
            tl.debug_barrier()  # the state and conv-state writes before the next token's reads (other threads)
            if PRELOAD:  # the next token's tile 0, as this token wrote it (none after the last token)
                more_t = (ok * 0 + i + 1) < seq_len
                first = tl.load(p_s, mask=lk[:, None] & lv[None, :] & more_t[:, None], other=0.0)
        if NORM:  # this program wrote the whole o[t, h] rows (every tile), ordered by the barriers above
            _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, lk, NORM_ROWS)
    else:
        # Chunked, one program per head, pools untouched (verify): tile by tile, each carried through all tokens in
        # registers (the token's q / k / gate recomputed per tile: L1 hits), the state after every token written to
        # STEP if asked; the next tile is loaded into registers before this tile's token loop (the first one above,
        # before the PDL wait).
        for c in range(CHUNKS):
            ovc = ov + c * BV
            lvc = ovc < D
            mvc = mv
            if not EVEN_V:
                mvc = mv & lvc
            msc = mk[:, None] & mvc[None, :]
            b_s = tl.where(msc, nxt, 0.0)
            more = (ovc * 0 + c + 1) < CHUNKS  # prefetch the next tile (none after the last)
            if not EVEN_V:
                more = more & (ovc + BV < D)
            nxt = tl.load(p_s + (c + 1) * vstep, mask=lk[:, None] & more[None, :], other=0.0)
            for i in range(seq_len):
                t = bos + i
                q, k, decay, beta = _token_inputs(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, F, stride_ft,
                                                  stride_fh, Bt, stride_bt, stride_bh, DT, h, bos, i, cq, ck, ok, mk,
                                                  lk, rate, lower_bound, scale, D, EVEN_K, HAS_LB, STORE_OUT, OUT_TY,
                                                  wf0, wf1, wf2, wf3, LOW_RANK_F, RANK, RC, NCH)
                yv = _conv_silu(QKV, stride_qkv, cs, stride_csc, stride_csw, CW, bos, i, cv + c * BV, mvc, lvc,
                                EVEN_V, OUT_TY)
                b_s, o = _delta_step(b_s, q, k, decay, beta, yv, mvc, STORE_OUT)
                if STORE_OUT:
                    _store_out(O, t, H, h, D, ovc, o, lvc, EVEN_V)
                if STORE_STEPS:
                    tl.store(STEP + (t * H + h) * D * D + s_off + c * vstep, b_s, mask=msc,
                             cache_modifier=".cs")
        if NORM:
            tl.debug_barrier()  # every tile's o stores (all threads of this program) before the rows are read
            _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, lk, NORM_ROWS)

    if CHUNKS == 1 and (UPDATE or NORM):
        mkl = mk & ((ok * 0 + seq_len) > 0)   # live: a real slot and at least one token
        mvl = mv & ((ov * 0 + seq_len) > 0)
        mlast = mkl
        last = pid_v == 0  # NV == 1: the one program of the head
        if NV > 1:
            # One pass of the per-(sequence, head) counter serves both epilogues. All NV programs of the head read
            # the old q/k conv-state columns and wrote their o slices in their loops; the last to arrive writes
            # those columns (UPDATE) and norms the head's o rows (NORM), and resets the counter for the next launch.
            # Arrive before the big state store, so the release fence waits only on the loads and the o stores.
            tl.debug_barrier()  # every warp of this program is past its reads and o stores before the release
            arrived = tl.atomic_add(CNT + pid_nh, 1, sem="acq_rel")
            tl.atomic_xchg(CNT + pid_nh, 0, mask=arrived == NV - 1)
            mlast = mkl & ((ok * 0 + arrived) == NV - 1)
            last = arrived == NV - 1
        if UPDATE:
            _store_state(p_s, b_s, mkl[:, None] & mvl[None, :], HINTS)
            _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cv, mvl)
            _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, cq, mlast)
            _store_conv_state(QKV, stride_qkv, cs, stride_csc, stride_csw, bos, seq_len, ck, mlast)
        if NORM:  # noqa: SIM102 - a compile-time branch around a runtime one
            if last:  # uniform over the program: the barrier inside is reached by every thread or none
                tl.debug_barrier()  # NV == 1: this program's own o stores (other threads) before the reads
                _norm_rows(O, G, stride_gt, stride_gh, NW, norm_eps, bos, seq_len, h, H, D, ok, lk, NORM_ROWS)
