"""`moe_experts(..., residual=, norm_weight=, norm_eps=)`: the FFN junction (h + y, then the next RMSNorm) fused
into the routed experts' combine, and the PDL plumbing of the MoE launches.

Contract: (normed, summed) = add_rms_norm(moe_experts(...), residual, norm_weight, norm_eps): the experts' output
rounded to x.dtype first (`add` included), then the add rounded, then the norm of the rounded sum.
CPU (Triton interpreter, fp32): bit for bit the Triton op followed by the Triton `add_rms_norm`, and within 1e-5
of the reference (which composes the same two), in the direct and the aligned mode, with and without `add`, ids
outside [0, E), a strided residual, D over several combine tiles (1100: the unfused combine splits a row over two
programs, the fused one takes it whole) and at the Kimi width (2304); nothing given is mutated, every torch.empty
starts as NaN. In fp16 (the combine kernel alone): bit for bit the two kernels, and adding the unrounded fp32 sum
instead (the fusion done wrong) changes many elements. `ops.moe_experts` fuses up to ADD_NORM_FUSED_MAX_ROWS rows
and runs the unfused pair above, the same bits; the reference mode composes; bad arguments are rejected by every
path; empty calls. PDL: in the interpreter nothing is launched as a dependent; with PDL forced on (launches caught,
not run) every MoE launch carries the wait and the attribute, the down kernel its W2 prefetch (not with TMA loads
or turned off) and gate_up the prefetch of a `prefetch_expert` hint (an id in [0, E), pointer loads); the W2
prefetch size rule.
CUDA (`-m gpu`): bf16 at the Kimi-Linear shapes (E 256 + 1, k 8 + 1, D 2304, I 1024; T = 1, 4, 64), fused bit for
bit against `moe_experts` then `ops.add_rms_norm`; PDL on and off give the same bits, eager and in CUDA-graph
replays.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.ops.moe_inputs import KIMI, make_weights  # torch only
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # before anything imports Triton
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts

SILU = Activation("silu")
SITU = Activation("situ", beta=4.0, linear_beta=25.0)
EPS = 1e-6


def routing(T: int, k: int, E: int, D: int, dtype, device, seed: int = 0, invalid: bool = False):
    """x, weights, k distinct ids per token (some -1 / E with `invalid`), a residual and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    if invalid:
        drop = torch.rand(T, k, generator=g)
        ids = torch.where(drop < 0.2, torch.full_like(ids, -1), torch.where(drop < 0.35, torch.full_like(ids, E), ids))
    tw = torch.rand(T, k, generator=g) + 0.1
    residual = torch.randn(T, D, generator=g) * 3
    w = torch.rand(D, generator=g) + 0.5
    return (x.to(device, dtype), tw.to(device), ids.to(device), residual.to(device, dtype), w.to(device, dtype))


def unfused(x, w1, w3, w2, tw, ids, act, residual, w, add=None, config=None):
    from tokenspeed.ops.triton.moe_experts import moe_experts
    from tokenspeed.ops.triton.norm import add_rms_norm

    return add_rms_norm(moe_experts(x, w1, w3, w2, tw, ids, act, add=add, config=config), residual, w, EPS)


def check(T, k, E, D, DI, act, *, direct=None, add=False, invalid=False, strided=False, seed=0):
    from tokenspeed.ops.triton.moe_experts import default_config, moe_experts

    w1, w3, w2 = make_weights(E, D, DI, torch.float32, "cpu", seed=seed)
    x, tw, ids, residual, w = routing(T, k, E, D, torch.float32, "cpu", seed=seed, invalid=invalid)
    if strided:
        residual = torch.cat([residual, residual[:, :5]], 1)[:, :D]
        assert residual.stride(0) == D + 5
    s = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1)) if add else None
    cfg = default_config(T, k, E, D, DI, 4)
    if direct is not None:
        cfg = replace(cfg, direct_max_tokens=T if direct else 0)
    before = [t.clone() for t in (x, residual, w, tw, ids)]
    normed, summed = moe_experts(x, w1, w3, w2, tw, ids, act, add=s, residual=residual, norm_weight=w,
                                 norm_eps=EPS, config=cfg)
    assert normed.shape == summed.shape == (T, D) and normed.dtype == summed.dtype == x.dtype
    want_normed, want_summed = unfused(x, w1, w3, w2, tw, ids, act, residual, w, add=s, config=cfg)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)
    ref_normed, ref_summed = ref_experts(x, w1, w3, w2, tw, ids, act, add=s, residual=residual, norm_weight=w,
                                         norm_eps=EPS)
    assert rel_err(summed, ref_summed) < 1e-5 and rel_err(normed, ref_normed) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip((x, residual, w, tw, ids), before, strict=True))


