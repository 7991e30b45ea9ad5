"""Fused KDA decode / verify kernel against the composition of reference ops it replaces:

    causal_conv1d(qkv) -> split q, k, v -> l2_normalize(q), l2_normalize(k); kda_gate(f); sigmoid(b)
    -> kda_recurrent from state[state_indices] -> state[state_indices] = final

Checked: outputs, the recurrent-state pool and the conv-state pool (slots not in the batch untouched), both gate
forms, the V split (and its last-arriver conv-state write), strided qkv / b read from a merged projection,
zero-length sequences, padding slots (-1), verify mode with per-token states, and CUDA-graph replay; head dims
that are not powers of two (padded, masked tiles; V split with and without a masked tail); the chunked variant
(one program per head walking its V tiles: `KdaConfig(chunked=True)`) in every mode, and the launch-config table.
Tolerances: fp32 io within 1e-5 (outputs and fp32 state), bf16 io within 1e-2 relative. Outputs start poisoned.
Out-of-bounds guards: the memory just past qkv's columns, f, dt_bias, the conv weight, the pools and the outputs
is NaN, so a stray read shows up as NaN and a stray write as a changed tail (`tails_intact`).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed.ops.reference.conv import causal_conv1d
from tokenspeed.ops.reference.kda import kda_gate, kda_recurrent, l2_normalize


def tailed(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x that is the head of a buffer twice its size, the rest NaN (see `tails_intact`)."""
    buf = torch.full((2 * x.numel(),), float("nan"), dtype=x.dtype, device=x.device)
    buf[: x.numel()] = x.reshape(-1)
    return buf[: x.numel()].view(x.shape)


def tails_intact(*xs: torch.Tensor) -> bool:
    """True when the NaN tail of every `tailed` tensor is still all NaN (nothing was written past its end)."""
    return all(bool(x._base.view(-1)[x.numel():].isnan().all()) for x in xs)


