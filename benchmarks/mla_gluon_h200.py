"""Candidate MLA split kernel in Gluon (explicit cp.async) against `mla_decode`'s Triton keys-major kernel, on one
H200. A prototype: compiled for sm_90 offline (--compile-sm90, Triton 3.6: 188,928 B shared memory, 901
instructions per 64-key iteration, no spill reloads in the loop), NOT YET RUN on a GPU; this script checks it
before timing it.

    PYTHONPATH=.:benchmarks python benchmarks/mla_gluon_h200.py [--out JSON]
    PYTHONPATH=DIR:.:benchmarks python benchmarks/mla_gluon_h200.py --compile-sm90   # no GPU; DIR: Triton 3.6

Why. Triton's pipeliner issues the keys-major loop's copy of tile i+1 after tile i's dots and waits for it at the
top of the next iteration, so no copy overlaps a dot (~40% of HBM at best, docs/kernels.md). Here the copy of tile
i+1 is issued at the top of iteration i, into the other of two buffers, and `wait_group(1)` waits only for tile i;
the page of tile i+1 is read one iteration ahead; the plan's scalars go through a lane-0 shuffle (as
`mla_split_plan._warp_uniform`) so the loop's bounds stay in uniform registers.

Scope: uniform-batch decode (Q 1), balanced plan, H == 32 rows, v_dim 512 + rope 64, page 64, 64-key tiles, bf16
cache and queries, no PDL. The kernel writes `_mla_split_kernel`'s outputs (direct rows for single-split
sequences, else fp32 partials + log2 LSE at the same workspace rows), so `mla_decode`'s own combine kernel
(`_mla_combine_kernel`, BLOCK_N 64) merges them.

Per case (batch x context as --loops, plus the mixed batch): the max relative error against `mla_decode`
(keys-major, the default) and against the fp32 torch reference where it fits; then split + combine time from a
CUDA graph of 20 calls after L2-clearing memsets (mla_decode_h200.graph_us) for both, and the HBM share.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton
from mla_decode_h200 import DL, HBM, PAGE, H, V, graph_us, make_case, rel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from tokenspeed.ops.triton import mla_decode as k_mla

BLOCK_N = 64


@gluon.jit
def _issue_tile(kv_bufs, kr_bufs, buf, CACHE, page, stride_cp, k0, hi, PAGE: gl.constexpr, DV: gl.constexpr,
                ROW: gl.constexpr, BLOCK_N: gl.constexpr, LKV: gl.constexpr, LKR: gl.constexpr):
    """cp.async of the keys k0..k0+BLOCK_N-1 (rows past hi masked: zero-filled) of page `page` into buffer `buf`;
    one commit group."""
    r_kv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LKV))
    c_kv = gl.arange(0, DV, layout=gl.SliceLayout(0, LKV))
    base = CACHE + page * stride_cp + (k0 % PAGE) * ROW
    ptr = base + (r_kv * ROW)[:, None] + c_kv[None, :]
    cp.async_copy_global_to_shared(kv_bufs.index(buf), ptr, mask=(k0 + r_kv < hi)[:, None])
    r_kr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LKR))
    c_kr = gl.arange(0, ROW - DV, layout=gl.SliceLayout(0, LKR))
    ptr_r = base + DV + (r_kr * ROW)[:, None] + c_kr[None, :]
    cp.async_copy_global_to_shared(kr_bufs.index(buf), ptr_r, mask=(k0 + r_kr < hi)[:, None])
    cp.commit_group()


@gluon.jit
def mla_split_gluon_kernel(
    Qp, stride_qn, stride_qh,
    QR, stride_rn, stride_rh,
    CACHE, stride_cp,
    PT, stride_pt,
    KV_LENS,
    O, PART, LSE,
    N, MAX_SPLITS, min_chunk, sm_scale_log2, kv_scale,
    H: gl.constexpr, PAGE: gl.constexpr, DV: gl.constexpr, ROW: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_SEQ: gl.constexpr,
):
    DR: gl.constexpr = ROW - DV
    # layouts (4 warps = one warpgroup)
    LKV: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])      # [BLOCK_N, 512] bf16 copies
    LKR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])       # [BLOCK_N, 64]
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])       # [H, 512] / [H, 64] query loads
    LSEQ: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])                 # the plan's [BLOCK_SEQ] vectors
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SH_R: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SH_P: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    LOUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])     # [DV, H] fp32, d fastest

    pid_s = gl.program_id(1)
    pid_n = gl.program_id(2).to(gl.int64)

    # balanced plan (as mla_split_plan._plan_balanced): this slot's (sequence n, split s)
    idx = gl.arange(0, BLOCK_SEQ, layout=LSEQ)
    lens = gl.maximum(gl.load(KV_LENS + idx, mask=idx < N, other=0).to(gl.int64), 0)
    total = gl.sum(lens, axis=0)
    denom = gl.maximum(N * MAX_SPLITS - N, 1)
    chunk = gl.maximum((total + denom - 1) // denom, min_chunk)
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    counts = (lens + chunk - 1) // chunk
    starts = gl.associative_scan(counts, 0, _add) - counts
    p = pid_n * MAX_SPLITS + pid_s
    n = gl.minimum(gl.sum((starts + counts <= p).to(gl.int64), axis=0), N - 1)
    kv_len = gl.sum(gl.where(idx == n, lens, 0), axis=0)
    count = gl.sum(gl.where(idx == n, counts, 0), axis=0)
    start = gl.sum(gl.where(idx == n, starts, 0), axis=0)
    n = _uniform(n).to(gl.int64)
    kv_len = _uniform(kv_len).to(gl.int64)
    count = _uniform(count).to(gl.int64)
    start = _uniform(start).to(gl.int64)
    chunk = _uniform(chunk).to(gl.int64)
    s = p - start
    own_len = gl.load(KV_LENS + pid_n).to(gl.int64)
    if (pid_s == 0) & (own_len <= 0):  # a padding sequence: zeros
        d0 = gl.arange(0, DV, layout=gl.SliceLayout(1, LOUT))
        h0 = gl.arange(0, H, layout=gl.SliceLayout(0, LOUT))
        gl.store(O + (pid_n * H + h0[None, :]) * DV + d0[:, None],
                 gl.zeros([DV, H], O.dtype.element_ty, LOUT))
    if s < count:
        lo = (s * chunk).to(gl.int32)
        hi = gl.minimum(lo + chunk, kv_len).to(gl.int32)
        pt_row = PT + n * stride_pt

        # queries -> shared memory (the B operands, read transposed)
        hq = gl.arange(0, H, layout=gl.SliceLayout(1, LQ))
        dq = gl.arange(0, DV, layout=gl.SliceLayout(0, LQ))
        rq = gl.arange(0, DR, layout=gl.SliceLayout(0, LQ))
        q_v = gl.load(Qp + n * stride_qn + hq[:, None] * stride_qh + dq[None, :]).to(gl.bfloat16)
        q_r = gl.load(QR + n * stride_rn + hq[:, None] * stride_rh + rq[None, :]).to(gl.bfloat16)
        qv_s = gl.allocate_shared_memory(gl.bfloat16, [H, DV], SH, q_v)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [H, DR], SH_R, q_r)
        kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DV], SH)
        kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DR], SH_R)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, H], SH_P)
        fence_async_shared()  # the queries' stores, before wgmma reads them (async proxy) ...
        gl.thread_barrier()  # ... from every warp

        m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
        l_i = gl.zeros([H], gl.float32, gl.SliceLayout(0, MMA))
        acc_t = gl.zeros([DV, H], gl.float32, MMA)
        page = gl.load(pt_row + lo // PAGE).to(gl.int64)
        _issue_tile(kv_bufs, kr_bufs, 0, CACHE, page, stride_cp, lo, hi, PAGE, DV, ROW, BLOCK_N, LKV, LKR)
        # the page of tile i+1, read one iteration ahead (no copy waits on a page-table read just issued)
        page_next = gl.load(pt_row + (lo + BLOCK_N) // PAGE, mask=lo + BLOCK_N < hi, other=0).to(gl.int64)
        n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
        for i in range(n_tiles):
            k0 = lo + i * BLOCK_N
            nxt = k0 + BLOCK_N
            if nxt < hi:  # the next tile's copy starts before this tile's dots (its buffer was freed last iteration)
                _issue_tile(kv_bufs, kr_bufs, (i + 1) % 2, CACHE, page_next, stride_cp, nxt, hi, PAGE, DV, ROW,
                            BLOCK_N, LKV, LKR)
                cp.wait_group(1)
            else:
                cp.wait_group(0)
            nxt2 = nxt + BLOCK_N
            page_next = gl.load(pt_row + nxt2 // PAGE, mask=nxt2 < hi, other=0).to(gl.int64)
            fence_async_shared()  # this thread's cp.async writes, visible to wgmma's async proxy ...
            gl.thread_barrier()  # ... and every thread's
            kv_s = kv_bufs.index(i % 2)
            kr_s = kr_bufs.index(i % 2)
            st = gl.zeros([BLOCK_N, H], gl.float32, MMA)
            st = warpgroup_mma(kv_s, qv_s.permute((1, 0)), st, is_async=True)
            st = warpgroup_mma(kr_s, qr_s.permute((1, 0)), st, is_async=True)
            st = warpgroup_mma_wait(0, deps=[st])
            pos = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
            st = gl.where((pos < hi)[:, None], st * sm_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(st, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            pt = gl.exp2(st - m_safe[None, :])
            l_i = l_i * alpha + gl.sum(pt, axis=0)
            m_i = m_new
            p_s.store(pt.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()  # every warp's rows of p before the warpgroup's wgmma reads them
            acc_t = warpgroup_mma(kv_s.permute((1, 0)), p_s, acc_t * alpha[None, :], is_async=True)
            acc_t = warpgroup_mma_wait(0, deps=[acc_t])
            gl.thread_barrier()  # every warp is done with buffer i % 2 before iteration i+1 refills it

        # epilogue (as _store_rows): normalised output, direct when the sequence has one split
        inv = gl.where(l_i > 0, kv_scale / gl.where(l_i > 0, l_i, 1.0), 0.0)
        o = gl.convert_layout(acc_t * inv[None, :], LOUT)
        d = gl.arange(0, DV, layout=gl.SliceLayout(1, LOUT))
        h = gl.arange(0, H, layout=gl.SliceLayout(0, LOUT))
        if count == 1:
            gl.store(O + (n * H + h[None, :]) * DV + d[:, None], o.to(O.dtype.element_ty))
        else:
            prow = (start + s) * H
            gl.store(PART + (prow + h[None, :]) * DV + d[:, None], o)
            lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            hl = gl.arange(0, H, layout=gl.SliceLayout(0, MMA))
            gl.store(LSE + prow + hl, lse)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _uniform(x):
    """x (the same in every thread) read from lane 0: ptxas then keeps it in a uniform register."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [x.to(gl.int32)],
                                     dtype=gl.int32, is_pure=False, pack=1)