# ----------------------------------------------------------------------------- CPU (interpreter)
@cpu_interp
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "aligned"])
@pytest.mark.parametrize("T,k,E,D", [(1, 2, 8, 48), (3, 4, 8, 40), (4, 8, 64, 1100)])
@pytest.mark.parametrize("add", [False, True], ids=["plain", "add"])
def test_junction_equals_unfused_interp(T, k, E, D, direct, add, poison_empty):
    check(T, k, E, D, 40, SITU if T % 2 else SILU, direct=direct, add=add, invalid=T == 3, strided=T == 4,
          seed=T + 10 * add)


@cpu_interp
@pytest.mark.parametrize("T,D", [(9, 48), (2, 2304)])
def test_junction_more_rows_and_kimi_width_interp(T, D, poison_empty):
    check(T, 3, 8, D, 32, SILU, add=T == 9, invalid=True)


def _combines(buf, tw, residual, w, k):
    from tokenspeed.ops.triton.moe_combine import combine, combine_add_rms_norm
    from tokenspeed.ops.triton.norm import add_rms_norm

    fused = combine_add_rms_norm(buf, tw, k, residual, w, EPS)
    return fused, add_rms_norm(combine(buf, tw, k, residual.dtype), residual, w, EPS)


@cpu_interp
def test_junction_fp16_rounds_the_ffn_output_first_interp():
    T, k, D = 17, 5, 300
    g = torch.Generator().manual_seed(3)
    buf = (torch.randn(T * k, D, generator=g) * 4).half()
    tw = torch.rand(T * k, generator=g) + 0.05
    residual = (torch.randn(T, D, generator=g) * 4).half()
    w = (torch.rand(D, generator=g) + 0.5).half()
    (normed, summed), (want_normed, want_summed) = _combines(buf, tw, residual, w, k)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)
    acc = torch.zeros(T, D)
    for j in range(k):  # the kernel's order: slot by slot, fp32
        acc = acc + tw.view(T, k)[:, j:j + 1] * buf.view(T, k, D)[:, j].float()
    assert torch.equal(summed, (residual.float() + acc.half().float()).half())
    once = (residual.float() + acc).half()  # the FFN output not rounded before the add: another function
    assert (once != summed).double().mean().item() > 0.02


@cpu_interp
def test_ops_fuses_up_to_the_add_norm_row_limit_interp(monkeypatch, poison_empty):
    from tokenspeed import ops
    from tokenspeed.ops.triton import moe_combine
    from tokenspeed.ops.triton import moe_experts as tk

    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = []
    real = moe_combine.combine_add_rms_norm
    monkeypatch.setattr(tk, "combine_add_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w1, w3, w2 = make_weights(8, 48, 40, torch.float32, "cpu")
    x, tw, ids, residual, w = routing(3, 2, 8, 48, torch.float32, "cpu", seed=4)
    s = torch.randn(3, 48)
    want = ops.add_rms_norm(ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=s), residual, w, EPS)
    got = ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=s, residual=residual, norm_weight=w, norm_eps=EPS)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.setattr(ops, "ADD_NORM_FUSED_MAX_ROWS", 2)  # 3 rows: the unfused pair
    got = ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=s, residual=residual, norm_weight=w, norm_eps=EPS)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    got = ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=s, residual=residual, norm_weight=w, norm_eps=EPS)
    ref = ref_experts(x, w1, w3, w2, tw, ids, SILU, add=s, residual=residual, norm_weight=w, norm_eps=EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)) and len(calls) == 1


