"""MLA prefill in the expanded form over a long cached history, on one H200: where a turn's tail spends its time.

    PYTHONPATH=. python benchmarks/mla_expanded_h200.py --out benchmarks/results

One layer of Kimi-Linear's MLA (32 heads, nope 128 + rope 64, v 128, latent 512): L new tokens attend to a history
of S cached latent rows plus themselves (bottom-right causal). Two stages are timed separately and together (CUDA
events, medians after warm-up):
- expansion of the latent rows into per-head keys / values: `cat` (today: kv_b GEMM, then K = cat(k_nope, k_pe
  broadcast over heads)) against `headmajor` (one batched GEMM per K and V straight into [H, S, d], k_pe copied
  through an identity block of the key weight: bit-exact) and `bshd` (the same weights, one plain GEMM each into
  [S, H, d]; timed with the split attention as `split_cudnn_bshd`);
- attention: `masked` (one SDPA call with an explicit [L, S] boolean mask, today) against `split_*` (the history
  without a mask and the tail's square with is_causal, merged by their log-sum-exps; cuDNN or the memory-efficient
  kernel) and `lower_right` (SDPA with torch's lower-right causal bias).
Every variant's output is compared with a float32 reference at a small shape and with `masked` at each timed shape.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import events_ms, write_result

H, NOPE, ROPE, V, R = 32, 128, 64, 128, 512


def expand_cat(latent: torch.Tensor, w_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's expansion: k [S, H, 192] contiguous, v [S, H, 128] a strided view."""
    kv = F.linear(latent[:, :R], w_kv).view(-1, H, NOPE + V)
    k = torch.cat([kv[..., :NOPE], latent[:, None, R:].expand(-1, H, -1)], dim=-1)
    return k, kv[..., NOPE:]


def headmajor_weights(w_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_K' [H, 192, 576] ([W_UK[h] 0 ; 0 I]) and W_UV [H, 128, 512] from kv_b_proj's weight [H * 256, 512]."""
    w = w_kv.view(H, NOPE + V, R)
    wk = torch.zeros(H, NOPE + ROPE, R + ROPE, dtype=w_kv.dtype, device=w_kv.device)
    wk[:, :NOPE, :R] = w[:, :NOPE]
    wk[:, NOPE:, R:] = torch.eye(ROPE, dtype=w_kv.dtype, device=w_kv.device)
    return wk, w[:, NOPE:].contiguous()


def expand_headmajor(latent: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [H, S, 192], v [H, S, 128], both contiguous."""
    k = torch.matmul(latent.unsqueeze(0), wk.transpose(1, 2))
    v = torch.matmul(latent[:, :R].unsqueeze(0), wv.transpose(1, 2))
    return k, v


def expand_bshd(latent: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same keys / values stored [S, H, d] (one plain GEMM each), returned as [H, S, d] views."""
    k = F.linear(latent, wk.reshape(-1, wk.shape[-1])).view(-1, H, NOPE + ROPE)
    v = F.linear(latent[:, :R], wv.reshape(-1, wv.shape[-1])).view(-1, H, V)
    return k.transpose(0, 1), v.transpose(0, 1)


def attn_masked(q, k, v, scale):
    """Today's ops/cuda/sdpa.py for one sequence: q [L, H, 192], k [S, H, 192], v [S, H, 128]."""
    L, S = q.shape[0], k.shape[0]
    qn, kn, vn = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    pos = torch.arange(L, device=q.device)[:, None] + (S - L)
    mask = torch.arange(S, device=q.device)[None, :] <= pos
    return F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, scale=scale).squeeze(0).transpose(0, 1)


def _cudnn(q, k, v, causal, scale):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2])


def _efficient(q, k, v, causal, scale):
    out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out[0], out[1][..., : q.shape[2]]


