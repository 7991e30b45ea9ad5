"""The low-rank gates folded into the fused KDA decode (`kda_decode(f=None, f_a=, f_b_weight=, g_a=, g_b_weight=)`)
against the composition it replaces: f = low_rank_up(f_a, f_b), gate = low_rank_up(g_a, g_b) (the model's bmm:
fp32 sums rounded to the io dtype), then today's `kda_decode(f=, norm_gate=)`.

CPU interpreter, fp32. Two kinds of inputs: on an exact grid (multiples of 1/8 and small weights, so every fp32 sum
is exact whatever its order), the folded launch must be bit-identical to the Triton composition (outputs, both
pools, step states); on random inputs, within 1e-5 of it. Schedules: split V over several programs (the gate staged
per V slice, the last arriver norms), a whole head per program, chunked decode (pipelined and register-prefetched)
and chunked verify, verify with per-token states, odd token counts, padding slots (< 0), empty sequences, padded
head dims, a rank that is not a power of two, f folded alone / the gate folded alone / both. f_a / g_a are column
views of a merged projection with NaN columns around them and the weights are NaN-tailed (a stray read shows up
as NaN); outputs and `torch.empty` scratch start NaN (every row the op returns, and every gate lane the epilogue
reads, must be written).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import clone, make, tailed, tails_intact
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed.ops.reference.kda import low_rank_up

EPS = 1e-6
LOWER = -5.0


def low_rank(T: int, H: int, D: int, R: int, exact: bool, seed: int = 11) -> dict:
    """f_a | g_a as adjacent column views of a wider projection (NaN columns around them) and NaN-tailed weights
    [H * D, R]; on the exact grid every value is a multiple of 1/8 (weights within +-1/2, inputs within +-1)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s):
        x = torch.randn(*shape, generator=g) * s
        return (x * 8).round().clamp(-8 * s, 8 * s) / 8 if exact else x

    wide = torch.full((T, 2 * R + 7), float("nan"))
    wide[:, 3:3 + 2 * R] = r(T, 2 * R, s=1.0)
    return {"f_a": wide[:, 3:3 + R], "g_a": wide[:, 3 + R:3 + 2 * R],
            "f_b_weight": tailed(r(H * D, R, s=0.5)), "g_b_weight": tailed(r(H * D, R, s=0.5 if exact else 2.0))}


def run(inp: dict, update: bool, steps: bool, **kw):
    """The Triton kda_decode on `inp` (pools mutated), outputs NaN-poisoned; (o, step_states or None)."""
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D = inp["dt_bias"].shape
    T = inp["qkv"].shape[0]
    out = tailed(torch.full((T, H, D), float("nan")))
    st = tailed(torch.full((T, H, D, D), float("nan"))) if steps else None
    y = kda_decode(**inp, lower_bound=LOWER, scale=D ** -0.5, update_state=update, step_states=st, out=out, **kw)
    assert y is out and tails_intact(out, inp["state"], inp["conv_state"])
    return y, st


def check(lens, H, D, R=None, slots=None, update=True, steps=False, fold=("f", "g"), norm=True, exact=True, **kw):
    """Folded launch vs the Triton composition (gates by `low_rank_up`, then f= / norm_gate=): bit-identical on
    the exact grid, else within 1e-5; both pools likewise; the V-split counters back at zero."""
    from tokenspeed.ops.triton.kda_decode import _counters

    inp = make(lens, H, D, torch.float32, "cpu", slots=slots)
    T = sum(lens)
    lr = low_rank(T, H, D, R or D, exact)
    w = tailed(torch.randn(D))
    f = low_rank_up(lr["f_a"], lr["f_b_weight"], torch.float32)
    gate = low_rank_up(lr["g_a"], lr["g_b_weight"], torch.float32)
    comp_kw = {"f": f, **({"norm_gate": gate, "norm_weight": w, "norm_eps": EPS} if norm else {})}
    fold_kw = {"f": None, "f_a": lr["f_a"], "f_b_weight": lr["f_b_weight"]} if "f" in fold else {"f": f}
    if norm:
        fold_kw.update({"g_a": lr["g_a"], "g_b_weight": lr["g_b_weight"]} if "g" in fold else {"norm_gate": gate})
        fold_kw.update(norm_weight=w, norm_eps=EPS)
    a, c = clone(inp), clone(inp)
    o, st = run({**a, **fold_kw}, update, steps, **kw)
    o_comp, st_comp = run({**c, **comp_kw}, update, steps, **kw)
    pairs = [(o, o_comp), (a["state"], c["state"]), (a["conv_state"], c["conv_state"])]
    if steps:
        pairs.append((st.nan_to_num(7.0), st_comp.nan_to_num(7.0)))
    for got, want in pairs:
        if exact:
            assert torch.equal(got, want), (got - want).abs().max()
        else:
            assert rel_err(got, want) < 1e-5
    assert not _counters(torch.device("cpu"), 64)[:64].any()
    return o