@cpu_interp
def test_junction_errors_and_empty_calls_interp(poison_empty):
    from tokenspeed import ops
    from tokenspeed.ops.triton.moe_experts import moe_experts
    from tokenspeed.ops.triton.norm import add_rms_norm

    w1, w3, w2 = make_weights(4, 32, 16, torch.float32, "cpu")
    x, tw, ids, residual, w = routing(3, 2, 4, 32, torch.float32, "cpu")
    bad = [({"residual": residual}, "go together"), ({"norm_weight": w}, "go together"),
           ({"residual": residual[:, :31], "norm_weight": w}, "residual must be"),
           ({"residual": residual.double(), "norm_weight": w}, "residual must be"),
           ({"residual": residual, "norm_weight": w[:31]}, "norm_weight must be"),
           ({"residual": residual, "norm_weight": w.long()}, "norm_weight must be")]
    for fn in (moe_experts, ref_experts, ops.moe_experts):
        for kw, msg in bad:
            with pytest.raises(ValueError, match=msg):
                fn(x, w1, w3, w2, tw, ids, SILU, **kw)
    s = torch.randn(3, 32)
    for a in (None, s):  # k = 0: nothing routed, the junction of zeros (+ add)
        got = moe_experts(x, w1, w3, w2, tw[:, :0], ids[:, :0], SILU, add=a, residual=residual, norm_weight=w)
        want = add_rms_norm(torch.zeros(3, 32) if a is None else a, residual, w, 1e-6)
        assert all(torch.equal(g, v) for g, v in zip(got, want, strict=True))
    normed, summed = moe_experts(x[:0], w1, w3, w2, tw[:0], ids[:0], SILU, residual=residual[:0], norm_weight=w)
    assert normed.shape == summed.shape == (0, 32)


def _caught_launches(monkeypatch, call, pdl_on: bool) -> list[tuple[str, dict]]:
    """(kernel name, launch keywords) of call()'s MoE launches, caught instead of run, with pdl.enabled forced."""
    from tokenspeed.ops.triton import moe_align, moe_combine, moe_pdl, moe_route, pdl
    from tokenspeed.ops.triton import moe_experts as tk

    seen: list = []

    class Catch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((self.name, kw, a))

    with monkeypatch.context() as m:
        m.setattr(pdl, "enabled", lambda device, family="": pdl_on)
        m.setattr(moe_pdl, "_sm_count", lambda device: 132)
        for mod, names in ((tk, ("_gate_up_kernel", "_down_kernel", "_gather_x_kernel")),
                           (moe_combine, ("_combine_kernel", "_combine_norm_kernel")), (moe_align, ("_align_kernel",)),
                           (moe_route, ("_moe_route_kernel",))):
            for n in names:
                m.setattr(mod, n, Catch(n))
        call()
    return seen


@cpu_interp
@pytest.mark.parametrize("pdl_on", [False, True], ids=["interpreter", "pdl_forced"])
def test_moe_launches_pdl_plumbing_interp(monkeypatch, pdl_on: bool):
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "1")  # the prefetch plumbing (off by default)
    from tokenspeed.ops.triton import moe_experts as tk
    from tokenspeed.ops.triton.moe_route import moe_route

    dt = torch.bfloat16
    E, D, DI = 16, 64, 32
    w1, w3, w2 = (t.to(dt) for t in make_weights(E, D, DI, torch.float32, "cpu"))
    x, tw, ids, residual, w = routing(4, 3, E, D, dt, "cpu")
    prefill = tk.ExpertsConfig(16, 32, 32, 4, 2, 32, 32, 4, 2, gather_x=True, tma1=True, tma2=True)
    aligned = replace(tk.default_config(4, 3, E, D, DI), direct_max_tokens=0)
    calls = [  # (call, the down kernel prefetches W2, the expert gate_up prefetches; when PDL is on)
        (lambda: moe_route(torch.zeros(4, E), None, 3), None, None),
        (lambda: tk.moe_experts(x, w1, w3, w2, tw, ids, SILU, residual=residual, norm_weight=w,
                                prefetch_expert=E - 1), True, E - 1),  # direct
        (lambda: tk.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=x, config=aligned, prefetch_expert=3), True, 3),
        (lambda: tk.moe_experts(x, w1, w3, w2, tw, ids, SILU, config=prefill, prefetch_expert=3), False, None),
        (lambda: tk.moe_experts(x, w1, w3, w2, tw, ids, SILU, config=replace(aligned, prefetch_w2=False),
                                prefetch_expert=E), False, None)]  # no W2 prefetch; E is no expert: no hint
    names = []
    for call, prefetch2, expert in calls:
        for name, kw, args in _caught_launches(monkeypatch, call, pdl_on):
            names.append(name)
            assert kw["PDL"] is pdl_on and kw.get("launch_pdl", False) is pdl_on, name
            if name == "_down_kernel":
                assert kw["PREFETCH"] is (pdl_on and prefetch2) and (args[-1] > 0) is kw["PREFETCH"]
            if name == "_gate_up_kernel":  # (pf_expert, pf_bytes) last: whole W1 / W3 rows of D bf16
                want = pdl_on and expert is not None
                assert kw["PREFETCH"] is want and args[-2:] == ((expert, D * 2) if want else (0, 0))
    assert set(names) == {"_moe_route_kernel", "_gate_up_kernel", "_down_kernel", "_combine_norm_kernel",
                          "_align_kernel", "_combine_kernel", "_gather_x_kernel"}


