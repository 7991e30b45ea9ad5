"""The gated RMSNorm epilogue of the fused KDA decode kernel (`kda_decode(..., norm_gate=, norm_weight=,
norm_eps=)`) against the composition it replaces: `kda_decode` then `gated_rms_norm`.

Checked on the CPU interpreter (fp32): the fused output is bit-identical to the Triton composition (the Triton
kda_decode, then the Triton gated_rms_norm) and within 1e-5 of the reference composition; the two pools are
bit-identical to those of the plain launch (the epilogue touches neither); the per-(sequence, head) counters that
the V split shares between the conv-state write and the norm are back at zero, also across several launches that
mix decode, verify and plain launches. Schedules: split V (NV > 1: the last program of a head norms its rows; NV 1),
chunked (one program per head), verify (several tokens per sequence, with and without per-token states), padding
slots, zero-length sequences, seq_lens (rows past a count stay zero), padded head dims (48, 80). The gate is a
column view of a wider projection with NaN around it and the weight NaN-tailed, so a stray read shows up as NaN;
outputs start NaN-poisoned (every row the op returns must be written).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import clone, make, tailed, tails_intact
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed.ops import _kda_decode_reference
from tokenspeed.ops.reference.norm import gated_rms_norm as gated_rms_norm_ref
from tokenspeed.ops.triton.kda_config import KdaConfig

EPS = 1e-6
LOWER = -5.0


def norm_args(T: int, H: int, D: int, seed: int = 7) -> dict:
    """A gate that is a column view of a wider projection (NaN columns on both sides) and a NaN-tailed weight
    with negative entries."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.full((T, H * D + 9), float("nan"))
    wide[:, 4:4 + H * D] = torch.randn(T, H * D, generator=g) * 2
    return {"norm_gate": wide[:, 4:4 + H * D], "norm_weight": tailed(torch.randn(D, generator=g)), "norm_eps": EPS}


def run(inp: dict, norm: dict | None, update: bool = True, steps: bool = False, **kw):
    """The Triton kda_decode on `inp` (pools mutated), outputs NaN-poisoned first (zeros with seq_lens: rows past
    the counts are not written); (o, step_states or None)."""
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D = inp["dt_bias"].shape
    T = inp["qkv"].shape[0]
    out = tailed(torch.full((T, H, D), 0.0 if "seq_lens" in kw else float("nan")))
    st = tailed(torch.full((T, H, D, D), float("nan"))) if steps else None
    y = kda_decode(**inp, lower_bound=LOWER, scale=D ** -0.5, update_state=update, step_states=st, out=out,
                   **(norm or {}), **kw)
    assert y is out and tails_intact(out, inp["state"], inp["conv_state"])
    return y, st


def check(lens, H, D, slots=None, update=True, steps=False, seq_lens=None, **kw):
    """Fused epilogue vs the Triton and the reference compositions; pools and step states vs the plain launch."""
    import tokenspeed.ops.triton.norm as tnorm
    from tokenspeed.ops.triton.kda_decode import _counters

    inp = make(lens, H, D, torch.float32, "cpu", slots=slots)
    T = sum(lens)
    nrm = norm_args(T, H, D)
    extra = {} if seq_lens is None else {"seq_lens": torch.tensor(seq_lens)}
    a, p, r = clone(inp), clone(inp), clone(inp)
    o, st = run(a, nrm, update, steps, **extra, **kw)
    o_plain, st_plain = run(p, None, update, steps, **extra, **kw)
    gate3 = nrm["norm_gate"].view(T, H, D)
    o_comp = tnorm.gated_rms_norm(o_plain, gate3, nrm["norm_weight"], EPS)
    o_ref = _kda_decode_reference(**r, lower_bound=LOWER, scale=D ** -0.5, update_state=update, step_states=None,
                                  **extra)
    o_ref = gated_rms_norm_ref(o_ref, gate3, nrm["norm_weight"], EPS)
    assert torch.equal(o, o_comp), (o - o_comp).abs().max()
    assert rel_err(o, o_ref) < 1e-5
    assert torch.equal(a["state"], p["state"]) and torch.equal(a["conv_state"], p["conv_state"])
    assert torch.equal(a["conv_state"], r["conv_state"]) and rel_err(a["state"], r["state"]) < 1e-5
    if steps:
        assert torch.equal(st.nan_to_num(7.0), st_plain.nan_to_num(7.0))
    assert not _counters(torch.device("cpu"), 64)[:64].any()
    return o


