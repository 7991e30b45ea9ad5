"""Host side of the fused KDA decode kernel: the Triton `ops.kda_decode` (one layer: decode, k-token verify,
optionally the gated-norm epilogue) and `ops.kda_replay_layers` (the accepted drafts' state replay over all KDA
layers in one launch), with their argument checks, launch constants (`_split`, from a `kda_config.KdaConfig`) and
the cached V-split counters (`_counters`).

The kernel (`_kda_decode_kernel`), its schedules and its PDL, norm-epilogue and multi-layer contracts are in
`tokenspeed.ops.triton.kda_decode_kernel`; the Gluon decode that gluon configs take on an H200 in
`tokenspeed.ops.triton.kda_decode_gluon`. The wrappers launch it through this module's global
`_kda_decode_kernel`, so a benchmark can stand in for it here (benchmarks/kda_compile_sm90.py,
benchmarks/kda_decode_sweep_h200.py).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from tokenspeed.ops.dispatch import kda_replay_layers_unsupported
from tokenspeed.ops.kda_layers import KdaLayerTable
from tokenspeed.ops.triton import kda_decode_gluon, pdl
from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.kda_config import (  # noqa: F401
    DECODE_TABLE,
    KdaConfig,
    default_config,
    legacy_config,
    replay_wy_block_v,
)
from tokenspeed.ops.triton.kda_decode_kernel import _kda_decode_kernel
from tokenspeed.ops.triton.kda_replay_wy import launch_replay_wy
from tokenspeed.ops.triton.kda_verify_keys import launch_keys_pass
from tokenspeed.ops.triton.kda_verify_wy import MAX_WINDOW, launch_wy, wy_shape_unsupported, wy_unsupported

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


def _check_layer(qkv: Tensor, f: Tensor | None, b: Tensor, conv_weight: Tensor, conv_state: Tensor, dt_bias: Tensor,
                 state: Tensor, N: int, cu_seqlens: Tensor, seq_lens: Tensor | None) -> Tensor | None:
    """Validate one layer's arguments of `kda_decode` (N sequences); returns f as a [T, H, D] view (None: f is
    computed in the kernel from `f_low_rank`)."""
    H, D = dt_bias.shape
    T = qkv.shape[0]
    if qkv.shape != (T, 3 * H * D) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {3 * H * D}] with unit column stride; got {tuple(qkv.shape)}")
    if conv_weight.shape != (3 * H * D, 4):
        raise ValueError(f"the fused kernel needs a width-4 conv weight [C, 4]; got {tuple(conv_weight.shape)}")
    f3 = None if f is None else f.view(T, H, D) if f.dim() == 2 else f
    if f3 is not None and (f3.shape != (T, H, D) or f3.stride(2) != 1):
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


def _split(num_programs_nh: int, D: int, tokens_per_seq: int, config: KdaConfig | None, BV: int | None,
           num_warps: int | None, hints: bool | None, chunked: bool | None, num_stages: int | None) -> dict:
    """The kernel's launch constants: `config` (default: `default_config`) with the non-None overrides, checked."""
    cfg = config if config is not None else default_config(num_programs_nh, D, tokens_per_seq)
    over = {"block_v": BV, "num_warps": num_warps, "hints": hints, "chunked": chunked, "num_stages": num_stages}
    cfg = cfg._replace(**{k: v for k, v in over.items() if v is not None})
    if config is None and cfg.chunked:  # a chunked override of a default with the (split-only) window loop
        cfg = cfg._replace(window=False)
    bk = next_pow2(D)  # the K axis of the tile, padded (masked) past D
    bv = cfg.block_v
    if not isinstance(bv, int) or bv <= 0 or bv & (bv - 1) or bv > bk:
        raise ValueError(f"BV must be a power of two <= {bk} (head dim {D} rounded up); got {bv}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16; got {cfg.num_warps}")
    if cfg.num_stages is not None and (not isinstance(cfg.num_stages, int) or not 1 <= cfg.num_stages <= 8):
        raise ValueError(f"num_stages must be in 1..8 or None; got {cfg.num_stages}")
    tiles = triton.cdiv(D, bv)  # V tiles of a head, the last masked past D if uneven
    chunks = bk // bv if cfg.chunked else 1  # tiles per program (chunked: all, the last ones masked past D)
    even_v = D % bv == 0 and (not cfg.chunked or tiles == chunks)  # no masked V lane in any tile
    opts = {"BK": bk, "BV": bv, "NV": 1 if cfg.chunked else tiles, "CHUNKS": chunks, "STAGES": cfg.num_stages or 3,
            "EVEN_K": bk == D, "EVEN_V": even_v, "HINTS": bool(cfg.hints), "num_warps": cfg.num_warps}
    if cfg.num_stages is not None:
        opts["num_stages"] = cfg.num_stages
    if cfg.max_regs is not None:
        if not isinstance(cfg.max_regs, int) or not 24 <= cfg.max_regs <= 255 or cfg.max_regs % 8:
            raise ValueError(f"max_regs must be a multiple of 8 in 24..255 or None; got {cfg.max_regs}")
        opts["maxnreg"] = cfg.max_regs
    opts["PF_STATE"] = cfg.prefetch_state  # then the device and the pool's alignment: `_pf_state`
    if not isinstance(cfg.prefetch_tiles, int) or cfg.prefetch_tiles < 0:
        raise ValueError(f"prefetch_tiles must be an int >= 0 (0: the whole head); got {cfg.prefetch_tiles}")
    opts["PF_TILES"] = cfg.prefetch_tiles if cfg.prefetch_tiles < chunks else 0  # 0: the whole head
    if cfg.preload and (not cfg.chunked or cfg.num_stages == 1 or chunks < 2):
        raise ValueError("KdaConfig(preload=True) is for the chunked schedule with num_stages > 1 and 2+ tiles")
    opts["PRELOAD"] = int(cfg.preload)  # (decode launches only: kda_decode clears it for verify)
    if cfg.window and cfg.chunked:
        raise ValueError("KdaConfig(window=True) is for the split schedule (chunked=False)")
    opts["WINDOW"] = cfg.window
    if cfg.gluon and not cfg.chunked:
        raise ValueError("KdaConfig(gluon=True) is for the chunked schedule")
    opts["GLUON"] = cfg.gluon  # popped by kda_decode: the Gluon decode is another kernel
    opts["NBUF"] = cfg.num_stages  # (its shared-memory buffers; None: the whole head)
    opts["WY"] = cfg.wy  # popped by the launches: the WY verify schedule is another kernel
    opts["KP"] = cfg.keys_pass  # (its two-launch form)
    return opts