# (lens, H, D, R, slots, options): split V over 2 programs with a padding row and an empty sequence, a whole head
# per program, a padded head dim split with a masked tail (48 / BV 32) and a rank that is not a power of two,
# chunked decode pipelined over a fully masked last tile (48 / BV 16), chunked decode with the register prefetch.
DECODE = [
    ([1, 1, 0, 1], 2, 16, None, [3, -1, 0, 5], {"BV": 8}),
    ([1, 1, 1], 2, 16, 12, [1, 4, -1], {}),
    ([1, 1], 1, 48, 24, [2, -1], {"BV": 32}),
    ([1, 0, 1, 1], 2, 48, 16, [4, 1, -1, 0], {"BV": 16, "chunked": True, "num_stages": 2}),
    ([1, 1], 2, 16, 8, [0, 3], {"BV": 8, "chunked": True, "num_stages": 1}),
]
IDS = ["split2", "whole-r12", "pad48-r24", "chunk48", "chunk16-s1"]


@cpu_interp
@pytest.mark.parametrize("lens,H,D,R,slots,opts", DECODE, ids=IDS)
def test_fold_decode_exact_interp(lens, H, D, R, slots, opts, poison_empty):
    check(lens, H, D, R, slots=slots, **opts)


@cpu_interp
@pytest.mark.parametrize("lens,H,D,R,slots,opts", DECODE[:1] + DECODE[3:4], ids=["split2", "chunk48"])
def test_fold_decode_random_interp(lens, H, D, R, slots, opts, poison_empty):
    check(lens, H, D, R, slots=slots, exact=False, **opts)


@cpu_interp
@pytest.mark.parametrize("fold,norm", [(("f",), True), (("g",), True), (("f",), False)], ids=["f", "g", "f-nonorm"])
def test_fold_one_gate_interp(fold, norm, poison_empty):
    check([1, 1, 1], 2, 16, slots=[2, -1, 0], fold=fold, norm=norm, BV=8)


@cpu_interp
@pytest.mark.parametrize("opts,steps", [({"BV": 8}, True), ({}, False), ({"BV": 8, "chunked": True}, True)],
                         ids=["split2-steps", "whole", "chunked-steps"])
def test_fold_verify_interp(opts, steps, poison_empty):
    """Verify (pools untouched, several tokens per sequence, odd T = 7), with and without per-token states."""
    check([3, 1, 3], 1, 16, slots=[4, -1, 0], update=False, steps=steps, **opts)


@cpu_interp
def test_fold_multi_token_decode_interp(poison_empty):
    """update_state with several tokens per sequence (a prompt tail through the fused kernel), odd T."""
    check([3, 2], 2, 16, slots=[1, 5], BV=8)


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_public_op_fold_interp(mode, monkeypatch, poison_empty):
    """ops.kda_decode with the folded gates on both paths equals ops.kda_decode(f=, norm_gate=) on the reference
    path with the gates composed by `low_rank_up`; the two paths agree."""
    from tokenspeed import ops

    lens, H, D = [1, 2, 1], 2, 16
    inp = make(lens, H, D, torch.float32, "cpu", slots=[0, 4, -1])
    lr = low_rank(4, H, D, D, exact=False)
    w = torch.randn(D)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    r = clone(inp)
    r.update(f=low_rank_up(lr["f_a"], lr["f_b_weight"], torch.float32))
    want = ops.kda_decode(**r, lower_bound=LOWER, scale=0.25, norm_weight=w, norm_eps=EPS,
                          norm_gate=low_rank_up(lr["g_a"], lr["g_b_weight"], torch.float32))
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    a = clone(inp)
    a["f"] = None
    got = ops.kda_decode(**a, **lr, lower_bound=LOWER, scale=0.25, norm_weight=w, norm_eps=EPS)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(a["conv_state"], r["conv_state"]) and rel_err(a["state"], r["state"]) < 1e-5