def gluon_decode(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, kv_lens: torch.Tensor, scale: float
                 ) -> torch.Tensor:
    """The Gluon split kernel + `mla_decode`'s combine, q [N, 1, H, 576] bf16; returns [N, 1, H, 512]."""
    N = q.shape[0]
    ms = k_mla.default_max_splits(N, H)
    out = torch.empty(N, 1, H, V, dtype=q.dtype, device=q.device)
    part = torch.empty(N * ms, H, V, dtype=torch.float32, device=q.device)
    lse = torch.empty(N * ms, H, dtype=torch.float32, device=q.device)
    block_seq = k_mla.plan_block_seq(N)
    mc = k_mla.MIN_CHUNK
    mla_split_gluon_kernel[(1, ms, N)](
        q, q.stride(0), q.stride(2), q[..., V:], q.stride(0), q.stride(2),
        cache, cache.stride(0), table, table.stride(0), kv_lens, out, part, lse,
        N, ms, mc, float(scale) * k_mla.LOG2E, 1.0,
        H=H, PAGE=PAGE, DV=V, ROW=DL, BLOCK_N=BLOCK_N, BLOCK_SEQ=block_seq, num_warps=4)
    k_mla._mla_combine_kernel[(triton.cdiv(V, 128), H, N)](
        kv_lens, out, part, lse, N, ms, mc, kv_lens, 0,
        QH=H, DV=V, BLOCK_VC=128, BLOCK_S=16, BLOCK_SEQ=block_seq, BLOCK_N=BLOCK_N, BALANCED=True, PDL=False,
        num_warps=4)
    return out