LowRank = tuple[Tensor, Tensor]  # (a [T, R] low-rank input, unit column stride; w [H * D, R] up weight, contiguous)


def _check_low_rank(pair: LowRank | None, T: int, H: int, D: int, name: str) -> LowRank | None:
    """Validate a low-rank gate input (a, w) of `kda_decode` (module docstring of `kda_decode_kernel`)."""
    if pair is None:
        return None
    a, w = pair
    R = w.shape[-1] if w.dim() == 2 else -1
    if w.shape != (H * D, R) or not w.is_contiguous() or not 1 <= R <= 128:
        raise ValueError(f"{name}: the up weight must be a contiguous [{H * D}, R] (R <= 128); got {tuple(w.shape)}")
    if a.shape != (T, R) or a.stride(1) != 1:
        raise ValueError(f"{name}: the low-rank input must be [{T}, {R}] with unit column stride; got "
                         f"{tuple(a.shape)}")
    if a.dtype != w.dtype or a.dtype == torch.float64 or a.device != w.device:
        raise ValueError(f"{name}: input and weight must share a 16/32-bit float dtype and device")
    return a, w


def _up(pair: LowRank) -> Tensor:
    """The low-rank up projection a @ w^T [T, H * D] (a.dtype): for the schedules that cannot fuse it."""
    a, w = pair
    return torch.matmul(a, w.t())