@cpu_interp
def test_w2_prefetch_bytes_interp(monkeypatch):
    from tokenspeed.ops.triton import moe_pdl

    monkeypatch.setattr(moe_pdl, "_sm_count", lambda device: 132)
    w2 = torch.zeros(9, 2304, 1024, dtype=torch.bfloat16)
    monkeypatch.delenv("TOKENSPEED_L2_PREFETCH", raising=False)
    assert moe_pdl.w2_prefetch_bytes(w2, 64, 8, True) == 0  # off unless TOKENSPEED_L2_PREFETCH=1 (H200 A/B)
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "1")
    assert moe_pdl.w2_prefetch_bytes(w2, 64, 648, False) == 0  # not a PDL launch (or TMA loads, or turned off)
    assert moe_pdl.w2_prefetch_bytes(w2, 64, 8, True) == 2048  # few programs: whole rows
    cap = moe_pdl.PREFETCH_L2_BYTES // (moe_pdl.PREFETCH_CTAS_PER_SM * 132 * 64) // 16 * 16
    assert moe_pdl.w2_prefetch_bytes(w2, 64, 100_000, True) == cap < 2048
    odd, even = (torch.zeros(9, 64, n, dtype=torch.bfloat16) for n in (1001, 1000))
    assert moe_pdl.w2_prefetch_bytes(odd, 64, 8, True) == 0  # 2002-byte rows: not 16-byte aligned
    assert moe_pdl.w2_prefetch_bytes(even, 64, 8, True) == 2000
    assert moe_pdl.w2_prefetch_bytes(w2.transpose(1, 2).contiguous().transpose(1, 2), 64, 8, True) == 0


# ----------------------------------------------------------------------------- CUDA
def _kimi_case(T: int, seed: int = 0):
    E, k = KIMI["E"] + 1, KIMI["k"] + 1  # the folded shared expert: id E, weight 1.0, in every row
    w1, w3, w2 = make_weights(E, KIMI["D"], KIMI["I"], torch.bfloat16, "cuda")
    x, tw, ids, residual, w = routing(T, k, E, KIMI["D"], torch.bfloat16, "cuda", seed=seed)
    ids[:, -1], tw[:, -1] = E - 1, 1.0
    return x, w1, w3, w2, tw, ids, residual, w


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 64])
def test_junction_kimi_gpu(T, poison_empty):
    from tokenspeed import ops

    x, w1, w3, w2, tw, ids, residual, w = _kimi_case(T, seed=T)
    for add in (None, torch.randn_like(x)):
        got = ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=add, residual=residual, norm_weight=w, norm_eps=EPS)
        want = ops.add_rms_norm(ops.moe_experts(x, w1, w3, w2, tw, ids, SILU, add=add), residual, w, EPS)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 64])
def test_pdl_on_off_same_bits_gpu(T, monkeypatch):
    """PDL on and off give the same bits, eager and over repeated CUDA-graph replays (a missing wait would show
    as a race: stale ids, h or buffer rows)."""
    from tokenspeed import ops

    x, w1, w3, w2, _, _, residual, w = _kimi_case(T, seed=T)
    logits = torch.randn(T, KIMI["E"], device="cuda")
    bias = torch.randn(KIMI["E"], device="cuda") * 0.1

    def step():
        rw, rid = ops.moe_route(logits, bias, KIMI["k"], shared_expert_id=KIMI["E"])
        y = ops.moe_experts(x, w1, w3, w2, rw, rid, SILU)
        return (y, *ops.moe_experts(x, w1, w3, w2, rw, rid, SILU, add=y, residual=residual, norm_weight=w,
                                    norm_eps=EPS))

    monkeypatch.setenv("TOKENSPEED_PDL", "0")
    want = step()
    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    assert all(torch.equal(a, b) for a, b in zip(step(), want, strict=True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(20):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
