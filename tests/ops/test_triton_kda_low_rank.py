"""The fused KDA decode kernel with the low-rank gates' up projections inside it (`kda_decode(f_low_rank=,
gate_low_rank=)`) against the same kernel given f and the norm gate computed first (the unfused model's two
launches), and against the reference composition.

Checked on the CPU interpreter (fp32): outputs, both pools and the V-split counters, for the split schedule (NV > 1
and NV 1), the chunked schedule, verify launches (several tokens per sequence, pools untouched), padding slots, a
padded head dim, ranks that are and are not multiples of the kernel's 32-wide rank chunk, f only (K3's full-rank
gate) and both; the window loop (no in-kernel projection) takes the matmul fallback and gives the same result; the
public op's reference path; argument errors. The low-rank inputs are column views of a wider projection with NaN on
both sides and the weights are NaN-tailed, so a stray read shows up as NaN; outputs start NaN-poisoned. On the GPU
(bf16): the kimi-linear and K3 TP8 decode shapes within 1e-2 of the unfused launches.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import clone, make, tailed, tails_intact
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed.ops.triton.kda_config import KdaConfig

LOWER = -5.0
EPS = 1e-6


def low_rank_args(T: int, H: int, D: int, R: int, device, dtype, seed: int = 11) -> dict:
    """f_a | g_a as adjacent column views of a wider projection (NaN around them), NaN-tailed [H * D, R] up weights
    and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.full((T, 2 * R + 7), float("nan"))
    wide[:, 3:3 + 2 * R] = torch.randn(T, 2 * R, generator=g)
    wide = wide.to(device, dtype)

    def up():
        return tailed((torch.randn(H * D, R, generator=g) * R ** -0.5).to(device, dtype))

    return {"f_low_rank": (wide[:, 3:3 + R], up()), "gate_low_rank": (wide[:, 3 + R:3 + 2 * R], up()),
            "norm_weight": tailed(torch.randn(D, generator=g).to(device)), "norm_eps": EPS}


def run(inp: dict, update: bool = True, **kw):
    from tokenspeed.ops.triton.kda_decode import kda_decode

    H, D = inp["dt_bias"].shape
    T = inp["qkv"].shape[0]
    out = tailed(torch.full((T, H, D), float("nan"), dtype=inp["qkv"].dtype, device=inp["qkv"].device))
    y = kda_decode(**inp, lower_bound=LOWER, scale=D ** -0.5, update_state=update, out=out, **kw)
    assert y is out and tails_intact(out, inp["state"], inp["conv_state"])
    return y


def check(lens, H, D, R=None, slots=None, update=True, gate=True, device="cpu", dtype=torch.float32, tol=1e-5,
          **kw):
    """Low-rank in the kernel vs the kernel given f (and the gate) from one matmul: outputs and pools."""
    from tokenspeed.ops.triton.kda_decode import _counters

    inp = make(lens, H, D, dtype, device, slots=slots)
    T = sum(lens)
    lr = low_rank_args(T, H, D, R or D, device, dtype)
    f_lr, g_lr = lr["f_low_rank"], lr["gate_low_rank"]
    base = {k: v for k, v in inp.items() if k != "f"}
    norm = {"norm_weight": lr["norm_weight"], "norm_eps": EPS}
    fused, plain = clone(base), clone(inp)
    plain["f"] = (f_lr[0] @ f_lr[1].t()).view(T, H, D)
    g_in = {"gate_low_rank": g_lr} if gate else {"norm_gate": (g_lr[0] @ g_lr[1].t()).view(T, H, D)}
    bound = {"max_seq_tokens": 1} if max(lens) == 1 else {}  # decode: the in-kernel projections; else the matmul
    o = run(fused | {"f": None}, update, f_low_rank=f_lr, **g_in, **norm, **bound, **kw)
    o_plain = run(plain, update, norm_gate=(g_lr[0] @ g_lr[1].t()).view(T, H, D), **norm, **bound, **kw)
    assert rel_err(o, o_plain) < tol
    assert rel_err(fused["state"], plain["state"]) < tol
    assert torch.equal(fused["conv_state"], plain["conv_state"])
    if device == "cpu":
        assert not _counters(torch.device("cpu"), 64)[:64].any()
    return o


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
@cpu_interp
@pytest.mark.parametrize("cfg", [KdaConfig(block_v=8, num_warps=4), KdaConfig(block_v=16, num_warps=4),
                                 KdaConfig(block_v=8, num_warps=4, chunked=True, num_stages=2)],
                         ids=["split-nv2", "split-nv1", "chunked"])
@pytest.mark.parametrize("R", [16, 40])
def test_decode_interp(cfg, R):
    check([1, 1, 1], 2, 16, R=R, slots=[3, -1, 0], config=cfg)
    check([1, 0, 1], 2, 16, R=R, config=cfg)  # a zero-length sequence (T < N): the matmul fallback


@cpu_interp
@pytest.mark.parametrize("chunked", [False, True])
def test_f_only_and_padded_head_interp(chunked):
    """K3's full-rank gate: only f is low-rank (the norm gate is given); a head dim of 48 (padded to 64)."""
    cfg = KdaConfig(block_v=16, num_warps=4, chunked=chunked, num_stages=2 if chunked else None)
    check([1, 1], 2, 48, R=32, gate=False, config=cfg)


