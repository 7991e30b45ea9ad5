"""The GEMV kind "smem": each program's weight rows are copied into shared memory *before* its PDL wait (Gluon,
Hopper), so a projection that follows a latency-bound kernel streams its weight while that kernel still runs.

Same function as `gemv._gemv_dot_kernel` / `_gemv_fma_kernel`: y[M, N] = x[M, K] @ W[N, K]^T, fp32 accumulation,
one rounding to y's dtype (x.dtype, or fp32 when asked), bf16 / fp16 only. The sum over K runs in another order
than the Triton kernels' (per thread over its 8-column vectors, then across lanes), so results agree with them
within rounding, not bit for bit.

Why. A decode step at batch 1 is a chain of dependent kernels, and a projection can read its input only after
`griddepcontrol.wait`. The "regs" prefetch of `gemv.py` puts one weight tile per program in flight before that
wait; the registers of the programs resident beside the previous kernel bound how much. Shared memory (227 KB a
program, ~228 KB an SM) holds far more: `benchmarks/read_floor_h200.py` measured kimi-linear's o_proj
(2304 x 4096, 19 MB) at 6.7 us for the GEMV after a 5 us producer, 5.9 us for any read after the wait, and
2.6 us for the same bytes read before it.

Schedule. Program p owns row tiles t = p, p + G, p + 2G, ... (G programs; one per tile unless
`programs_per_sm` caps G) of BLOCK_N whole rows each: a tile is BLOCK_N * K contiguous elements, copied as
K / BLOCK_K chunks of [BLOCK_N, BLOCK_K] with 16-byte `cp.async` (L2 only, `.cg`) into one of STAGES buffers.
Before the wait a program issues its first STAGES tiles (tiles past the last are masked: zero-filled, nothing
read). After the wait (and `launch_dependents`) it reads x [M, K] through L2 into shared memory, then for each
of its tiles: waits for that tile's copy group, multiplies (fp32 products accumulated per thread across the K
chunks, one cross-lane sum per tile), stores its y columns, and refills the buffer with the tile STAGES ahead.
No split-K, so no workspace, semaphores or second pass; every y element is written by exactly one program.

PDL protocol (`pdl.py`): before the wait only the weight is read (no kernel writes it); x and y come after it;
every program waits (no early exit), then triggers its dependents.

Shared memory per program: STAGES * BLOCK_N * K * elt for the weight plus BLOCK_M * K * elt for x
(`smem_bytes`); `unusable_reason` refuses a config over SMEM_PER_PROGRAM. All programs are resident at once (so
all of them prefetch before the wait) only when G programs fit beside the previous kernel: that is what the
in-context sweep (`benchmarks/gemv_h200.py --producer-cycles`) and the whole-step A/B measure.

Measured on the H200 (`docs/kernels.md`, "Shared-memory GEMV"): after a producer that moves no bytes it beats the
Triton kinds (K3's 90 / 294 MB TP8 projections at 91.5 / 97.8% of HBM); after a latency-bound kernel that does
(KDA decode before kimi's o_proj) its copies queue ahead of that kernel's loads and the step is slower, so the
routing table takes it only where the whole-step A/B or the in-context sweep of a shape says so.
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from tokenspeed.ops.triton.gluon_common import TRITON_VERSIONS  # noqa: F401 - re-exported
from tokenspeed.ops.triton.gluon_common import hopper as _hopper

try:  # Gluon's API changes between Triton releases: `unusable_reason` refuses other versions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

SMEM_PER_PROGRAM = 227 * 1024  # sm_90's dynamic shared memory per block
VEC = 8  # 16-bit elements per 16-byte copy / load
MAX_BLOCK_M = 4  # x rows per program (padded to a power of two): the fp32 products are BLOCK_M x per thread

# SM clocks a program spins before it issues its copies (TOKENSPEED_GEMV_SMEM_DELAY, read per launch, for A/B
# timing only): lets a latency-bound predecessor's own loads go first instead of queueing behind the copies.
DELAY_ENV = "TOKENSPEED_GEMV_SMEM_DELAY"


def copy_delay() -> int:
    """TOKENSPEED_GEMV_SMEM_DELAY as SM clocks (unset: 0). Raises ValueError on a negative or non-integer value."""
    v = os.environ.get(DELAY_ENV, "").strip()
    try:
        cycles = int(v) if v else 0
    except ValueError:
        raise ValueError(f"{DELAY_ENV} must be a whole number of SM clocks; got {v!r}") from None
    if cycles < 0:
        raise ValueError(f"{DELAY_ENV} must be >= 0; got {cycles}")
    return cycles


def warps_split(block_n: int, num_warps: int) -> tuple[int, int]:
    """(warps along the rows, warps along K) of a program: rows first, the rest along K."""
    wn = min(block_n, num_warps)
    return wn, num_warps // wn


def smem_bytes(M: int, K: int, elt: int, block_n: int, num_stages: int) -> int:
    """Shared memory one program allocates: its STAGES weight buffers and the x rows."""
    return (num_stages * block_n + triton.next_power_of_2(M)) * K * elt


def unusable_reason(x: Tensor, weight: Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int
                    ) -> str | None:
    """Why this kernel cannot run the call under that config (None: it can): Gluon of TRITON_VERSIONS on an sm_90
    GPU, 16-bit x and weight, M <= MAX_BLOCK_M, unit column strides, 16-byte aligned rows, power-of-two block
    sizes with BLOCK_K a multiple of the warps' K span that divides K, and the shared memory within one block's."""
    M, K = x.shape
    elt = x.element_size()
    wn, wk = warps_split(block_n, num_warps)
    if not (x.is_cuda and _hopper(x.device)):
        return "needs Gluon (Triton 3.6) on an sm_90 GPU"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return "16-bit x and weight only"
    if M > MAX_BLOCK_M:
        return f"at most {MAX_BLOCK_M} rows"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "unit column strides only"
    if any(v % 16 for v in (x.data_ptr(), weight.data_ptr(), x.stride(0) * elt, weight.stride(0) * elt)):
        return "16-byte aligned rows only"
    for v in (block_n, block_k, num_warps):
        if v < 1 or v & (v - 1):
            return "block_n, block_k and num_warps must be powers of two"
    if block_k % (VEC * 32 * wk) or K % block_k:
        return f"block_k must be a multiple of {VEC * 32 * wk} that divides K ({K})"
    if smem_bytes(M, K, elt, block_n, num_stages) > SMEM_PER_PROGRAM:
        return f"{smem_bytes(M, K, elt, block_n, num_stages)} B of shared memory > {SMEM_PER_PROGRAM}"
    return None


def launch(x: Tensor, weight: Tensor, y: Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int,
           programs_per_sm: int, num_sms: int, pdl_on: bool) -> Tensor:
    """y [M, N] (contiguous, x.dtype or fp32) = x @ weight^T for a call `unusable_reason` accepts. Returns y."""
    M, K = x.shape
    N = weight.shape[0]
    n_tiles = triton.cdiv(N, block_n)
    grid = n_tiles if programs_per_sm <= 0 else min(n_tiles, programs_per_sm * num_sms)
    wn, wk = warps_split(block_n, num_warps)
    _gemv_smem_kernel[(grid,)](
        x, weight, y, M, N, x.stride(0), weight.stride(0), n_tiles,
        K=K, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages, WN=wn, WK=wk,
        DELAY=copy_delay() if pdl_on else 0, PDL=pdl_on, num_warps=num_warps,
        **({"launch_pdl": True} if pdl_on else {}))
    return y


if gluon is not None:
    from tokenspeed.ops.triton.gluon_common import grid_dependency as _grid_dependency

    @gluon.jit
    def _clock(x):
        """%clock64 (x: any scalar, the asm's dummy operand)."""
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,r", [x], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _issue_tile(w_s, W, stride_wn, t, buf, N, rows, cols, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    NKC: gl.constexpr):
        """cp.async of row tile t (rows t * BLOCK_N + rows; those >= N zero-filled, nothing read) into buffer
        `buf` (chunks buf * NKC .. buf * NKC + NKC - 1 of w_s); one commit group."""
        r = t * BLOCK_N + rows
        live = (r < N)[:, None]
        base = W + gl.minimum(r, N - 1).to(gl.int64)[:, None] * stride_wn + cols[None, :]
        for c in gl.static_range(NKC):
            cp.async_copy_global_to_shared(w_s.index(buf * NKC + c), base + c * BLOCK_K, mask=live,
                                           cache_modifier=".cg")
        cp.commit_group()

    @gluon.jit(do_not_specialize=["M", "N", "n_tiles"])
    def _gemv_smem_kernel(
        X, W, Y, M, N, stride_xm, stride_wn, n_tiles,
        K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr, WN: gl.constexpr, WK: gl.constexpr, DELAY: gl.constexpr, PDL: gl.constexpr,
    ):
        NKC: gl.constexpr = K // BLOCK_K
        # [BLOCK_M, BLOCK_N, BLOCK_K] products: 8 contiguous K elements a thread, a warp's 32 lanes along K, the
        # warps over rows then K; W tiles are its dim-0 slice, x rows its dim-1 slice, y its dim-2 slice.
        L3: gl.constexpr = gl.BlockedLayout([BLOCK_M, 1, 8], [1, 1, 32], [1, WN, WK], [2, 1, 0])
        LW: gl.constexpr = gl.SliceLayout(0, L3)
        LX: gl.constexpr = gl.SliceLayout(1, L3)
        LY: gl.constexpr = gl.SliceLayout(2, L3)
        SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # per [rows, BLOCK_K] chunk
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        mine = (n_tiles - pid + G - 1) // G  # this program's tiles: pid, pid + G, ...
        w_s = gl.allocate_shared_memory(W.dtype.element_ty, [STAGES * NKC, BLOCK_N, BLOCK_K], SH)
        x_s = gl.allocate_shared_memory(X.dtype.element_ty, [NKC, BLOCK_M, BLOCK_K], SH)
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
        cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LW))
        if DELAY > 0:  # A/B only (copy_delay): the predecessor's loads first
            t0 = _clock(pid)
            t = t0
            while t - t0 < DELAY:
                t = _clock(pid)
        for j in gl.static_range(STAGES):  # before the wait: weights only
            _issue_tile(w_s, W, stride_wn, pid + j * G, j, N, rows, cols, BLOCK_N, BLOCK_K, NKC)
        if PDL:
            _grid_dependency(pid)
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LX))
        xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LX))
        x_rows = X + gl.minimum(xm, M - 1).to(gl.int64)[:, None] * stride_xm + xk[None, :]
        for c in gl.static_range(NKC):  # x was written by the previous kernel: read through L2
            x_s.index(c).store(gl.load(x_rows + c * BLOCK_K, cache_modifier=".cg"))
        ym = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LY))
        yn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LY))
        for j in range(mine):
            buf = j % STAGES
            if j + STAGES <= mine:  # groups committed so far: STAGES + j; this tile's is the (j + 1)-th
                cp.wait_group(STAGES - 1)
            else:  # no refills past the last tile: wait for all
                cp.wait_group(0)
            gl.thread_barrier()  # every thread's copies (and, the first time, x's stores) visible to all
            acc = gl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], gl.float32, L3)
            for c in gl.static_range(NKC):
                w = w_s.index(buf * NKC + c).load(LW).to(gl.float32)
                xv = x_s.index(c).load(LX).to(gl.float32)
                acc += gl.expand_dims(w, 0) * gl.expand_dims(xv, 1)
            y = gl.sum(acc, axis=2)
            r = (pid + j * G) * BLOCK_N + yn
            gl.store(Y + ym[:, None] * N + r[None, :], y.to(Y.dtype.element_ty),
                     mask=(ym < M)[:, None] & (r < N)[None, :])
            if j + STAGES < mine:
                gl.thread_barrier()  # every warp is done with this buffer before it is refilled
                _issue_tile(w_s, W, stride_wn, pid + (j + STAGES) * G, buf, N, rows, cols, BLOCK_N, BLOCK_K, NKC)