def test_fold_argument_checks():
    from tokenspeed import ops
    from tokenspeed.ops.triton.kda_decode import kda_decode

    inp = make([1], 1, 16, torch.float32, "cpu")
    lr = low_rank(1, 1, 16, 16, exact=False)
    w = torch.randn(16)
    base = {**clone(inp), "lower_bound": LOWER, "scale": 1.0}
    for fn in (ops.kda_decode, kda_decode):
        with pytest.raises(ValueError, match="either f or f_a"):
            fn(**{**base, "f_a": lr["f_a"], "f_b_weight": lr["f_b_weight"]})  # f given too
        with pytest.raises(ValueError):
            fn(**{**base, "f": None, "f_a": lr["f_a"]})  # no weight
        with pytest.raises(ValueError):
            fn(**{**base, "g_a": lr["g_a"], "g_b_weight": lr["g_b_weight"]})  # no norm weight
        with pytest.raises(ValueError):
            fn(**{**base, "norm_gate": torch.zeros(1, 16), "norm_weight": w, "g_a": lr["g_a"],
                  "g_b_weight": lr["g_b_weight"]})  # two gates
    bad = [({"f_b_weight": torch.zeros(15, 16)}, "weight must be"),
           ({"f_b_weight": torch.zeros(32, 16)[:, ::2].t()}, "weight must be"),
           ({"f_a": torch.zeros(2, 16)}, "low-rank input must be"),
           ({"f_a": torch.zeros(1, 32)[:, ::2]}, "low-rank input must be")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            kda_decode(**{**base, "f": None, **{k: lr[k] for k in ("f_a", "f_b_weight")}, **kw})
    with pytest.raises(ValueError, match="one rank"):
        kda_decode(**{**base, "f": None, "f_a": lr["f_a"], "f_b_weight": lr["f_b_weight"], "norm_weight": w,
                      "g_a": lr["g_a"][:, :8], "g_b_weight": torch.zeros(16, 8)})


@pytest.mark.parametrize("on", [True, False])
def test_fold_launch_plumbing(on, monkeypatch):
    """Host only: the folded launch passes FOLD_F / FOLD_G, the rank, the bulk-prefetch row bytes (aligned
    weights) and PDL like the plain one; the plain launch folds nothing."""
    from tokenspeed.ops.triton import kda_decode as mod
    from tokenspeed.ops.triton import pdl

    calls: list[dict] = []

    class Catch:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw)

    monkeypatch.setattr(mod, "_kda_decode_kernel", Catch())
    monkeypatch.setattr(pdl, "enabled", lambda device, family="": on)
    monkeypatch.setattr(pdl, "launch_kwargs", lambda device, family="": {"launch_pdl": True} if on else {})
    inp = make([1, 2], 1, 16, torch.float32, "cpu")
    lr = low_rank(3, 1, 16, 12, exact=False)
    mod.kda_decode(**{**clone(inp), "f": None}, **lr, norm_weight=torch.ones(16), lower_bound=LOWER, scale=1.0)
    mod.kda_decode(**clone(inp), lower_bound=LOWER, scale=1.0)
    assert len(calls) == 2
    kw = calls[0]
    assert kw["FOLD_F"] and kw["FOLD_G"] and kw["NORM"] and kw["R"] == 12 and kw["BR"] == 16
    assert kw["PDL"] is on and kw.get("launch_pdl", False) is on
    assert kw["PF_W"] == 48  # 12 fp32 = 48 bytes a row, 16-byte aligned rows: bulk-prefetched before the wait
    assert not calls[1]["FOLD_F"] and not calls[1]["FOLD_G"]


# ----------------------------------------------------------------------------- CUDA (bf16, Kimi-Linear's 32 x 128)
def _gpu_layer(lens, slots, seed=3):
    """Kimi-Linear geometry on CUDA, bf16: the layer inputs, f_a | g_a adjacent columns of one merged projection and
    the stacked [2, H * D, R] up-projection weight (as `StackedLinear` holds it), R = D = 128."""
    H, D = 32, 128
    T = sum(lens)
    inp = make(lens, H, D, torch.bfloat16, "cuda", slots=slots)
    g = torch.Generator().manual_seed(seed)
    fg_a = torch.randn(T, 2 * D + 8, generator=g).to("cuda", torch.bfloat16)[:, 8:]
    w = (torch.randn(2, H * D, D, generator=g) * D ** -0.5).to("cuda", torch.bfloat16)
    return inp, fg_a, w


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lens,slots,opts", [([1], None, {}), ([1] * 8, None, {}), ([1, 1, 1, 1], [3, -1, 7, 0], {}),
                                             ([1] * 8, None, {"num_stages": 1}), ([3, 2], None, {})])