# (lens, H, D, slots, options): split V over 2 programs and a whole head per program, with a padding row and an
# empty sequence; padded head dims split with a masked tail (48 / BV 32) and over 5 programs (80 / BV 16);
# chunked with a fully masked last tile (48 / BV 16) and pipelined stages.
DECODE = [
    ([1, 2, 0, 1], 2, 16, [3, -1, 0, 5], {"BV": 8}),
    ([1, 2, 0, 1], 2, 16, [3, -1, 0, 5], {}),
    ([1, 1], 1, 48, [2, -1], {"BV": 32}),
    ([1], 1, 80, [1], {}),
    ([1, 3, 0, 2, 1], 1, 48, [4, 1, 6, -1, 0], {"BV": 16, "chunked": True, "num_stages": 2}),
    ([1, 2], 2, 16, [0, 3], {"BV": 8, "chunked": True, "num_stages": 1}),
]


@cpu_interp
@pytest.mark.parametrize("lens,H,D,slots,opts", DECODE, ids=["split2", "whole", "pad48", "pad80", "chunk48",
                                                             "chunk16"])
def test_decode_norm_epilogue_interp(lens, H, D, slots, opts):
    check(lens, H, D, slots=slots, **opts)


@cpu_interp
@pytest.mark.parametrize("opts,steps", [({"BV": 8}, True), ({}, False), ({"BV": 8, "chunked": True}, True)],
                         ids=["split2-steps", "whole", "chunked-steps"])
def test_verify_norm_epilogue_interp(opts, steps):
    """Verify (pools untouched, several tokens per sequence): the V-split counter now also serves a launch that
    writes no conv state."""
    check([3, 1, 2], 1, 16, slots=[4, -1, 0], update=False, steps=steps, **opts)


@cpu_interp
def test_seq_lens_norm_epilogue_interp():
    """Only the first seq_lens[n] rows of each sequence are computed and normed; the rest stay zero."""
    o = check([3, 3, 2], 1, 16, slots=[2, 5, -1], seq_lens=[0, 2, 5], BV=8)
    assert torch.equal(o[:3], torch.zeros_like(o[:3])) and torch.equal(o[5], torch.zeros_like(o[5]))


@cpu_interp
def test_counter_shared_across_launches_interp():
    """Split launches on one counter array: decode with the norm, verify with the norm (no conv-state write),
    decode without it, decode with it; each equals the reference step (a stale count would skip a norm or the
    q/k conv-state write)."""
    D, lens, slots = 16, [1, 1], [3, -1]
    inp = make(lens, 1, D, torch.float32, "cpu", slots=slots)
    a, r = clone(inp), clone(inp)
    for step, (update, norm) in enumerate([(True, True), (False, True), (True, False), (True, True)]):
        new = make(lens, 1, D, torch.float32, "cpu", slots=slots, seed=20 + step)
        for key in ("qkv", "f", "b"):
            a[key] = r[key] = new[key]
        nrm = norm_args(2, 1, D, seed=step) if norm else None
        o, _ = run(a, nrm, update, BV=8)
        o_ref = _kda_decode_reference(**r, lower_bound=LOWER, scale=D ** -0.5, update_state=update, step_states=None)
        if norm:
            o_ref = gated_rms_norm_ref(o_ref, nrm["norm_gate"].view(2, 1, D), nrm["norm_weight"], EPS)
        assert rel_err(o, o_ref) < 1e-5, step
        assert torch.equal(a["conv_state"], r["conv_state"]) and rel_err(a["state"], r["state"]) < 1e-5


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_public_op_norm_poisoned_interp(mode, monkeypatch, poison_empty):
    """ops.kda_decode(norm_gate=...) on both paths (torch.empty allocations NaN-poisoned) equals the reference
    composition of ops.kda_decode and ops.gated_rms_norm."""
    from tokenspeed import ops

    lens, H, D = [1, 2, 1], 2, 16
    inp = make(lens, H, D, torch.float32, "cpu", slots=[0, 4, -1])
    nrm = norm_args(sum(lens), H, D)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    r = clone(inp)
    want = ops.gated_rms_norm(ops.kda_decode(**r, lower_bound=LOWER, scale=0.25), nrm["norm_gate"].view(4, H, D),
                              nrm["norm_weight"], EPS)
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    a = clone(inp)
    got = ops.kda_decode(**a, lower_bound=LOWER, scale=0.25, **nrm)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(a["conv_state"], r["conv_state"]) and rel_err(a["state"], r["state"]) < 1e-5


