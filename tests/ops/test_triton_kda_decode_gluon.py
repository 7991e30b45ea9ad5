"""The Gluon KDA decode (`tokenspeed/ops/triton/kda_decode_gluon.py`, `KdaConfig(gluon=True)`) against the
composition of reference ops and against the Triton chunked decode it stands beside.

On the GPU (sm_90): one decode step of bf16 inputs read from a merged projection (qkv and b strided, NaN columns
around them), [V, K] state pools, 12 (K3's TP8 rank), 32 and 96 heads, with and without the fused gated norm, both
gate forms, padding rows (slot -1), several state-buffer depths (the whole head, rings of 2 and 4 tiles) and tile
widths; outputs NaN-poisoned (every element written), idle pool slots NaN-poisoned and untouched, nothing written
past any tensor's end; the conv state bit-identical to the reference's, outputs and state within 1e-2 of it and
of the Triton kernel's; a CUDA graph with PDL after a producer kernel, replayed on fresh inputs, equal to eager
launches without PDL. On the CPU: the config's label, and its fallback (the Triton form of the same config, bit
for bit) wherever the Gluon kernel cannot run, with the reason it gives.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import clone, composed, make, poison_idle, tailed, tails_intact, \
    transposed_pool
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed.ops.reference.norm import gated_rms_norm as gated_rms_norm_ref
from tokenspeed.ops.triton.kda_config import KdaConfig, config_from_label

EPS = 1e-6
# (block_v, buffers): the whole head (None), rings of 4 and 2 tiles, 4 KB tiles
GLUON_CASES = [(16, None), (8, None), (32, None), (16, 4), (8, 4), (32, 2)]


def gluon_runs(monkeypatch) -> list:
    """Records each launch of the Gluon kernel (so a test knows it did not fall back)."""
    from tokenspeed.ops.triton import kda_decode_gluon

    calls = []
    real = kda_decode_gluon.launch
    monkeypatch.setattr(kda_decode_gluon, "launch", lambda *a, **k: calls.append(k["block_v"]) or real(*a, **k))
    return calls


def norm_inputs(T: int, H: int, D: int, device: str, dtype: torch.dtype) -> dict:
    """A gate that is a column view of a wider projection (NaN around it) and a NaN-tailed weight."""
    g = torch.Generator().manual_seed(11)
    wide = torch.full((T, H * D + 9), float("nan"))
    wide[:, 4:4 + H * D] = torch.randn(T, H * D, generator=g) * 2
    return {"norm_gate": wide[:, 4:4 + H * D].to(device, dtype),
            "norm_weight": tailed(torch.randn(D, generator=g).to(device)), "norm_eps": EPS}


def run(inp: dict, lower_bound, config: KdaConfig, norm: dict | None):
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D = inp["dt_bias"].shape
    T = inp["qkv"].shape[0]
    out = tailed(torch.full((T, H, D), float("nan"), dtype=inp["qkv"].dtype, device=inp["qkv"].device))
    y = kda_decode(**inp, lower_bound=lower_bound, scale=D ** -0.5, config=config, out=out, state_v_first=True,
                   max_seq_tokens=1, **(norm or {}))
    assert y is out and tails_intact(out, inp["state"], inp["conv_state"])
    return y


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("BV,buffers", GLUON_CASES)
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("fused_norm", [True, False], ids=["norm", "plain"])
@pytest.mark.parametrize("H,slots", [(32, [5, -1, 0, 9, 2, -1, 7]), (96, [3, 1]), (12, [4, 0, -1, 6, 1, 8]),
                                     (96, [4])])  # one sequence, in the last of 5 slots
def test_gluon_decode_gpu(BV, buffers, lower_bound, fused_norm, H, slots, monkeypatch):
    D = 128
    calls = gluon_runs(monkeypatch)
    inp = make([1] * len(slots), H, D, torch.bfloat16, "cuda", slots=slots)
    used, idle = poison_idle(inp)
    norm = norm_inputs(len(slots), H, D, "cuda", torch.bfloat16) if fused_norm else None
    cfg = KdaConfig(BV, chunked=True, num_stages=buffers, gluon=True)
    g, t, r = transposed_pool(inp), transposed_pool(inp), clone(inp)
    o = run(g, lower_bound, cfg, norm)
    assert calls == [BV]
    o_tri = run(t, lower_bound, cfg._replace(gluon=False, num_stages=3), norm)
    o_ref = composed(r, lower_bound, D ** -0.5)
    if norm is not None:
        o_ref = gated_rms_norm_ref(o_ref, norm["norm_gate"].view(-1, H, D), norm["norm_weight"], EPS)
    live = [n for n, s in enumerate(slots) if s >= 0]
    pad = [n for n, s in enumerate(slots) if s < 0]
    assert rel_err(o[live], o_ref[live]) < 1e-2 and rel_err(o, o_tri) < 1e-2
    assert not o[pad].any()  # padding rows: zeros, as the Triton kernel writes them
    u = sorted(used)
    assert rel_err(g["state"][u].transpose(-1, -2), r["state"][u]) < 1e-2
    assert rel_err(g["state"][u], t["state"][u]) < 1e-5
    assert torch.equal(g["conv_state"][u], r["conv_state"][u])
    assert g["state"][idle].isnan().all() and g["conv_state"][idle].isnan().all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("BV,buffers", [(16, None), (8, 4)])
def test_gluon_decode_pdl_graph_gpu(BV, buffers, monkeypatch):
    """A CUDA graph of a PDL GEMV (the merged q|k|v|gate|b|f projection) and the Gluon decode with its norm:
    replays on fresh inputs give the bits of the same launches run eagerly with TOKENSPEED_PDL=0 (a read of the
    projection before the PDL wait would see the previous replay's values); the pools advance alike."""
    from tokenspeed.ops.triton.gemv import gemv
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D, K, N = 32, 128, 256, 8
    C = 3 * H * D
    calls = gluon_runs(monkeypatch)
    gen = torch.Generator(device="cpu").manual_seed(5)
    w = (torch.randn(C + 2 * H * D + H, K, generator=gen) * K ** -0.5).to("cuda", torch.bfloat16)
    base = transposed_pool(make([1] * N, H, D, torch.bfloat16, "cuda"))
    nrm_w = torch.randn(D, generator=gen).cuda()
    x = torch.zeros(N, K, dtype=torch.bfloat16, device="cuda")
    cfg = KdaConfig(BV, chunked=True, num_stages=buffers, gluon=True)

    def step(pools):
        y = gemv(x, w)
        return kda_decode(y[:, :C], y[:, C + H * D:C + 2 * H * D], y[:, C + 2 * H * D:], base["conv_weight"],
                          pools["conv_state"], base["A_log"], base["dt_bias"], pools["state"],
                          base["state_indices"], base["cu_seqlens"], lower_bound=-5.0, scale=D ** -0.5,
                          norm_gate=y[:, C:C + H * D], norm_weight=nrm_w, norm_eps=EPS, config=cfg,
                          state_v_first=True, max_seq_tokens=1)

    xs = [torch.randn(N, K, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
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
    for xi, want_o in zip(xs, want):
        x.copy_(xi)
        graph.replay()
        assert torch.equal(out, want_o)
    assert torch.equal(pools["state"], eager["state"]) and torch.equal(pools["conv_state"], eager["conv_state"])
    assert len(calls) == 5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("BV,buffers", [(32, None), (16, None), (32, 2)])
@pytest.mark.parametrize("gate_low_rank", [True, False], ids=["f+gate", "f"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("slots", [[4], [3, -1, 0]])  # [4]: the last of make's 5 slots, by its NaN tail
def test_gluon_decode_low_rank_gpu(BV, buffers, gate_low_rank, lower_bound, slots, monkeypatch):
    """The low-rank gates' up projections inside the Gluon decode (`kda_decode(f_low_rank=, gate_low_rank=)`, the
    batch-1 model's inputs: f_a / g_a column views of a wider projection, NaN-tailed up weights): within 1e-2 of the
    Gluon decode given f and the gate from one matmul first, and of the reference composition; the state within
    1e-2, the conv state bit-identical; idle slots untouched."""
    from tests.ops.test_triton_kda_low_rank import low_rank_args

    H, D, R = 32, 128, 128
    calls = []
    from tokenspeed.ops.triton import kda_decode_gluon

    real = kda_decode_gluon.launch
    monkeypatch.setattr(kda_decode_gluon, "launch",
                        lambda *a, **k: calls.append((k["f_up"] is not None, k["gate_low_rank"] is not None))
                        or real(*a, **k))
    T = len(slots)
    inp = make([1] * T, H, D, torch.bfloat16, "cuda", slots=slots)
    used, idle = poison_idle(inp)
    lr = low_rank_args(T, H, D, R, "cuda", torch.bfloat16)
    (fa, fw), (ga, gw) = lr["f_low_rank"], lr["gate_low_rank"]
    f_full, g_full = (fa @ fw.t()).view(T, H, D), (ga @ gw.t()).view(T, H, D)
    cfg = KdaConfig(BV, chunked=True, num_stages=buffers, gluon=True)
    norm_w = {"norm_weight": lr["norm_weight"], "norm_eps": EPS}
    fused, plain, r = transposed_pool(inp), transposed_pool(inp), clone(inp)
    g_in = {"gate_low_rank": (ga, gw)} if gate_low_rank else {"norm_gate": g_full}
    o = run({k: v for k, v in fused.items() if k != "f"} | {"f": None}, lower_bound, cfg,
            {"f_low_rank": (fa, fw), **g_in, **norm_w})
    assert calls == [(True, gate_low_rank)]
    o_plain = run(plain | {"f": f_full}, lower_bound, cfg, {"norm_gate": g_full, **norm_w})
    r["f"] = f_full
    o_ref = gated_rms_norm_ref(composed(r, lower_bound, D ** -0.5), g_full, lr["norm_weight"], EPS)
    live = [n for n, s in enumerate(slots) if s >= 0]
    assert rel_err(o, o_plain) < 1e-2 and rel_err(o[live], o_ref[live]) < 1e-2
    u = sorted(used)
    assert rel_err(fused["state"][u], plain["state"][u]) < 1e-2
    assert torch.equal(fused["conv_state"][u], plain["conv_state"][u])
    assert fused["state"][idle].isnan().all() and fused["conv_state"][idle].isnan().all()


@cpu_interp
def test_gluon_low_rank_config_falls_back_interp():
    """Off sm_90 a gluon config given the low-rank gate inputs runs the Triton chunked decode, which fuses them
    itself: bit for bit the config without the flag."""
    from tests.ops.test_triton_kda_low_rank import low_rank_args

    D = 32
    inp = make([1, 1, 1], 2, D, torch.float32, "cpu", slots=[4, -1, 1])
    lr = low_rank_args(3, 2, D, 16, "cpu", torch.float32)
    cfg = KdaConfig(8, chunked=True, num_stages=2, gluon=True)
    a, b = transposed_pool(inp), transposed_pool(inp)
    extra = {"f_low_rank": lr["f_low_rank"], "gate_low_rank": lr["gate_low_rank"], "norm_weight": lr["norm_weight"],
             "norm_eps": EPS}
    o = run(a | {"f": None}, -5.0, cfg, extra)
    o_plain = run(b | {"f": None}, -5.0, cfg._replace(gluon=False), extra)
    assert torch.equal(o, o_plain) and torch.equal(a["state"], b["state"])


def test_gluon_config_label():
    cfg = KdaConfig(16, chunked=True, num_stages=8, gluon=True)
    assert cfg.label == "bv16-chunked-w4-s8-gl" and config_from_label(cfg.label) == cfg
    assert config_from_label("bv8-chunked-w4-gl") == KdaConfig(8, chunked=True, gluon=True)


def test_gluon_table_and_switch(monkeypatch):
    """Decode launches from GLUON_DECODE_TABLE's first bound take its rows; TOKENSPEED_KDA_GLUON=0 (and
    gluon=False, a launch the kernel cannot run) DECODE_TABLE's; a forced label keeps its flag unless gluon=False."""
    from tokenspeed.ops.triton.kda_config import DECODE_ENV, DECODE_TABLE, GLUON_DECODE_TABLE, GLUON_ENV, \
        default_config

    first = GLUON_DECODE_TABLE[0][0]
    assert not default_config(first - 1, 128).gluon and default_config(first, 128).gluon
    assert default_config(6144, 128) == GLUON_DECODE_TABLE[-1][1]
    monkeypatch.setenv(GLUON_ENV, "0")
    assert default_config(6144, 128) == DECODE_TABLE[-1][1] == default_config(6144, 128, gluon=False)
    monkeypatch.setenv(DECODE_ENV, "bv16-chunked-w4-s4-gl")
    assert default_config(64, 128).gluon and not default_config(64, 128, gluon=False).gluon


@cpu_interp
@pytest.mark.parametrize("buffers", [None, 2])
def test_gluon_config_falls_back_to_its_triton_form_interp(buffers):
    """Off sm_90 (here: the interpreter) a gluon config runs its Triton form: the same bits as without the flag."""
    D = 32
    inp = make([1, 1, 1], 2, D, torch.float32, "cpu", slots=[4, -1, 1])
    cfg = KdaConfig(8, chunked=True, num_stages=buffers, gluon=True)
    a, b = transposed_pool(inp), transposed_pool(inp)
    o = run(a, -5.0, cfg, None)
    o_plain = run(b, -5.0, cfg._replace(gluon=False), None)
    assert torch.equal(o, o_plain) and torch.equal(a["state"], b["state"])
    assert torch.equal(a["conv_state"], b["conv_state"])


def test_gluon_unusable_reasons():
    from tokenspeed.ops.triton import kda_decode_gluon as kg

    qkv, state = torch.zeros(2, 3 * 128), torch.zeros(4, 1, 128, 128)
    call = {"T": 2, "N": 2, "update_state": True, "step_states": None, "seq_lens": None, "max_seq_tokens": 1,
            "state_v_first": True}
    assert "sm_90" in kg.unusable_reason(qkv, state, 128, 16, 8, 4, **call)
    assert kg.smem_bytes(128, 16, 8) == (8 * 16 * 128 + 256) * 4
    with pytest.raises(ValueError, match="chunked schedule"):
        from tokenspeed.ops.triton.kda_decode import kda_decode

        kda_decode(**make([1], 1, 32, torch.float32, "cpu"), lower_bound=-5.0, scale=1.0,
                   config=KdaConfig(16, gluon=True))


@cpu_interp
def test_model_decode_calls_are_the_gluon_kernels(monkeypatch):
    """The calls the model's KDA layer makes (TOKENSPEED_OPS=triton, interpreter): its decode steps pass what the
    Gluon kernel needs (one token per sequence, bounded by max_seq_tokens=1, [V, K] pools, the pools advanced), its
    verify windows do not, so on an sm_90 GPU the model's decode launches from GLUON_DECODE_TABLE's first bound are
    the Gluon kernel's (only the device and the tensors' checks are left)."""
    from tokenspeed.models import CacheBuffers, ForwardBatch, load_model
    from tokenspeed.ops.triton import kda_decode as mod
    from tokenspeed.ops.triton import kda_decode_gluon as kg

    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=4)
    attn = model.model.layers[model.config.kda_layers[0]].self_attn
    reasons = []
    real = mod.kda_decode

    def spy(qkv, f, b, conv_weight, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens, **k):
        reasons.append(kg.call_unusable_reason(
            T=qkv.shape[0], N=state_indices.numel(), update_state=k.get("update_state", True),
            step_states=k.get("step_states"), seq_lens=k.get("seq_lens"), max_seq_tokens=k.get("max_seq_tokens"),
            state_v_first=k.get("state_v_first", False)))
        return real(qkv, f, b, conv_weight, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens, **k)

    monkeypatch.setattr(mod, "kda_decode", spy)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    cache = CacheBuffers.allocate(model.config, 8, 16, 4, torch.float32)
    for ids, cached, verify in (([[1, 2, 3], [4, 5]], [0, 0], False), ([[8], [9]], [3, 2], False),
                                ([[8, 1, 2], [9, 3, 4]], [4, 3], True)):
        batch = ForwardBatch.build(ids, cached, [[1], [3]], [1, 3], 16, verify=verify)
        with torch.no_grad():
            attn(torch.randn(sum(map(len, ids)), model.config.hidden_size), batch, cache)
    assert reasons[0] is None and reasons[1] is not None, reasons  # the decode step; the verify window
    assert len(reasons) == 2  # (the prompt went through the chunked scan)