def _pf_state(wanted: bool, state: Tensor, D: int) -> bool:
    """PF_STATE: the chunked decode's L2 bulk prefetch of each head's state rows (`cp.async.bulk.prefetch`,
    sm_90+) when wanted and the rows are 16-byte aligned (fp32 rows of D % 4 == 0 values from an aligned pool)."""
    return (wanted and pdl.hopper(state.device) and D % 4 == 0 and state.data_ptr() % 16 == 0
            and state.stride(0) % 4 == 0)


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
    config: KdaConfig | None = None,
    BV: int | None = None,
    num_warps: int | None = None,
    hints: bool | None = None,
    chunked: bool | None = None,
    num_stages: int | None = None,
    out: Tensor | None = None,
    seq_lens: Tensor | None = None,
    norm_gate: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    state_v_first: bool = False,
    max_seq_tokens: int | None = None,
    f_low_rank: LowRank | None = None,
    gate_low_rank: LowRank | None = None,
) -> Tensor:
    """Triton `ops.kda_decode` (same contract). `config` (a `KdaConfig`; default `default_config(N * H, D,
    ceil(T / N))`) and the overrides BV / num_warps / hints / chunked / num_stages (fields of it) set the launch.

    norm_gate ([T, H, D] or [T, H * D], unit last stride: a column view of a wider projection is read in place) and
    norm_weight [D]: the returned o is `gated_rms_norm(o, norm_gate, norm_weight, norm_eps)` of the plain result,
    fused as an epilogue (`_norm_rows`). Rows the kernel does not compute (past `seq_lens`) stay zero.

    state_v_first: the pool (and step_states) hold each head's state transposed, [V, K] (element (k, v) at
    v * D + k), so a [K, block_v] tile is block_v contiguous rows; the math is the same (`ops.kda_decode`).

    On Hopper the launch is a programmatic dependent (`tokenspeed.ops.triton.pdl`; module docstring, "PDL"):
    `state_indices`, `cu_seqlens` and the two pools are read before the kernel waits for the previous one, so
    neither of the two kernels launched just before may write them (true in the model: slots and bounds are copied
    in before a step's first kernel, and only KDA ops of earlier steps write the pools).

    f_low_rank / gate_low_rank (a, w): f (instead of `f`) / the norm gate (instead of `norm_gate`, with
    `norm_weight`) as the up projection cast(a @ w^T) of a low-rank input, computed in the kernel (LOW_RANK_F /
    LOW_RANK_G) for decode launches of one token per sequence (T == N, bounded by the caller: `max_seq_tokens=1`);
    other launches and the schedules without it (the window loop, the WY verify) get them from one matmul first.

    A config with `gluon` (from 64 pairs the default's, `kda_config.GLUON_DECODE_TABLE`) runs the Gluon decode
    (`kda_decode_gluon`, low-rank inputs included) where its `unusable_reason` allows, else its Triton form."""
    H, D = dt_bias.shape
    T, N = qkv.shape[0], state_indices.numel()
    lr_f = _check_low_rank(f_low_rank, T, H, D, "f_low_rank")
    lr_g = _check_low_rank(gate_low_rank, T, H, D, "gate_low_rank")
    if (lr_f is None) == (f is None):
        raise ValueError("kda_decode takes f or f_low_rank, exactly one")
    if lr_g is not None and (norm_gate is not None or norm_weight is None):
        raise ValueError("gate_low_rank replaces norm_gate and needs norm_weight")
    if lr_f is not None and lr_g is not None and lr_f[1].shape != lr_g[1].shape:
        raise ValueError("f_low_rank and gate_low_rank must have the same rank")
    tokens = triton.cdiv(T, N) if N else 1
    opts = _split(N * H, D, tokens, config, BV, num_warps, hints, chunked, num_stages)
    gluon, nbuf = opts.pop("GLUON"), opts.pop("NBUF")
    nbuf = nbuf or D // opts["BV"]
    if gluon and kda_decode_gluon.unusable_reason(
            qkv, state, D, opts["BV"], nbuf, opts["num_warps"], T=T, N=N, update_state=update_state,
            step_states=step_states, seq_lens=seq_lens, max_seq_tokens=max_seq_tokens, state_v_first=state_v_first,
            low_rank=tuple(p[1] for p in (lr_f, lr_g) if p is not None)) is not None:
        # the Triton form: an explicit config without the flag, a default the Triton table's row
        form = config._replace(gluon=False) if config is not None else default_config(N * H, D, tokens, gluon=False)
        opts = _split(N * H, D, tokens, form, BV, num_warps, hints, chunked, num_stages)
        opts.pop("GLUON"), opts.pop("NBUF")
        gluon = False
    if (lr_f is not None or lr_g is not None) and (opts["WY"] or opts["WINDOW"] or max_seq_tokens != 1
                                                   or not update_state or T != N):
        # the in-kernel up projections are for decode launches (one token per sequence) on split / chunked only
        f = _up(lr_f) if lr_f is not None else f
        norm_gate = _up(lr_g) if lr_g is not None else norm_gate
        lr_f = lr_g = None
    f3 = _check_layer(qkv, f, b, conv_weight, conv_state, dt_bias, state, N, cu_seqlens, seq_lens)
    if lr_g is None:
        g3 = _check_norm(norm_gate, norm_weight, T, H, D)
    elif norm_weight.shape != (D,):
        raise ValueError(f"norm_weight must be [{D}]; got {tuple(norm_weight.shape)}")
    elif gluon:  # the Gluon kernel keeps the up-projected gate in registers
        g3 = None
    else:  # the Triton kernel writes the gate here (LOW_RANK_G) and its norm epilogue reads it back
        g3 = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    norm = g3 is not None or lr_g is not None
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
    gate = g3 if norm else out
    if gluon:  # (unusable_reason said yes above)
        kda_decode_gluon.launch(qkv, f3 if lr_f is None else lr_f[0], b, cw, conv_state, A_log, dt_bias, state,
                                state_indices, cu_seqlens, out, g3 if lr_g is None else None,
                                norm_weight if norm else None, lower_bound=lower_bound, scale=scale,
                                norm_eps=norm_eps, block_v=opts["BV"], num_buffers=nbuf,
                                num_warps=opts["num_warps"], pdl_on=pdl.enabled(qkv.device, "kda"),
                                f_up=None if lr_f is None else lr_f[1], gate_low_rank=lr_g)
        return out
    wy, keys_pass = opts.pop("WY"), opts.pop("KP")
    why = wy_unsupported(D, opts["BV"], update_state, step_states, seq_lens) if wy else None
    if why is not None and config is not None:
        raise ValueError(why)
    if wy and why is None:  # (the WY forms prefetch whole heads: PF_TILES is the chunked decode's)
        if keys_pass and max_seq_tokens is not None and max_seq_tokens <= MAX_WINDOW:  # else the one-launch form
            cnt = _counters(qkv.device, N * H) if norm and opts["BV"] < D else cu_seqlens
            launch_keys_pass(qkv, f3, b, cw, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens, out,
                             gate, norm_weight if norm else None, cnt, lower_bound=lower_bound, scale=scale,
                             norm_eps=norm_eps, norm_rows=norm_rows(T, N) if norm else 1, block_v=opts["BV"],
                             num_warps=opts["num_warps"], max_seq_tokens=max_seq_tokens, state_v_first=state_v_first)
        else:
            launch_wy(qkv, f3, b, cw, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens, out, gate,
                      norm_weight if norm else None, lower_bound=lower_bound, scale=scale, norm_eps=norm_eps,
                      norm_rows=norm_rows(T, N) if norm else 1, block_v=opts["BV"], num_warps=opts["num_warps"],
                      num_stages=opts.get("num_stages"), tokens_per_seq=triton.cdiv(T, N),
                      max_seq_tokens=max_seq_tokens, state_v_first=state_v_first,
                      prefetch_state=_pf_state(opts["PF_STATE"], state, D))
        return out
    opts["PF_STATE"] = _pf_state(opts["PF_STATE"], state, D)
    opts["PRELOAD"] = opts["PRELOAD"] if update_state else 0  # verify keeps its own first-tile load
    nv = opts["NV"]
    cnt = _counters(qkv.device, N * H) if ((update_state or norm) and nv > 1) else cu_seqlens
    fa, sft, sfh, fb = (lr_f[0], lr_f[0].stride(0), 0, lr_f[1]) if lr_f is not None else \
        (f3, f3.stride(0), f3.stride(1), A_log)
    ga, sga, gb = (lr_g[0], lr_g[0].stride(0), lr_g[1]) if lr_g is not None else (qkv, 0, A_log)
    rank = (lr_f or lr_g)[1].shape[1] if lr_f or lr_g else 0
    _kda_decode_kernel[(nv, N * H)](
        qkv, qkv.stride(0),
        fa, sft, sfh,
        b, b.stride(0), b.stride(1),
        cw, conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        A_log, dt_bias.contiguous(),
        state, state.stride(0),
        state_indices, cu_seqlens, seq_lens if seq_lens is not None else cu_seqlens,
        out, step_states if step_states is not None else state, cnt, cu_seqlens,
        gate, gate.stride(0), gate.stride(1), norm_weight.contiguous() if norm else A_log,
        fb, ga, sga, gb,
        float(lower_bound) if lower_bound is not None else 0.0, float(scale), float(norm_eps),
        H=H, D=D, HAS_LB=lower_bound is not None, UPDATE=bool(update_state), STORE_STEPS=step_states is not None,
        HAS_LENS=seq_lens is not None, MULTI_LAYER=False, STORE_OUT=True, NORM=norm,
        NORM_ROWS=norm_rows(T, N) if norm else 1, PDL=pdl.enabled(qkv.device, "kda"),
        V_FIRST=bool(state_v_first), LOW_RANK_F=lr_f is not None, LOW_RANK_G=lr_g is not None, RANK=rank,
        RC=min(32, next_pow2(max(rank, 1))), NCH=triton.cdiv(next_pow2(max(rank, 1)), 32),
        **opts, **pdl.launch_kwargs(qkv.device, "kda"),
    )
    return out