CASES = [(f"b{b}_{c // 1024}k", [c] * b) for c in (4096, 32768) for b in (1, 4, 16, 64)]
CASES += [("mixed_b16", [65536, 16384, 4096, 1024] * 4), ("equal_1x64k", [65536]), ("ragged_ends", [4097, 100, 64, 1])]


def compile_sm90(block_seq: int = 16) -> dict:
    """Compile the kernel for sm_90 without a GPU (`sm90_compile`'s target and Triton's own ptxas / cuobjdump):
    shared memory, registers, spill stack and main-loop instructions / spill reloads."""
    from sm90_compile import TARGET, cubin_usage, loop_usage
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = mla_split_gluon_kernel
    ptrs = {"Qp": "*bf16", "QR": "*bf16", "CACHE": "*bf16", "PT": "*i32", "KV_LENS": "*i64", "O": "*bf16",
            "PART": "*fp32", "LSE": "*fp32"}
    strides = ("stride_qn", "stride_qh", "stride_rn", "stride_rh", "stride_cp", "stride_pt")
    consts = {"H": H, "PAGE": PAGE, "DV": V, "ROW": DL, "BLOCK_N": BLOCK_N, "BLOCK_SEQ": block_seq}
    sig = {**ptrs, **dict.fromkeys(strides, "i64"), "N": "i32", "MAX_SPLITS": "i32", "min_chunk": "i32",
           "sm_scale_log2": "fp32", "kv_scale": "fp32", **dict.fromkeys(consts, "constexpr")}
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in (*ptrs, *strides)}  # as the JIT derives
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=TARGET, options={"num_warps": 4})
    return {"shared": kernel.metadata.shared, **cubin_usage(kernel), **loop_usage(kernel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mla_gluon_h200.json")
    ap.add_argument("--compile-sm90", action="store_true", help="only compile for sm_90 (no GPU) and report")
    args = ap.parse_args()
    if args.compile_sm90:
        for block_seq in (16, 64):
            print(f"BLOCK_SEQ {block_seq}: {compile_sm90(block_seq)}")
        return
    t0, rows = time.time(), []
    for name, lens in CASES:
        q, cache, table, kv = make_case(lens, 1, torch.bfloat16, "cuda")
        scale = DL ** -0.5
        row = {"case": name, "batch": len(lens), "ctx": max(lens)}
        try:
            got = gluon_decode(q, cache, table, kv, scale)
        except Exception as e:  # noqa: BLE001 - the prototype failing to build or launch is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(name, row["error"], flush=True)
            rows.append(row)
            continue
        want = k_mla.mla_decode(q, cache, table, kv, scale, V)
        row["max_rel_err_vs_triton"] = rel(got, want)
        nbytes = sum(lens) * DL * 2
        args_ = (q, cache, table, kv, scale)
        for form, fn in (("triton", lambda a=args_: k_mla.mla_decode(*a, V)),
                         ("gluon", lambda a=args_: gluon_decode(*a))):
            t = graph_us(fn, n=20)
            row[f"{form}_us"] = t
            row[f"{form}_hbm"] = nbytes / (t * 1e-6) / HBM if math.isfinite(t) and t > 0 else None
        rows.append(row)
        print(f"{name:12s} err {row['max_rel_err_vs_triton']:.2e}  triton {row['triton_us']:8.2f} us "
              f"({100 * (row['triton_hbm'] or 0):4.1f}%)  gluon {row['gluon_us']:8.2f} us "
              f"({100 * (row['gluon_hbm'] or 0):4.1f}%)", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "timing": "CUDA graph of 20 calls after 256 MiB memsets, memsets subtracted, median of 10",
            "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