@cpu_interp
@pytest.mark.parametrize("chunked", [False, True])
def test_verify_falls_back_interp(chunked):
    """Several tokens per sequence (verify, pools untouched): the projections come from one matmul first."""
    cfg = KdaConfig(block_v=8, num_warps=4, chunked=chunked)
    check([3, 0, 2], 2, 16, R=24, update=False, config=cfg)


@cpu_interp
def test_window_loop_falls_back_interp():
    """The window loop computes no up projection in the kernel: f and the gate come from one matmul first."""
    check([3, 2], 2, 16, R=16, update=False, config=KdaConfig(block_v=8, num_warps=4, window=True))


@cpu_interp
def test_public_op_reference_and_triton(monkeypatch):
    """`ops.kda_decode` with the low-rank inputs: the reference (compose the projections) and the Triton path
    (forced into the interpreter) agree with the reference given f and the gate."""
    from tokenspeed import ops

    inp = make([1, 1], 2, 16, torch.float32, "cpu")
    lr = low_rank_args(2, 2, 16, 16, "cpu", torch.float32)
    f_lr, g_lr = lr["f_low_rank"], lr["gate_low_rank"]
    base = {k: v for k, v in inp.items() if k != "f"}
    kw = {"lower_bound": LOWER, "scale": 0.25, "norm_weight": lr["norm_weight"], "norm_eps": EPS, "max_seq_tokens": 1}
    ref = clone(inp)
    ref["f"] = f_lr[0] @ f_lr[1].t()
    o_ref = ops.kda_decode(**ref, norm_gate=g_lr[0] @ g_lr[1].t(), **kw)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    a = clone(base)
    o_a = ops.kda_decode(**a, f=None, f_low_rank=f_lr, gate_low_rank=g_lr, **kw)
    assert torch.equal(o_a, o_ref) and torch.equal(a["state"], ref["state"])
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    b = clone(base)
    o_b = ops.kda_decode(**b, f=None, f_low_rank=f_lr, gate_low_rank=g_lr, **kw)
    assert rel_err(o_b, o_ref) < 1e-5 and rel_err(b["state"], ref["state"]) < 1e-5


@cpu_interp
def test_argument_errors():
    from tokenspeed import ops

    inp = make([1], 2, 16, torch.float32, "cpu")
    lr = low_rank_args(1, 2, 16, 16, "cpu", torch.float32)
    kw = {"lower_bound": LOWER, "scale": 0.25}
    with pytest.raises(ValueError, match="exactly one"):
        ops.kda_decode(**clone(inp), f_low_rank=lr["f_low_rank"], **kw)
    base = {k: v for k, v in clone(inp).items() if k != "f"}
    with pytest.raises(ValueError, match="needs norm_weight"):
        ops.kda_decode(**base, f=None, f_low_rank=lr["f_low_rank"], gate_low_rank=lr["gate_low_rank"], **kw)
    from tokenspeed.ops.triton.kda_decode import kda_decode

    a, w = lr["f_low_rank"]
    with pytest.raises(ValueError, match="up weight"):
        kda_decode(**base, f=None, f_low_rank=(a, w[:16]), **kw)
    with pytest.raises(ValueError, match="low-rank input"):
        kda_decode(**base, f=None, f_low_rank=(a[:, :8], w), **kw)


def test_fusion_policy(monkeypatch):
    """`ops.kda_fuses_gate_projections`: small decode batches on the Triton path, never on the CPU reference path,
    and the env override both ways (read per call)."""
    from tokenspeed import ops

    x = torch.zeros(1, 4)
    monkeypatch.delenv(ops.KDA_FUSED_GATES_ENV, raising=False)
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    assert not ops.kda_fuses_gate_projections(x, 32)
    monkeypatch.setenv(ops.KDA_FUSED_GATES_ENV, "1")
    assert ops.kda_fuses_gate_projections(x, 10 ** 6)
    monkeypatch.setenv(ops.KDA_FUSED_GATES_ENV, "0")
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    assert not ops.kda_fuses_gate_projections(x, 1)
    monkeypatch.delenv(ops.KDA_FUSED_GATES_ENV)
    if ops._dispatch.triton_available():
        assert ops.kda_fuses_gate_projections(x, ops.KDA_FUSED_GATES_MAX_PAIRS)
        assert not ops.kda_fuses_gate_projections(x, ops.KDA_FUSED_GATES_MAX_PAIRS + 1)


# ----------------------------------------------------------------------------- GPU (bf16)
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("H,lens,gate", [(32, [1], True), (32, [1] * 4, True), (32, [1] * 2 + [0], True),
                                         (12, [1], False), (12, [1] * 10, False), (32, [3, 1], True)],
                         ids=["kimi-b1", "kimi-b4", "kimi-pad", "k3tp8-b1", "k3tp8-b10", "kimi-verify"])
def test_model_shapes_gpu(H, lens, gate):
    """kimi-linear (32 heads, both gates low-rank) and K3 TP8 (12 heads, f only) at the decode sizes the policy
    fuses, default configs, bf16, [V, K] pools as the model holds them."""
    update = len(set(lens)) == 1
    check(lens, H, 128, device="cuda", dtype=torch.bfloat16, tol=1e-2, gate=gate, update=update,
          state_v_first=True)
