"""Triton routed experts (sorted alignment + two grouped-GEMM kernels) against the torch reference `moe_experts`.

Checked: SiLU and SiTU; odd T (1, 3, 37, 200) and k = 1..8; E = 8, 64, 256; D, I not multiples of the tiles
(D=48, I=40) and the unmasked-K path; every M-block size (16, 32, 64, 128); ids outside [0, E) (-1 and E) and
tokens with no valid id; duplicate-heavy routing (every token on the same experts, several blocks per expert);
the alignment's layout and that it never asks the host for a value (CPU: .item / .tolist / nonzero patched to
raise; CUDA: sync debug mode "error"); CUDA-graph capture and replay with new ids. Every torch.empty the op
allocates starts as NaN, so an unwritten element shows up. Tolerances: fp32 within 1e-5 (interpreter), bf16
within 1e-2 relative (max abs err / max abs ref) at the Kimi-Linear-48B decode and prefill shapes.
"""

from __future__ import annotations

import functools

from dataclasses import replace

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # noqa: E402,F401 - sets up Triton first

from tests.ops.moe_inputs import KIMI, make_weights
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts


SILU = Activation("silu")
SITU = Activation("situ", beta=4.0, linear_beta=25.0)
SITU_TIGHT = Activation("situ", beta=0.5, linear_beta=0.3)  # small caps: both tanh branches saturate



def make_routing(T, k, E, D, dtype, device, seed=1, invalid=False, same=False):
    """x [T, D] and a router-like routing: k distinct ids per token, positive weights summing to ~1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    if same:
        ids = torch.randperm(E, generator=g)[:k].expand(T, k).clone()
    else:
        ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    if invalid:
        drop = torch.rand(T, k, generator=g)
        ids = torch.where(drop < 0.2, torch.full_like(ids, -1), ids)
        ids = torch.where((drop >= 0.2) & (drop < 0.4), torch.full_like(ids, E), ids)
        if T > 1:
            ids[T // 2] = torch.tensor([-1, E] * k)[:k]  # a token with no local expert
    w = torch.rand(T, k, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True) * 2.5
    return x, w.to(device), ids.to(device)


def run(x, w1, w3, w2, tw, ids, act, **kw):
    from tokenspeed.ops.triton.moe_experts import moe_experts

    y = moe_experts(x, w1, w3, w2, tw, ids, act, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def check(T, k, E, D, DI, act, dtype=torch.float32, device="cpu", tol=None, weights=None, **kw):
    rkw = {key: kw.pop(key) for key in ("invalid", "same", "seed") if key in kw}
    w1, w3, w2 = weights or make_weights(E, D, DI, dtype, device)
    x, tw, ids = make_routing(T, k, E, D, dtype, device, **rkw)
    y_ref = ref_experts(x, w1, w3, w2, tw, ids, act)
    y = run(x, w1, w3, w2, tw, ids, act, **kw)
    err = rel_err(y, y_ref)
    assert err < (tol or (1e-5 if dtype == torch.float32 else 1e-2)), err
    return err


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU, SITU_TIGHT], ids=["silu", "situ", "situ_tight"])
@pytest.mark.parametrize("T,k,E", [(1, 1, 8), (3, 2, 8), (37, 4, 8), (200, 2, 8), (5, 8, 64), (3, 8, 256)])
def test_experts_interp(T, k, E, act, poison_empty):
    check(T, k, E, 48, 40, act)


@cpu_interp
@pytest.mark.parametrize("k", [1, 3, 5, 6, 7, 8])
def test_experts_top_k_interp(k, poison_empty):
    check(9, k, 16, 48, 40, SILU, seed=k)


@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("T,k,E", [(9, 3, 8), (13, 8, 64), (1, 2, 8)])
def test_invalid_ids_interp(T, k, E, act, poison_empty):
    check(T, k, E, 48, 40, act, invalid=True)


@cpu_interp
def test_all_ids_invalid_interp(poison_empty):
    from tokenspeed.ops.triton.moe_experts import moe_experts

    w1, w3, w2 = make_weights(8, 48, 40, torch.float32, "cpu")
    x, tw, _ = make_routing(5, 2, 8, 48, torch.float32, "cpu")
    ids = torch.tensor([[-1, 8]] * 5)
    y = moe_experts(x, w1, w3, w2, tw, ids, SILU)
    assert torch.equal(y, torch.zeros_like(y))


@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("T,k,E", [(40, 2, 8), (37, 8, 256)])
def test_same_experts_interp(T, k, E, act, poison_empty):
    """Every token on the same k experts: each expert's run spans several M-blocks."""
    check(T, k, E, 48, 40, act, same=True, invalid=T == 37)


@cpu_interp
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_block_m_interp(block_m, poison_empty):
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    cfg = ExpertsConfig(block_m, 32, 32, 4, 2, 16, 32, 4, 2)
    check(70, 3, 8, 48, 40, SITU, config=cfg, same=block_m == 32, invalid=block_m == 64)