def test_norm_argument_checks():
    from tokenspeed import ops
    from tokenspeed.ops.triton.kda_decode import kda_decode

    inp = make([1], 1, 16, torch.float32, "cpu")
    nrm = norm_args(1, 1, 16)
    with pytest.raises(ValueError, match="go together"):
        ops.kda_decode(**clone(inp), lower_bound=LOWER, scale=1.0, norm_gate=nrm["norm_gate"])
    bad = [({"norm_weight": nrm["norm_weight"]}, "go together"),
           ({**nrm, "norm_gate": torch.zeros(1, 2, 8)}, "norm_gate must be"),
           ({**nrm, "norm_gate": torch.zeros(1, 32)[:, ::2]}, "norm_gate must be"),
           ({**nrm, "norm_weight": torch.zeros(8)}, "norm_weight must be")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            kda_decode(**clone(inp), lower_bound=LOWER, scale=1.0, **kw)


@pytest.mark.parametrize("on", [True, False])
def test_pdl_launch_plumbing(on, monkeypatch):
    """Host only (the interpreter cannot run the PDL wait): with `pdl.enabled` forced, both wrappers launch the
    kernel with PDL=True and launch_pdl=True; without, PDL=False and no launch_pdl (a dependent launch without its
    wait compiled in would read the projections early). The bulk state prefetch (PF_STATE) follows the device
    (sm_90, `pdl.hopper`, whether PDL is on or not) and `KdaConfig.prefetch_state` (off by default); never in the
    replay.
    That the PDL variants compile for sm_90 is checked by benchmarks/kda_compile_sm90.py."""
    from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors
    from tokenspeed.ops.triton import kda_decode as mod
    from tokenspeed.ops.triton import pdl

    calls: list[dict] = []

    class Catch:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw)

    monkeypatch.setattr(mod, "_kda_decode_kernel", Catch())
    monkeypatch.setattr(pdl, "enabled", lambda device, family="": on)
    monkeypatch.setattr(pdl, "launch_kwargs", lambda device, family="": {"launch_pdl": True} if on else {})
    monkeypatch.setattr(pdl, "hopper", lambda device: True)
    inp = make([1, 2], 1, 16, torch.float32, "cpu")
    mod.kda_decode(**clone(inp), lower_bound=LOWER, scale=1.0, config=KdaConfig(16, prefetch_state=True),
                   **norm_args(3, 1, 16))
    table = KdaLayerTable.build([KdaLayerTensors(*(inp[k] for k in KdaLayerTensors._fields))] * 2, strict=True)
    mod.kda_replay_layers(table, inp["state_indices"], inp["cu_seqlens"], None, lower_bound=LOWER)
    assert len(calls) == 2
    for kw in calls:
        assert kw["PDL"] is on and kw.get("launch_pdl", False) is on
    assert calls[0]["NORM"] and calls[0]["PF_STATE"] and not calls[1]["NORM"] and not calls[1]["PF_STATE"]
    mod.kda_decode(**clone(inp), lower_bound=LOWER, scale=1.0)  # the default: off
    monkeypatch.setattr(pdl, "hopper", lambda device: False)
    mod.kda_decode(**clone(inp), lower_bound=LOWER, scale=1.0, config=KdaConfig(16, prefetch_state=True))
    assert not calls[2]["PF_STATE"] and not calls[3]["PF_STATE"]