def _merge(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def attn_split(fn):
    def run(q, k, v, scale):
        """q [L, H, 192]; k [H, S, 192], v [H, S, 128] (head-major) -> [L, H, 128]."""
        L, S = q.shape[0], k.shape[1]
        qn = q.transpose(0, 1).unsqueeze(0).contiguous()
        kh, vh = k[:, : S - L].unsqueeze(0), v[:, : S - L].unsqueeze(0)
        kt, vt = k[:, S - L:].unsqueeze(0), v[:, S - L:].unsqueeze(0)
        o2, l2 = fn(qn, kt, vt, True, scale)
        if S == L:
            return o2.squeeze(0).transpose(0, 1)
        o1, l1 = fn(qn, kh, vh, False, scale)
        return _merge(o1, l1, o2, l2).squeeze(0).transpose(0, 1)
    return run


def attn_lower_right(q, k, v, scale):
    from torch.nn.attention.bias import causal_lower_right

    L, S = q.shape[0], k.shape[1]
    qn = q.transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(qn, k.unsqueeze(0), v.unsqueeze(0), attn_mask=causal_lower_right(L, S),
                                          scale=scale).squeeze(0).transpose(0, 1)


ATTN = {"split_cudnn": attn_split(_cudnn), "split_efficient": attn_split(_efficient), "lower_right": attn_lower_right}


def reference(q, latent, w_kv, scale):
    k, v = expand_cat(latent.float(), w_kv.float())
    L, S = q.shape[0], k.shape[0]
    s = torch.einsum("lhd,shd->hls", q.float(), k) * scale
    mask = torch.arange(S, device=q.device)[None, :] > (torch.arange(L, device=q.device)[:, None] + S - L)
    return torch.einsum("hls,shd->lhd", torch.softmax(s.masked_fill(mask, float("-inf")), -1), v)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(L: int, hist: int, check_ref: bool) -> dict:
    S = hist + L
    g = torch.Generator(device="cuda").manual_seed(0)
    latent = torch.randn(S, R + ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
    w_kv = (torch.randn(H * (NOPE + V), R, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(R))
    q = torch.randn(L, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = (NOPE + ROPE) ** -0.5
    wk, wv = headmajor_weights(w_kv)
    row = {"L": L, "history": hist}
    k_cat, v_cat = expand_cat(latent, w_kv)
    k_hm, v_hm = expand_headmajor(latent, wk, wv)
    row["expand_bitexact"] = bool(torch.equal(k_hm.transpose(0, 1), k_cat) and torch.equal(v_hm.transpose(0, 1), v_cat))
    row["expand_cat_ms"] = events_ms(lambda: expand_cat(latent, w_kv))
    row["expand_headmajor_ms"] = events_ms(lambda: expand_headmajor(latent, wk, wv))
    base = attn_masked(q, k_cat, v_cat, scale)
    ref = reference(q, latent, w_kv, scale) if check_ref else None
    if ref is not None:
        row["masked_rel_err_vs_fp32"] = rel(base, ref)
    row["masked_ms"] = events_ms(lambda: attn_masked(q, k_cat, v_cat, scale))
    row["today_total_ms"] = events_ms(lambda: attn_masked(q, *expand_cat(latent, w_kv), scale))
    flops = 2 * L * hist * H * (NOPE + ROPE + V) + L * L * H * (NOPE + ROPE + V)
    row["attn_tflop"] = flops / 1e12
    row["masked_tflops"] = flops / row["masked_ms"] / 1e9
    for name, fn in ATTN.items():
        try:
            o = fn(q, k_hm, v_hm, scale)
            row[f"{name}_rel_err_vs_masked"] = rel(o, base)
            if ref is not None:
                row[f"{name}_rel_err_vs_fp32"] = rel(o, ref)
            row[f"{name}_ms"] = events_ms(lambda fn=fn: fn(q, k_hm, v_hm, scale))
            row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
            row[f"{name}_total_ms"] = events_ms(lambda fn=fn: fn(q, *expand_headmajor(latent, wk, wv), scale))
        except (RuntimeError, TypeError, NotImplementedError) as e:  # a backend this build lacks: say so, go on
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    k_sh, v_sh = expand_bshd(latent, wk, wv)  # [S, H, d] storage: the layout of the avoid-recompile path
    split = ATTN["split_cudnn"]
    row["expand_bshd_ms"] = events_ms(lambda: expand_bshd(latent, wk, wv))
    row["split_cudnn_bshd_rel_err_vs_masked"] = rel(split(q, k_sh, v_sh, scale), base)
    row["split_cudnn_bshd_ms"] = events_ms(lambda: split(q, k_sh, v_sh, scale))
    row["split_cudnn_bshd_total_ms"] = events_ms(lambda: split(q, *expand_bshd(latent, wk, wv), scale))
    print(row, flush=True)
    return row


def plot(path: str) -> None:
    """Bars per case: today's expansion + masked attention against the head-major expansion + split attention."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    labels = [f"{r['L']} new\non {r['history'] // 1024}K" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["today_total_ms"] for r in rows], w, label="cat + masked SDPA (before)")
    ax.bar([i + w / 2 for i in x], [r["split_cudnn_total_ms"] for r in rows], w,
           label="head-major GEMM + split cuDNN (after)")
    for i, r in enumerate(rows):
        ax.text(i + w / 2, r["split_cudnn_total_ms"], f"{r['today_total_ms'] / r['split_cudnn_total_ms']:.2f}x",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per MLA layer (expansion + attention)")
    env = data["env"]
    ax.set_title(f"MLA expanded prefill over a cached history, 32 heads ({env['gpu']}, {env['commit']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    print(f"wrote {path.replace('.json', '.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--cases", default="300:3796,256:65536,1300:65536,8192:40960,1300:16384")
    ap.add_argument("--plot", help="plot a result JSON of this script (no GPU needed) and exit")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
        return
    rows = []
    with torch.no_grad():
        for i, c in enumerate(args.cases.split(",")):
            L, hist = (int(x) for x in c.split(":"))
            rows.append(case(L, hist, check_ref=i == 0))
            torch.cuda.empty_cache()
    write_result(os.path.join(args.out, "mla_expanded_h200.json"), {"rows": rows})


if __name__ == "__main__":
    main()