def make(lens, H, D, dtype, device, slots=None, num_slots=None, seed=0):
    """Inputs of one KDA layer step: strided qkv / b slices of a merged projection (the columns right after qkv
    NaN), f a strided slice followed by NaN, pools and dt_bias / conv weight `tailed`, random state."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, N = sum(lens), len(lens)
    S = num_slots or (2 * N + 3)
    perm = torch.randperm(S, generator=g)[:N].tolist()  # drawn always: the same seed gives the same weights
    slots = perm if slots is None else slots
    C = 3 * H * D

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device)

    merged = r(T, C + 2 * D + H + 5).to(dtype)  # [q | k | v | f_a-ish | b | pad] as the merged GEMM writes it
    merged[:, C:C + 2 * D] = float("nan")  # never read: padded lanes past the last head's v must be masked
    f = torch.cat([r(T, H * D), torch.full((T, D), float("nan"), device=device)], 1).to(dtype)[:, :H * D]
    return {
        "qkv": merged[:, :C], "f": f, "b": merged[:, C + 2 * D:C + 2 * D + H],
        "conv_weight": tailed(r(C, 4, s=0.5)), "conv_state": tailed(r(S, C, 3).to(dtype)),
        "A_log": r(H, s=0.5), "dt_bias": tailed(r(H, D, s=0.5)), "state": tailed(r(S, H, D, D, s=0.3)),
        "state_indices": torch.tensor(slots, dtype=torch.int64, device=device),
        "cu_seqlens": torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(device),
    }


def composed(inp, lower_bound, scale):
    """The reference ops in sequence (mutates inp's pools like the fused kernel); padding slots skipped."""
    qkv, slots, cu = inp["qkv"], inp["state_indices"], inp["cu_seqlens"]
    H, D = inp["dt_bias"].shape
    T = qkv.shape[0]
    keep = [n for n, s in enumerate(slots.tolist()) if s >= 0]
    b = cu.tolist()
    tok = torch.cat([torch.arange(b[n], b[n + 1]) for n in keep]).to(qkv.device)
    lens = [b[n + 1] - b[n] for n in keep]
    cu2 = torch.tensor([0] + lens).cumsum(0).to(qkv.device)
    idx = slots[keep]
    mixed = causal_conv1d(qkv[tok], inp["conv_weight"], inp["conv_state"], idx, cu2, activation="silu")
    q, k, v = mixed.view(len(tok), 3, H, D).unbind(1)
    g = kda_gate(inp["f"].view(T, H, D)[tok], inp["A_log"], inp["dt_bias"], lower_bound)
    beta = torch.sigmoid(inp["b"][tok].float())
    o, final = kda_recurrent(l2_normalize(q), l2_normalize(k), v, g, beta, scale=scale,
                             initial_state=inp["state"][idx], cu_seqlens=cu2)
    inp["state"][idx] = final
    out = torch.zeros(T, H, D, dtype=qkv.dtype, device=qkv.device)
    out[tok] = o
    return out


def clone(inp):
    """The inputs with fresh (`tailed`) copies of the two pools, which the kernel mutates."""
    return {k: (tailed(v) if k in ("conv_state", "state") else v) for k, v in inp.items()}


def run_fused(inp, lower_bound, scale, **kw):
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D = inp["dt_bias"].shape
    T = inp["qkv"].shape[0]
    out = tailed(torch.full((T, H, D), float("nan"), dtype=inp["qkv"].dtype, device=inp["qkv"].device))
    y = kda_decode(**inp, lower_bound=lower_bound, scale=scale, out=out, **kw)
    assert y is out
    assert tails_intact(out, inp["state"], inp["conv_state"])
    return y


def check(lens, H, D, dtype, device, lower_bound=-5.0, slots=None, **kw):
    """One fused decode step vs the composition: outputs, both pools; slots outside the batch bit-identical."""
    inp = make(lens, H, D, dtype, device, slots=slots)
    scale = D ** -0.5
    a, r = clone(inp), clone(inp)
    o = run_fused(a, lower_bound, scale, **kw)
    o_ref = composed(r, lower_bound, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    errs = (rel_err(o, o_ref), rel_err(a["state"], r["state"]))
    assert errs[0] < tol and errs[1] < tol, errs
    assert torch.equal(a["conv_state"], r["conv_state"])
    used = {s for s in inp["state_indices"].tolist() if s >= 0}
    idle = [s for s in range(inp["state"].shape[0]) if s not in used]
    assert torch.equal(a["state"][idle], inp["state"][idle])
    return errs


def check_verify(lens, H, D, dtype, device, lower_bound=-5.0, slots=None, **kw):
    """update_state=False: pools untouched; step_states[t] = the state after token t (prefix runs); the
    step_states rows of padding sequences (slot -1) are not written."""
    inp = make(lens, H, D, dtype, device, slots=slots)
    scale = D ** -0.5
    T = sum(lens)
    a = clone(inp)
    steps = tailed(torch.full((T, H, D, D), float("nan"), device=device))
    o = run_fused(a, lower_bound, scale, update_state=False, step_states=steps, **kw)
    assert tails_intact(steps)
    assert torch.equal(a["state"], inp["state"]) and torch.equal(a["conv_state"], inp["conv_state"])
    r = clone(inp)
    o_ref = composed(r, lower_bound, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, o_ref) < tol
    cu = inp["cu_seqlens"].tolist()
    for j in range(max(lens)):  # state after j+1 tokens of every sequence, from a run on the prefixes
        pre = [min(L, j + 1) for L in lens]
        sub = make(lens, H, D, dtype, device, slots=inp["state_indices"].tolist())
        rows = torch.cat([torch.arange(cu[n], cu[n] + pre[n]) for n in range(len(lens))]).to(device)
        sub.update(qkv=inp["qkv"][rows], f=inp["f"][rows], b=inp["b"][rows], conv_state=inp["conv_state"].clone(),
                   state=inp["state"].clone(), cu_seqlens=torch.tensor([0] + pre).cumsum(0).to(device))
        composed(sub, lower_bound, scale)
        for n, L in enumerate(lens):
            slot = inp["state_indices"][n]
            if L > j and slot < 0:
                assert steps[cu[n] + j].isnan().all()
            elif L > j:
                assert rel_err(steps[cu[n] + j], sub["state"][slot]) < tol


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
@cpu_interp
@pytest.mark.parametrize("lower_bound,BV", [(-5.0, None), (None, 8)])  # both gates; whole V and split V
def test_fused_interp(lower_bound, BV):
    check([1, 3, 0, 2], 2, 16, torch.float32, "cpu", lower_bound=lower_bound, BV=BV)


@cpu_interp
def test_fused_interp_padding_slot():
    check([2, 1, 1], 2, 16, torch.float32, "cpu", slots=[4, -1, 0], BV=8)


@cpu_interp
@pytest.mark.parametrize("BV", [None, 8])
def test_fused_interp_long_tails(BV):
    """Prompt tails of tens of tokens beside single decode tokens (the fused path of short CUDA prefills): outputs,
    the recurrent state and the conv state after the last token of each sequence."""
    check([21, 1, 0, 9, 1], 2, 16, torch.float32, "cpu", BV=BV)


@cpu_interp
def test_verify_interp():
    check_verify([3, 1, 2], 1, 16, torch.float32, "cpu")


@cpu_interp
def test_public_op_reference_and_forced_triton(monkeypatch):
    """ops.kda_decode: the reference composition on CPU; TOKENSPEED_OPS=triton runs the kernel (interpreter)."""
    from tokenspeed import ops

    inp = make([2, 1], 2, 16, torch.float32, "cpu")
    outs = []
    for mode in ("reference", "triton"):
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
        x = clone(inp)
        outs.append((ops.kda_decode(**x, lower_bound=-5.0, scale=0.25), x["state"], x["conv_state"]))
    assert rel_err(outs[1][0], outs[0][0]) < 1e-5 and rel_err(outs[1][1], outs[0][1]) < 1e-5
    assert torch.equal(outs[1][2], outs[0][2])


def check_seq_lens(lens, accepted, H, D, dtype, device, mode=None, monkeypatch=None, slots=None, **kw):
    """seq_lens (KDA replay of accepted drafts): the first accepted[n] tokens of each sequence, read in place from
    the full verify rows, advance the pools exactly like a run on just those rows; other output rows are zeros."""
    from tokenspeed import ops

    inp = make(lens, H, D, dtype, device, slots=slots)
    scale = D ** -0.5
    if monkeypatch is not None:
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
    a = clone(inp)
    acc = torch.tensor(accepted, dtype=torch.int64, device=device)
    o = ops.kda_decode(**a, lower_bound=-5.0, scale=scale, seq_lens=acc, **kw)
    cu = inp["cu_seqlens"].tolist()
    used = [min(x, L) for x, L in zip(accepted, lens)]
    rows = torch.cat([torch.arange(cu[n], cu[n] + used[n]) for n in range(len(lens))]).to(device)
    r = clone(inp)
    r.update(qkv=inp["qkv"][rows], f=inp["f"][rows], b=inp["b"][rows],
             cu_seqlens=torch.tensor([0] + used).cumsum(0).to(device))
    o_ref = composed(r, -5.0, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(a["state"], r["state"]) < tol
    assert torch.equal(a["conv_state"], r["conv_state"])
    assert rel_err(o[rows], o_ref) < tol
    skipped = torch.ones(o.shape[0], dtype=torch.bool)
    skipped[rows.cpu()] = False
    assert torch.equal(o[skipped.to(device)], torch.zeros_like(o[skipped.to(device)]))


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_seq_lens_replay_interp(mode, monkeypatch):
    check_seq_lens([4, 4, 4, 2], [0, 4, 2, 5], 2, 16, torch.float32, "cpu", mode=mode, monkeypatch=monkeypatch)


# ----------------------------------------------------------------------------- head dims not a power of two
# (D, BV, lower_bound): D=48 pads K and V to 64 (default BV 64, NV=1), BV 32 leaves a masked tail block (NV=2);
# D=80 pads K to 128 and takes the default BV 16 (NV=5, no tail); D=24 with BV 16 has a tail block of 8 real lanes
# out of 16. (BV 16 for D=48, an even split NV=3, is in the verify test.) One head each: the interpreter is slow.
PAD_CASES = [(48, None, -5.0), (48, 32, None), (80, None, -5.0), (24, 16, None)]


def count_kernel_calls(monkeypatch) -> list:
    """Record every call of the Triton wrapper (to tell the kernel from the reference fallback)."""
    from tokenspeed.ops.triton import kda_decode as mod

    calls: list = []
    real = mod.kda_decode
    monkeypatch.setattr(mod, "kda_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@cpu_interp
@pytest.mark.parametrize("D,BV,lower_bound", PAD_CASES)
def test_pad_decode_interp(D, BV, lower_bound):
    """Decode with padded tiles: several sequences, a zero-length one, a padding row (slot -1); slots outside the
    batch untouched; the V-split counters are back at zero after the launch."""
    from tokenspeed.ops.triton.kda_decode import _counters

    check([1, 2, 0, 1], 1, D, torch.float32, "cpu", lower_bound=lower_bound, slots=[5, 1, 0, -1], BV=BV)
    assert not _counters(torch.device("cpu"), 16)[:16].any()


@cpu_interp
@pytest.mark.parametrize("opts", [{"BV": 32}, {"BV": 16, "chunked": True}], ids=["split", "chunked"])
def test_two_decode_steps_interp(opts):
    """Two launches on the same pools equal two reference steps. Split: the last arriver of the V split leaves the
    counter at zero for the next launch (a stale count would skip the q/k conv-state write of the second step).
    Chunked: the per-token conv-state shift."""
    D, lens, slots = 48, [1, 1, 1], [3, -1, 6]
    scale = D ** -0.5
    inp = make(lens, 1, D, torch.float32, "cpu", slots=slots)
    a, r = clone(inp), clone(inp)
    for step in range(2):
        new = make(lens, 1, D, torch.float32, "cpu", slots=slots, seed=10 + step)
        for key in ("qkv", "f", "b"):
            a[key] = r[key] = new[key]
        o = run_fused(a, -5.0, scale, **opts)
        o_ref = composed(r, -5.0, scale)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(a["state"], r["state"]) < 1e-5
        assert torch.equal(a["conv_state"], r["conv_state"])


@cpu_interp
@pytest.mark.parametrize("D,BV", [(48, 16), (80, 64)])
def test_pad_verify_interp(D, BV):
    check_verify([3, 1, 2], 1, D, torch.float32, "cpu", slots=[4, -1, 0], BV=BV)


@cpu_interp
@pytest.mark.parametrize("D", [48, 80])
def test_pad_seq_lens_replay_interp(D, monkeypatch):
    """Replay (seq_lens) through ops.kda_decode with TOKENSPEED_OPS=triton: dispatch takes the kernel for these
    head dims (no silent reference fallback)."""
    calls = count_kernel_calls(monkeypatch)
    check_seq_lens([3, 3, 3, 2], [0, 3, 2, 5], 1, D, torch.float32, "cpu", mode="triton", monkeypatch=monkeypatch,
                   slots=[2, 7, -1, 0])
    assert calls == [1]


def test_pad_config_and_dispatch_region():
    """Default V blocks for any head dim (power-of-two choices unchanged), BV validation, dispatch region."""
    from tokenspeed.ops import dispatch
    from tokenspeed.ops.triton.kda_decode import default_config, kda_decode

    assert [default_config(8, d)[0] for d in (16, 32, 64, 128)] == [16, 32, 16, 16]  # < 32 pairs: BV 16
    assert [default_config(200, d)[0] for d in (16, 32, 64, 128)] == [16, 32, 32, 32]
    assert [default_config(n, 128).chunked for n in (32, 63, 64, 6144)] == [False, False, True, True]
    assert [default_config(8, d)[0] for d in (24, 48, 80, 96, 100)] == [32, 64, 16, 16, 16]
    assert [default_config(200, d)[0] for d in (48, 80, 96, 192)] == [64, 16, 32, 32]
    inp = make([1], 1, 48, torch.float32, "cpu")
    for bv in (24, 128):
        with pytest.raises(ValueError, match="BV must be a power of two"):
            kda_decode(**inp, lower_bound=-5.0, scale=1.0, BV=bv)
    for d in (16, 24, 48, 80, 96, 128):
        x = make([1], 1, d, torch.float32, "cpu")
        assert dispatch.kda_decode_supported(x["qkv"], x["conv_weight"], x["dt_bias"])


def test_decode_config_labels_and_env(monkeypatch):
    """Every sweep label parses back to its config; TOKENSPEED_KDA_DECODE forces one for decode launches only
    (block_v fitted to the head dim), a bad label is a clear error."""
    from tokenspeed.ops.triton import kda_config as kc

    for cfg in (kc.KdaConfig(32), kc.KdaConfig(128, num_warps=8), kc.KdaConfig(32, chunked=True, num_stages=3),
                kc.KdaConfig(32, chunked=True, num_stages=3, hints=True, prefetch_state=True)):
        assert kc.config_from_label(cfg.label) == cfg
    monkeypatch.setenv(kc.DECODE_ENV, "bv128-split-w8")
    assert kc.default_config(6144, 128) == kc.KdaConfig(128, num_warps=8)
    assert kc.default_config(32, 64) == kc.KdaConfig(64, num_warps=8)  # block_v fitted to head dim 64
    assert kc.default_config(32, 128, tokens_per_seq=4) == kc.MULTI_TABLE[0][1]  # verify keeps its own
    monkeypatch.setenv(kc.DECODE_ENV, "bv128-w8")
    with pytest.raises(ValueError, match="not a KDA decode config label"):
        kc.default_config(32, 128)


# ----------------------------------------------------------------------------- chunked variant (one program per head)
# (D, BV, num_stages): whole tiles (D=16: 2 and 4 tiles), padded K and V with a fully masked last tile (D=48, BV 16:
# 3 real tiles of 4) and a partly masked one (D=48, BV 32), D=80 (BK 128, BV 16: 5 real tiles of 8). The interpreter
# ignores num_stages (the pipelining is a compiled-code transform) but it reaches the tile loop's tl.range.
CHUNK_CASES = [(16, 8, 2), (16, 4, 3), (48, 16, 3), (48, 32, 1), (80, 16, None)]


def poison_idle(inp):
    """NaN in every pool slot outside the batch (and in slot 0 when only a padding row may read it)."""
    used = {s for s in inp["state_indices"].tolist() if s >= 0}
    idle = [s for s in range(inp["state"].shape[0]) if s not in used]
    inp["state"][idle] = float("nan")
    inp["conv_state"][idle] = float("nan")
    return used, idle


@cpu_interp
@pytest.mark.parametrize("D,BV,stages", CHUNK_CASES)
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunked_decode_interp(D, BV, stages, lower_bound):
    """Chunked decode on `check_poisoned_decode`'s batch."""
    from tokenspeed.ops.triton.kda_decode import KdaConfig

    check_poisoned_decode(KdaConfig(BV, chunked=True, num_stages=stages), 1, D, lower_bound)


@cpu_interp
@pytest.mark.parametrize("D,BV,stages", [c for c in CHUNK_CASES if c[2] != 1])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunked_decode_preload_interp(D, BV, stages, lower_bound):
    """Chunked decode with the first tile preloaded before the token inputs (and reloaded after each token of a
    multi-token sequence): `check_poisoned_decode`'s batch, and bit-identical to the plain chunked launch."""
    from tokenspeed.ops.triton.kda_decode import KdaConfig

    cfg = KdaConfig(BV, chunked=True, num_stages=stages, preload=True)
    check_poisoned_decode(cfg, 1, D, lower_bound)
    inp = make([1, 3, 0, 2], 2, D, torch.float32, "cpu", slots=[4, 1, 6, -1])
    a, b = clone(inp), clone(inp)
    o_pl = run_fused(a, lower_bound, D ** -0.5, config=cfg)
    o = run_fused(b, lower_bound, D ** -0.5, config=cfg._replace(preload=False))
    assert torch.equal(o_pl, o) and torch.equal(a["state"], b["state"]) and torch.equal(a["conv_state"],
                                                                                         b["conv_state"])


def check_poisoned_decode(config, H: int, D: int, lower_bound: float | None) -> None:
    """One fp32 decode launch with `config` vs the composition: 1, 3 (several tokens: the state and conv window pass
    between tokens through the pools), 0 and 2 tokens, a padding row; idle slots NaN-poisoned and untouched;
    outputs poisoned (every row written)."""
    lens, slots = [1, 3, 0, 2, 1], [4, 1, 6, -1, 0]
    inp = make(lens, H, D, torch.float32, "cpu", slots=slots)
    _, idle = poison_idle(inp)
    scale = D ** -0.5
    a, r = clone(inp), clone(inp)
    o = run_fused(a, lower_bound, scale, config=config)
    o_ref = composed(r, lower_bound, scale)
    used = [s for s in slots if s >= 0]
    assert rel_err(o, o_ref) < 1e-5 and rel_err(a["state"][used], r["state"][used]) < 1e-5
    assert torch.equal(a["conv_state"][used], r["conv_state"][used])
    assert a["state"][idle].isnan().all() and a["conv_state"][idle].isnan().all()


@cpu_interp
@pytest.mark.parametrize("D,BV", [(16, 8), (48, 16), (48, 32)])
def test_chunked_verify_interp(D, BV):
    """Chunked verify (pools untouched): with per-token step states, and outputs only."""
    check_verify([3, 1, 2], 1, D, torch.float32, "cpu", slots=[4, -1, 0], BV=BV, chunked=True)
    inp = make([2, 3], 1, D, torch.float32, "cpu")
    a, r = clone(inp), clone(inp)
    o = run_fused(a, -5.0, D ** -0.5, update_state=False, BV=BV, chunked=True, num_stages=2)
    assert torch.equal(a["state"], inp["state"]) and torch.equal(a["conv_state"], inp["conv_state"])
    assert rel_err(o, composed(r, -5.0, D ** -0.5)) < 1e-5


@cpu_interp
@pytest.mark.parametrize("D,BV", [(16, 8), (48, 16)])
def test_chunked_seq_lens_replay_interp(D, BV):
    """seq_lens (replay of accepted drafts, read in place) with the chunked variant vs the reference composition."""
    from tokenspeed.ops import _kda_decode_reference
    from tokenspeed.ops.triton.kda_decode import kda_decode

    inp = make([3, 3, 3, 2], 1, D, torch.float32, "cpu", slots=[2, 7, -1, 0])
    acc = torch.tensor([0, 3, 2, 5])
    a, r = clone(inp), clone(inp)
    o = kda_decode(**a, lower_bound=-5.0, scale=D ** -0.5, seq_lens=acc, BV=BV, chunked=True)
    o_ref = _kda_decode_reference(**r, lower_bound=-5.0, scale=D ** -0.5, update_state=True, step_states=None,
                                  seq_lens=acc)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(a["state"], r["state"]) < 1e-5
    assert torch.equal(a["conv_state"], r["conv_state"])


def test_launch_config_table_and_validation():
    """default_config: the decode table by N * H, the multi-token table for verify / replay / tails (the window loop,
    then WY rows that carry the window for the launches WY cannot run), legacy for head dims < 64; the original
    choice is `legacy_config`; overrides are validated."""
    from tokenspeed.ops.triton.kda_config import GLUON_DECODE_TABLE, MULTI_TABLE, config_from_label
    from tokenspeed.ops.triton.kda_decode import DECODE_TABLE, KdaConfig, default_config, kda_decode, legacy_config

    assert [b for b, _ in DECODE_TABLE] == sorted(b for b, _ in DECODE_TABLE) and DECODE_TABLE[0][0] == 0
    assert [b for b, _ in GLUON_DECODE_TABLE] == sorted(b for b, _ in GLUON_DECODE_TABLE)
    assert all(row.gluon and row.chunked for _, row in GLUON_DECODE_TABLE)
    for nh in (1, 12, 96, 100, 511, 512, 1024, 6144, 10 ** 6):
        want = [row for b, row in DECODE_TABLE if b <= nh][-1]
        assert default_config(nh, 128, gluon=False) == want
        glu = [row for b, row in GLUON_DECODE_TABLE if b <= nh]
        assert default_config(nh, 128) == (glu[-1] if glu else want)
        assert default_config(nh, 128, tokens_per_seq=4) == [row for b, row in MULTI_TABLE if b <= nh][-1]
    assert all(row.window for _, row in MULTI_TABLE) and default_config(6144, 128, 4).wy
    assert default_config(6144, 48) == legacy_config(6144, 48) == KdaConfig(64)
    assert default_config(2048, 80).block_v == 16  # _fit_bv: no masked tail
    assert legacy_config(12, 128) == KdaConfig(32) and legacy_config(6144, 128) == KdaConfig(64)
    assert KdaConfig(32, chunked=True, num_stages=3).label == "bv32-chunked-w4-s3"
    assert KdaConfig(64, hints=True).label == "bv64-split-w4-hints"
    part = KdaConfig(8, chunked=True, num_stages=4, prefetch_state=True, prefetch_tiles=4)
    assert part.label == "bv8-chunked-w4-s4-pf4" and config_from_label(part.label) == part
    whole = KdaConfig(32, chunked=True, num_stages=3, prefetch_state=True)
    assert whole.label == "bv32-chunked-w4-s3-pf" and config_from_label(whole.label) == whole
    capped = KdaConfig(16, chunked=True, num_stages=4, max_regs=64)
    assert capped.label == "bv16-chunked-w4-s4-r64" and config_from_label(capped.label) == capped
    pre = KdaConfig(16, chunked=True, num_stages=4, preload=True)
    assert pre.label == "bv16-chunked-w4-s4-pl" and config_from_label(pre.label) == pre
    inp = make([1], 1, 48, torch.float32, "cpu")
    bad = [({"BV": 24}, "BV must be"), ({"BV": 128}, "BV must be"), ({"num_warps": 3}, "num_warps"),
           ({"num_stages": 0}, "num_stages"), ({"config": KdaConfig(16, num_stages=9)}, "num_stages"),
           ({"config": KdaConfig(16, max_regs=60)}, "max_regs"),
           ({"config": KdaConfig(16, preload=True)}, "preload"),
           ({"config": KdaConfig(16, chunked=True, num_stages=1, preload=True)}, "preload")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            kda_decode(**inp, lower_bound=-5.0, scale=1.0, **kw)


# ----------------------------------------------------------------------------- CUDA
K3_TP8 = {"H": 12, "D": 128}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("lens", [[1], [1] * 7, [1] * 64, [4] * 5, [1, 3, 0, 2, 5, 1, 4], [256, 1, 1, 160]])
def test_fused_k3_tp8_gpu(lens, lower_bound, dtype):
    check(lens, K3_TP8["H"], K3_TP8["D"], dtype, "cuda", lower_bound=lower_bound)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [(32, False, 4, None), (64, False, 4, None), (128, False, 8, None),
                                 (128, False, 16, None), (32, True, 4, 3), (16, True, 4, 3), (16, True, 4, 4),
                                 (64, True, 4, 2), (32, True, 2, 3), (32, True, 4, 1)])
@pytest.mark.parametrize("lens", [[1] * 3, [2, 1, 4]])
def test_fused_configs_gpu(lens, cfg):
    from tokenspeed.ops.triton.kda_decode import KdaConfig

    check(lens, 12, 128, torch.bfloat16, "cuda", config=KdaConfig(*cfg))
    check_verify(lens, 12, 128, torch.bfloat16, "cuda", config=KdaConfig(*cfg))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("chunked", [None, True])
def test_fused_96_heads_and_padding_gpu(chunked):
    check([1, 1, 1, 1], 96, 128, torch.bfloat16, "cuda", slots=[3, -1, 7, 0], chunked=chunked)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verify_gpu(dtype):
    check_verify([4, 2, 3], 12, 128, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("BV,chunked", [(None, None), (64, None), (128, None), (32, True), (16, True)])
def test_cuda_graph_replay_gpu(BV, chunked):
    """Captured once, replayed on new inputs: two decode steps equal two reference steps."""
    from tokenspeed.ops.triton.kda_decode import kda_decode

    lens, H, D = [1] * 3, 12, 128
    inp = make(lens, H, D, torch.bfloat16, "cuda")
    static = clone(inp)
    static["qkv"] = inp["qkv"].clone()
    static["f"], static["b"] = inp["f"].clone(), inp["b"].clone()
    warm = clone(inp)
    kda_decode(**warm, lower_bound=-5.0, scale=D ** -0.5, BV=BV, chunked=chunked)  # compile + counters, outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_decode(**static, lower_bound=-5.0, scale=D ** -0.5, BV=BV, chunked=chunked)
    static["state"].copy_(inp["state"])
    static["conv_state"].copy_(inp["conv_state"])
    ref = clone(inp)
    for step in range(2):
        new = make(lens, H, D, torch.bfloat16, "cuda", seed=10 + step)
        for key in ("qkv", "f", "b"):
            static[key].copy_(new[key])
            ref[key] = new[key]
        out.fill_(float("nan"))
        graph.replay()
        o_ref = composed(ref, -5.0, D ** -0.5)
        assert rel_err(out, o_ref) < 1e-2
        assert rel_err(static["state"], ref["state"]) < 1e-2
        assert torch.equal(static["conv_state"], ref["conv_state"])


@pytest.mark.gpu
@needs_cuda
def test_dispatch_cuda_gpu(monkeypatch):
    """ops.kda_decode on CUDA tensors runs the kernel; TOKENSPEED_OPS=reference runs the composition."""
    from tokenspeed import ops
    from tokenspeed.ops.triton import kda_decode as mod

    calls = []
    real = mod.kda_decode
    monkeypatch.setattr(mod, "kda_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    inp = make([1, 2], 12, 128, torch.bfloat16, "cuda")
    a, r = clone(inp), clone(inp)
    o = ops.kda_decode(**a, lower_bound=-5.0, scale=128 ** -0.5)
    assert calls == [1]
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    o_ref = ops.kda_decode(**r, lower_bound=-5.0, scale=128 ** -0.5)
    assert calls == [1]
    assert rel_err(o, o_ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_seq_lens_replay_gpu():
    check_seq_lens([4] * 9, [0, 1, 2, 3, 4, 4, 2, 7, 1], **K3_TP8, dtype=torch.bfloat16, device="cuda")


def transposed_pool(inp):
    """`clone(inp)` with the recurrent-state pool held [V, K] per head (`kda_decode(state_v_first=True)`)."""
    out = clone(inp)
    out["state"] = tailed(inp["state"].transpose(-1, -2).contiguous())
    return out


@cpu_interp
@pytest.mark.parametrize("opts", [{"BV": 8}, {"BV": 8, "chunked": True, "num_stages": 2},
                                  {"BV": 16, "chunked": True, "num_stages": 1},
                                  {"config": "bv8-chunked-w4-s2-pl"}], ids=["split", "chunked", "chunked-s1", "preload"])
@pytest.mark.parametrize("update", [True, False], ids=["decode", "verify"])
def test_state_v_first_matches_kv_layout_interp(opts, update):
    """A [V, K] state pool gives the [K, V] pool's outputs, new state (transposed) and per-token verify states,
    padding slots and idle slots included: the layout moves addresses, not arithmetic."""
    if "config" in opts:
        from tokenspeed.ops.triton.kda_config import config_from_label

        opts = {"config": config_from_label(opts["config"])}
    lens = [1, 1, 1] if update else [3, 2, 1]
    inp = make(lens, 2, 32, torch.float32, "cpu", slots=[4, -1, 1])
    T = sum(lens)
    steps_kv, steps_vk = ((None, None) if update else
                          (torch.full((T, 2, 32, 32), float("nan")), torch.full((T, 2, 32, 32), float("nan"))))
    kv, vk = clone(inp), transposed_pool(inp)
    o_kv = run_fused(kv, -5.0, 32 ** -0.5, update_state=update, step_states=steps_kv, **opts)
    o_vk = run_fused(vk, -5.0, 32 ** -0.5, update_state=update, step_states=steps_vk, state_v_first=True, **opts)
    assert torch.equal(o_vk, o_kv)
    assert torch.equal(vk["state"].transpose(-1, -2), kv["state"])
    assert torch.equal(vk["conv_state"], kv["conv_state"])
    if not update:
        assert torch.equal(steps_vk.transpose(-1, -2).nan_to_num(7.0), steps_kv.nan_to_num(7.0))


@cpu_interp
@pytest.mark.parametrize("D,BV,lower_bound", [(32, 8, -5.0), (48, 16, None)])  # split V; a padded head dim
@pytest.mark.parametrize("mode", ["commit", "verify", "seq_lens", "norm"])
def test_window_loop_is_bit_identical_interp(D, BV, lower_bound, mode):
    """`KdaConfig(window=True)` (conv window in registers, next token's inputs loaded ahead) gives the plain loop's
    outputs, pools and per-token states bit for bit: several tokens per sequence, a padding slot, a one-token
    sequence, a zero-length one, seq_lens past and below the window, the fused norm; and the composition's."""
    from tokenspeed.ops.triton.kda_decode import KdaConfig

    lens = [3, 1, 0, 4]
    inp = make(lens, 2, D, torch.float32, "cpu", slots=[4, -1, 6, 1])
    T = sum(lens)
    kw = {}
    if mode == "verify":
        kw = {"update_state": False}
    elif mode == "seq_lens":
        kw = {"seq_lens": torch.tensor([2, 1, 0, 9])}
    elif mode == "norm":
        g = torch.Generator().manual_seed(3)
        kw = {"norm_gate": torch.randn(T, 2 * D, generator=g), "norm_weight": torch.randn(D, generator=g)}
    runs = []
    for cfg in (KdaConfig(BV), KdaConfig(BV, window=True)):
        a = clone(inp)
        steps = torch.full((T, 2, D, D), float("nan")) if mode == "verify" else None
        o = run_fused(a, lower_bound, D ** -0.5, config=cfg, step_states=steps, **kw)
        runs.append((o, a["state"], a["conv_state"], steps))
    for x, y in zip(runs[0], runs[1]):
        if x is not None:
            assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
    if mode == "commit":
        check(lens, 2, D, torch.float32, "cpu", lower_bound, slots=[4, -1, 6, 1],
              config=KdaConfig(BV, window=True))


def test_window_config_label_and_refusal():
    from tokenspeed.ops.triton.kda_config import config_from_label
    from tokenspeed.ops.triton.kda_decode import KdaConfig, kda_decode

    cfg = KdaConfig(16, window=True)
    assert cfg.label == "bv16-split-w4-win" and config_from_label(cfg.label) == cfg
    with pytest.raises(ValueError, match="split schedule"):
        kda_decode(**make([2], 1, 32, torch.float32, "cpu"), lower_bound=-5.0, scale=1.0,
                   config=KdaConfig(16, chunked=True, window=True))