# ----------------------------------------------------------------------------- CUDA (bf16, Kimi-Linear's 32 x 128)
def ulp_distance_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 units in the last place (ordered integer distance of the bit patterns)."""
    def key(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (key(a) - key(b)).abs()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lens,slots,update,opts", [
    ([1], None, True, {}),                        # batch 1: split BV 32 (4 programs per head: the counter)
    ([1] * 8, None, True, {}),                    # chunked (one program per head)
    ([1, 1, 1, 1], [3, -1, 7, 0], True, {"BV": 64}),
    ([4, 4], None, False, {}),                    # verify, several tokens
    ([4, 4], None, False, {"chunked": True}),
    ([9, 1, 0, 5], None, True, {}),               # prompt tails beside decodes
])
def test_norm_epilogue_gpu(lens, slots, update, opts):
    """Fused vs the Triton composition within 1 bf16 ulp (the reported share bit-identical), vs the reference
    composition within 1e-2; pools identical to the plain launch's."""
    import tokenspeed.ops.triton.norm as tnorm
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D = 32, 128
    inp = make(lens, H, D, torch.bfloat16, "cuda", slots=slots)
    T = sum(lens)
    nrm = {k: (v.to("cuda", torch.bfloat16) if k == "norm_gate" else v.to("cuda") if torch.is_tensor(v) else v)
           for k, v in norm_args(T, H, D).items()}
    a, p, r = clone(inp), clone(inp), clone(inp)
    kw = {"lower_bound": LOWER, "scale": D ** -0.5, "update_state": update, **opts}
    o = kda_decode(**a, **nrm, **kw)
    o_comp = tnorm.gated_rms_norm(kda_decode(**p, **kw), nrm["norm_gate"].view(T, H, D), nrm["norm_weight"], EPS)
    o_ref = _kda_decode_reference(**r, lower_bound=LOWER, scale=D ** -0.5, update_state=update, step_states=None)
    o_ref = gated_rms_norm_ref(o_ref, nrm["norm_gate"].view(T, H, D), nrm["norm_weight"], EPS)
    ulp = ulp_distance_bf16(o, o_comp)
    print(f"bit-identical {(ulp == 0).float().mean().item():.4%}, max ulp {ulp.max().item()}")
    assert ulp.max().item() <= 1
    assert rel_err(o, o_ref) < 1e-2
    assert torch.equal(a["state"], p["state"]) and torch.equal(a["conv_state"], p["conv_state"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lens", [[1], [1] * 8])
def test_pdl_after_producer_graph_gpu(lens, monkeypatch):
    """A CUDA graph of two PDL GEMVs (f, then the merged q|k|v|gate|b projection) and the fused decode with its
    norm epilogue: replays on fresh inputs give the same bits as the same launches with TOKENSPEED_PDL=0 (a read
    of the projection or of the lengths before the PDL wait would see the previous replay's values)."""
    from tokenspeed.ops.triton.gemv import gemv
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D, K = 32, 128, 256
    T = sum(lens)
    C = 3 * H * D
    g = torch.Generator(device="cpu").manual_seed(5)
    w_merged = (torch.randn(C + H * D + H, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    w_f = (torch.randn(H * D, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    base = make(lens, H, D, torch.bfloat16, "cuda")
    nrm_w = norm_args(T, H, D)["norm_weight"].cuda()
    x = torch.zeros(T, K, dtype=torch.bfloat16, device="cuda")

    def step(pools):
        f = gemv(x, w_f)
        y = gemv(x, w_merged)
        return kda_decode(y[:, :C], f, y[:, C + H * D:], base["conv_weight"], pools["conv_state"], base["A_log"],
                          base["dt_bias"], pools["state"], base["state_indices"], base["cu_seqlens"],
                          lower_bound=LOWER, scale=D ** -0.5, norm_gate=y[:, C:C + H * D], norm_weight=nrm_w,
                          norm_eps=EPS)

    xs = [torch.randn(T, K, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    monkeypatch.setenv("TOKENSPEED_PDL", "0")
    eager = {"state": base["state"].clone(), "conv_state": base["conv_state"].clone()}
    want = []
    for xi in xs:
        x.copy_(xi)
        want.append(step(eager).clone())
    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    pools = {"state": base["state"].clone(), "conv_state": base["conv_state"].clone()}
    warm = {"state": base["state"].clone(), "conv_state": base["conv_state"].clone()}
    step(warm)  # compile, counters and semaphores outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(pools)
    pools["state"].copy_(base["state"])
    pools["conv_state"].copy_(base["conv_state"])
    for xi, w in zip(xs, want):
        x.copy_(xi)
        graph.replay()
        assert torch.equal(out, w)
    assert torch.equal(pools["state"], eager["state"]) and torch.equal(pools["conv_state"], eager["conv_state"])