def norm_rows(T: int, N: int) -> int:
    """NORM_ROWS, the rows the fused output norm takes per step: 1 for one token per sequence (decode), else 16
    for every other step (verify, prompt tails beside decodes), so mixed serving steps share one compiled variant
    whatever their lengths; the rows are normed independently and the tile masks the ones past a sequence's end,
    so the result does not depend on it."""
    return 1 if T <= N else 16


def _check_norm(gate: Tensor | None, weight: Tensor | None, T: int, H: int, D: int) -> Tensor | None:
    """Validate the norm epilogue's arguments of `kda_decode`; returns the gate as a [T, H, D] view (None: no
    epilogue). Raises ValueError when only one of the two is given or on a bad shape / stride."""
    if gate is None and weight is None:
        return None
    if gate is None or weight is None:
        raise ValueError("norm_gate and norm_weight go together")
    g3 = gate.view(T, H, D) if gate.dim() == 2 else gate
    if g3.shape != (T, H, D) or g3.stride(2) != 1:
        raise ValueError(f"norm_gate must be [T, H, D] = [{T}, {H}, {D}] with unit last stride; got "
                         f"{tuple(gate.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"norm_weight must be [{D}]; got {tuple(weight.shape)}")
    return g3


def _wy_replay_unsupported(D: int, block_v: int, max_seq_tokens: int | None) -> str | None:
    """None when the WY replay takes head dim D in V tiles of block_v under the caller's bound on every sequence's
    rows, else why not."""
    why = wy_shape_unsupported(D, block_v)
    if why is None and (max_seq_tokens is None or max_seq_tokens > MAX_WINDOW):
        why = f"the WY replay needs max_seq_tokens <= {MAX_WINDOW} (every sequence's rows); got {max_seq_tokens}"
    return why


def kda_replay_layers(
    table: KdaLayerTable,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor | None,
    *,
    lower_bound: float | None,
    config: KdaConfig | None = None,
    BV: int | None = None,
    num_warps: int | None = None,
    hints: bool | None = None,
    chunked: bool | None = None,
    num_stages: int | None = None,
    state_v_first: bool = False,
    max_seq_tokens: int | None = None,
) -> None:
    """Triton `ops.kda_replay_layers` (same contract): every layer of `table` in one launch, grid
    (NV, N * H, L), no outputs (the q path is not computed); config and overrides as in `kda_decode` (the default
    is chosen for the N * H * L programs and ceil(T / N) tokens per sequence). A WY config (the default's from
    `MULTI_TABLE`'s WY row) with `max_seq_tokens` <= MAX_WINDOW, the caller's bound on every sequence's rows, takes
    the two-launch WY replay (`kda_replay_wy.py`, its V tile REPLAY_WY_BLOCK_V unless given); without the bound
    its split form. Raises ValueError when `dispatch.kda_replay_layers_unsupported(table)` names a reason, or for
    an explicit WY config it cannot run."""
    why = kda_replay_layers_unsupported(table)
    if why is not None:
        raise ValueError(f"kda_replay_layers: {why}")
    qkv, f, b, cw, conv_state, A_log, dt_bias, state = table.base
    H, D = dt_bias.shape
    T, N, L = qkv.shape[0], state_indices.numel(), table.num_layers
    f3 = _check_layer(qkv, f, b, cw, conv_state, dt_bias, state, N, cu_seqlens, seq_lens)
    if N == 0 or T == 0:
        return
    explicit = config is not None
    opts = _split(N * H * L, D, triton.cdiv(T, N), config, BV, num_warps, hints, chunked, num_stages)
    opts["PF_STATE"], opts["PF_TILES"], opts["PRELOAD"] = False, 0, 0  # per-layer rows: no prefetch / preload
    opts.pop("KP")  # the WY replay always runs in two launches
    opts.pop("GLUON"), opts.pop("NBUF")  # (the Gluon kernel is a single-layer decode: the replay runs Triton)
    if opts.pop("WY"):
        wy_bv = opts["BV"] if explicit or BV is not None else replay_wy_block_v(D)  # a table row: the replay's own
        why = _wy_replay_unsupported(D, wy_bv, max_seq_tokens)
        if why is None:
            lens = seq_lens if seq_lens is not None else torch.diff(cu_seqlens)
            launch_replay_wy(qkv, f3, b, cw, conv_state, A_log, dt_bias, state, table.offsets, L, state_indices,
                             cu_seqlens, lens, lower_bound=lower_bound, block_v=wy_bv,
                             num_warps=opts["num_warps"], max_seq_tokens=max_seq_tokens,
                             state_v_first=state_v_first)
            return
        if explicit:  # a default (or a label from MULTI_ENV) runs its split form instead
            raise ValueError(f"kda_replay_layers: {why}")
    nv = opts["NV"]
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
        qkv, 0, 0, A_log,  # the norm epilogue's gate / weight: unused (no outputs)
        A_log, qkv, 0, A_log,  # the low-rank gate inputs: unused (f is read)
        float(lower_bound) if lower_bound is not None else 0.0, 1.0, 0.0,
        H=H, D=D, HAS_LB=lower_bound is not None, UPDATE=True, STORE_STEPS=False, HAS_LENS=seq_lens is not None,
        MULTI_LAYER=True, STORE_OUT=False, NORM=False, PDL=pdl.enabled(qkv.device, "kda"),
        V_FIRST=bool(state_v_first), **opts,
        **pdl.launch_kwargs(qkv.device, "kda"),
    )