def test_fold_gpu(lens, slots, opts):
    """Folded vs the composition it replaces (the bmm `StackedLinear` runs, then kda_decode(f=, norm_gate=)):
    outputs and pools within bf16 rounding of the gates' summation order; the share bit-identical printed."""
    from tokenspeed.ops.triton.kda_decode import kda_decode

    inp, fg_a, w = _gpu_layer(lens, slots)
    T, D = fg_a.shape[0], 128
    nw = torch.randn(D, device="cuda")
    f, gate = torch.bmm(fg_a.view(T, 2, D).transpose(0, 1), w.transpose(1, 2)).unbind(0)
    a, c = clone(inp), clone(inp)
    kw = {"lower_bound": LOWER, "scale": D ** -0.5, "norm_weight": nw, "norm_eps": EPS, **opts}
    o = kda_decode(**{**a, "f": None}, f_a=fg_a[:, :D], f_b_weight=w[0], g_a=fg_a[:, D:], g_b_weight=w[1], **kw)
    o_comp = kda_decode(**{**c, "f": f}, norm_gate=gate, **kw)
    torch.cuda.synchronize()
    same = (o == o_comp).float().mean().item()
    print(f"bit-identical {same:.4%}, max |diff| {(o.float() - o_comp.float()).abs().max().item():.3g}")
    assert rel_err(o, o_comp) < 1e-2
    assert rel_err(a["state"], c["state"]) < 1e-2 and torch.equal(a["conv_state"], c["conv_state"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lens", [[1], [1] * 8])
def test_fold_pdl_after_producer_graph_gpu(lens, monkeypatch):
    """A CUDA graph of a PDL GEMV writing the merged projection (q|k|v|f_a|g_a|b) and the folded decode: replays
    on fresh inputs give the bits of the same launches with TOKENSPEED_PDL=0 (a read of f_a / g_a before the PDL
    wait would see the previous replay's values)."""
    from tokenspeed.ops.triton.gemv import gemv
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D, K = 32, 128, 256
    T, C = sum(lens), 3 * H * D
    g = torch.Generator().manual_seed(5)
    w_merged = (torch.randn(C + 2 * D + H, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    w_up = (torch.randn(2, H * D, D, generator=g) * D ** -0.5).to("cuda", torch.bfloat16)
    base = make(lens, H, D, torch.bfloat16, "cuda")
    nw = torch.randn(D).cuda()
    x = torch.zeros(T, K, dtype=torch.bfloat16, device="cuda")

    def step(pools):
        y = gemv(x, w_merged)
        return kda_decode(y[:, :C], None, y[:, C + 2 * D:], base["conv_weight"], pools["conv_state"], base["A_log"],
                          base["dt_bias"], pools["state"], base["state_indices"], base["cu_seqlens"],
                          lower_bound=LOWER, scale=D ** -0.5, f_a=y[:, C:C + D], f_b_weight=w_up[0],
                          g_a=y[:, C + D:C + 2 * D], g_b_weight=w_up[1], norm_weight=nw, norm_eps=EPS)

    xs = [torch.randn(T, K, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    monkeypatch.setenv("TOKENSPEED_PDL", "0")
    eager = {"state": base["state"].clone(), "conv_state": base["conv_state"].clone()}
    want = []
    for xi in xs:
        x.copy_(xi)
        want.append(step(eager).clone())
    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    pools = {"state": base["state"].clone(), "conv_state": base["conv_state"].clone()}
    step({"state": base["state"].clone(), "conv_state": base["conv_state"].clone()})  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(pools)
    pools["state"].copy_(base["state"])
    pools["conv_state"].copy_(base["conv_state"])
    for xi, want_o in zip(xs, want, strict=True):
        x.copy_(xi)
        graph.replay()
        assert torch.equal(out, want_o)
    assert torch.equal(pools["state"], eager["state"]) and torch.equal(pools["conv_state"], eager["conv_state"])