@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
def test_even_k_interp(act, poison_empty):
    """D and I multiples of BLOCK_K: the unmasked K loops; N tiles still ragged (I=80 over 32, D=64 over 128)."""
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    check(11, 4, 8, 64, 80, act, config=ExpertsConfig(16, 32, 32, 4, 2, 128, 16, 4, 2), invalid=True)


@cpu_interp
def test_align_layout_interp():
    """Each valid pair sits once in its expert's blocks, in pair order; invalid pairs in bucket E; padding = P."""
    from tokenspeed.ops.triton.moe_align import align_pairs

    T, k, E, bm = 29, 4, 8, 16
    _, _, ids = make_routing(T, k, E, 8, torch.float32, "cpu", invalid=True, same=False)
    ids[:10] = torch.tensor([2, 5, 3, 7])  # a heavy expert run
    sp, be = align_pairs(ids, E, bm)
    P = T * k
    assert be.shape == (P // bm + min(E + 1, P),) and sp.shape == (be.numel() * bm,)
    flat = ids.reshape(-1)
    bucket = torch.where((flat >= 0) & (flat < E), flat, E)
    seen = []
    used = (be >= 0).sum().item()
    assert bool((be[used:] == -1).all()) and bool((be[:used].diff() >= 0).all())
    for b in range(used):
        rows = sp[b * bm:(b + 1) * bm].tolist()
        real = [p for p in rows if p < P]
        assert real == rows[:len(real)] and all(p == P for p in rows[len(real):])
        assert real and all(bucket[p].item() == be[b].item() for p in real)
        seen += real
    assert bool((sp[used * bm:] == P).all())
    assert sorted(seen) == list(range(P))
    for e in range(E + 1):
        run_e = [p for p in seen if bucket[p].item() == e]
        assert run_e == sorted(run_e)


@cpu_interp
def test_no_host_reads_interp(monkeypatch, poison_empty):
    """The op never pulls a value to the host (CPU stand-in for the CUDA sync check)."""
    w1, w3, w2 = make_weights(8, 48, 40, torch.float32, "cpu")
    x, tw, ids = make_routing(21, 3, 8, 48, torch.float32, "cpu", invalid=True)
    y_ref = ref_experts(x, w1, w3, w2, tw, ids, SITU)

    def boom(*a, **kw):
        raise AssertionError("host read in the op")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for name in ("nonzero", "unique", "bincount", "masked_select"):
        monkeypatch.setattr(torch, name, boom)
    y = run(x, w1, w3, w2, tw, ids, SITU)  # alignment and the interpreted kernels
    monkeypatch.undo()
    assert rel_err(y, y_ref) < 1e-5


@cpu_interp
def test_bad_args_interp():
    from tokenspeed.ops.triton.moe_experts import moe_experts

    w1, w3, w2 = make_weights(4, 32, 16, torch.float32, "cpu")
    x, tw, ids = make_routing(3, 2, 4, 32, torch.float32, "cpu")
    with pytest.raises(ValueError):
        moe_experts(x, w1, w3, w2, tw, ids, Activation("gelu"))
    with pytest.raises(ValueError):
        moe_experts(x, w1, w3, w2.transpose(1, 2), tw, ids, SILU)
    with pytest.raises(ValueError):
        moe_experts(x, w1.double(), w3, w2, tw, ids, SILU)
    y = moe_experts(x[:0], w1, w3, w2, tw[:0], ids[:0], SILU)
    assert y.shape == (0, 32)


# ----------------------------------------------------------------------------- CUDA
@functools.lru_cache(maxsize=2)
def kimi_weights(dtype):
    return make_weights(KIMI["E"], KIMI["D"], KIMI["I"], dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("T", [1, 16, 64, 2048])
def test_kimi_bf16_gpu(T, act, poison_empty):
    w = kimi_weights(torch.bfloat16)
    check(T, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"], act, torch.bfloat16, "cuda", weights=w, seed=T)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,same,invalid", [(64, True, False), (37, False, True), (300, True, True)])
def test_kimi_bf16_routing_gpu(T, same, invalid, poison_empty):
    w = kimi_weights(torch.bfloat16)
    check(T, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"], SITU, torch.bfloat16, "cuda", weights=w, same=same,
          invalid=invalid)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,k,E,D,DI", [(1, 1, 8, 48, 40), (37, 4, 64, 256, 128), (200, 8, 16, 200, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_shapes_gpu(T, k, E, D, DI, dtype, poison_empty):
    check(T, k, E, D, DI, SITU, dtype, "cuda", invalid=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_configs_gpu(block_m):
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig, default_config

    w = kimi_weights(torch.bfloat16)
    base = default_config(512, 8, 256, KIMI["D"], KIMI["I"])
    cfg = ExpertsConfig(block_m, *[getattr(base, f) for f in ("block_n1", "block_k1", "num_warps1", "num_stages1",
                                                              "block_n2", "block_k2", "num_warps2", "num_stages2")])
    if block_m >= 64:  # the decode tiles with deeper M need fewer stages to fit in shared memory
        cfg = replace(cfg, num_stages1=2, num_stages2=2)
    check(512, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"], SILU, torch.bfloat16, "cuda", weights=w, config=cfg)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_no_sync_gpu(T):
    w1, w3, w2 = kimi_weights(torch.bfloat16)
    x, tw, ids = make_routing(T, KIMI["k"], KIMI["E"], KIMI["D"], torch.bfloat16, "cuda", invalid=True)
    run(x, w1, w3, w2, tw, ids, SILU)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = run(x, w1, w3, w2, tw, ids, SILU)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rel_err(y, ref_experts(x, w1, w3, w2, tw, ids, SILU)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 64])
def test_cuda_graph_replay_gpu(T):
    """Captured with one routing, replayed on new x / weights / ids copied into the static inputs (T 1 and 4: the
    default config's align-free direct mode)."""
    w1, w3, w2 = kimi_weights(torch.bfloat16)
    k, E, D = KIMI["k"], KIMI["E"], KIMI["D"]
    x, tw, ids = make_routing(T, k, E, D, torch.bfloat16, "cuda", seed=3)
    run(x, w1, w3, w2, tw, ids, SITU)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, w1, w3, w2, tw, ids, SITU)
    for step, (same, invalid) in enumerate([(False, False), (True, True), (False, True)]):
        nx, ntw, nids = make_routing(T, k, E, D, torch.bfloat16, "cuda", seed=10 + step, same=same, invalid=invalid)
        x.copy_(nx)
        tw.copy_(ntw)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_experts(nx, w1, w3, w2, ntw, nids, SITU)) < 1e-2


@cpu_interp
@pytest.mark.parametrize("T,k,E,bm", [(37, 3, 5, 32), (300, 2, 16, 64), (600, 8, 256, 16), (1500, 9, 257, 128),
                                      (2000, 4, 8, 16)])
def test_multi_align_equals_torch_align_interp(T, k, E, bm):
    """The multi-program alignment (prefill) gives the torch alignment's layout bit for bit: stable in-bucket order
    across counting programs of 1024 pairs (one program up to 13 of them; a heavy bucket crossing several), padding,
    the invalid bucket, unused tail blocks."""
    from tokenspeed.ops.triton.moe_align import align_pairs, align_pairs_multi

    _, _, ids = make_routing(T, k, E, 8, torch.float32, "cpu", invalid=True, same=False)
    ids[: T // 2] = ids[0]  # a heavy run that crosses programs
    ids = ids.t().contiguous().t()
    sp, be = align_pairs(ids, E, bm)
    sp_m, be_m = align_pairs_multi(ids, E, bm)
    assert torch.equal(sp_m, sp) and torch.equal(be_m, be)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,k,E,bm", [(600, 8, 256, 16), (8192, 9, 257, 128), (4096, 16, 896, 64), (513, 8, 256, 32)])
def test_multi_align_equals_torch_align_gpu(T, k, E, bm):
    from tokenspeed.ops.triton.moe_align import align_pairs, align_pairs_multi

    _, _, ids = make_routing(T, k, E, 8, torch.float32, "cuda", invalid=True, same=False)
    ids[: T // 2] = ids[0]
    sp, be = align_pairs(ids, E, bm)
    sp_m, be_m = align_pairs_multi(ids, E, bm)
    assert torch.equal(sp_m, sp) and torch.equal(be_m, be)


def test_align_dispatch(monkeypatch):
    """`align` takes the one-launch kernel up to 4096 pairs, the multi-program kernels above (up to 2046 experts),
    and the torch sort beyond that many experts."""
    from tokenspeed.ops.triton import moe_align as ma

    taken = []
    for name in ("align_pairs_fused", "align_pairs_multi", "align_pairs"):
        monkeypatch.setattr(ma, name, lambda *a, _n=name: taken.append(_n))
    ma.align(torch.zeros(512, 8, dtype=torch.long), 256, 16)
    ma.align(torch.zeros(513, 8, dtype=torch.long), 256, 16)
    ma.align(torch.zeros(8, 8, dtype=torch.long), 4096, 16)
    assert taken == ["align_pairs_fused", "align_pairs_multi", "align_pairs"]


@cpu_interp
@pytest.mark.parametrize("T,k,E,bm", [(1, 8, 256, 16), (29, 4, 8, 16), (64, 8, 256, 16), (37, 3, 5, 32),
                                      (300, 2, 16, 64)])
def test_fused_align_equals_torch_align_interp(T, k, E, bm):
    """The one-launch alignment gives the torch alignment's layout bit for bit (stable in-bucket order, padding,
    invalid bucket, unused tail blocks), over several 128-pair chunks."""
    from tokenspeed.ops.triton.moe_align import align_pairs, align_pairs_fused

    _, _, ids = make_routing(T, k, E, 8, torch.float32, "cpu", invalid=True, same=False)
    ids[: T // 2] = ids[0]  # a heavy run that crosses chunks
    ids = ids.t().contiguous().t()  # strided ids, as topk's column slices can be
    sp, be = align_pairs(ids, E, bm)
    sp_f, be_f = align_pairs_fused(ids, E, bm)
    assert torch.equal(sp_f, sp) and torch.equal(be_f, be)
