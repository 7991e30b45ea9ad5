"""Triton gated activation (`ops.gated_activation`, `ops.gated_activation_merged`) against the torch reference.

CPU: the Triton interpreter. fp32 within 1e-5 relative (max |diff| / max |ref|) and, elementwise, within 1e-6 of an
fp64 oracle down to gates and ups of 1e-7 (a tanh of the form (1 - e^-2x) / (1 + e^-2x) loses every digit there:
that mutation fails `test_situ_small_inputs_elementwise_interp`); fp16 (the interpreter rounds fp32 -> fp16 to
nearest, unlike bf16) equal to the reference's single rounding up to rare one-ulp flips where the fp32 values
differ in the last bits (a second rounding, e.g. of silu(g) before the product, flips a large share:
`test_fp16_single_rounding_interp` shows it does on this data). Shapes: odd rows and widths (1, 5, 37, 130, 1025
columns across two column tiles), 3-D inputs, the strided halves of a merged [T, 2I] projection read in place, and
a padded row stride. Every output starts as NaN (`out=` a poisoned buffer), so an unwritten element fails.
CUDA (`-m gpu`): bf16 and fp32 at the kimi-linear shapes (shared expert I = 1024, dense MLP I = 9216; T = 1, 64,
8192) and a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter
from tokenspeed.ops.reference import activation as ref_act
from tokenspeed.ops.reference.activation import Activation

SILU = Activation("silu")
SITU = Activation("situ")  # K3: beta 4, linear beta 25
SITU_TIGHT = Activation("situ", beta=0.5, linear_beta=0.3)  # both tanh branches saturate
ACTS = [SILU, SITU, SITU_TIGHT]


def kernels():
    from tokenspeed.ops.triton import activation

    return activation


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def poison(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def gate_up(shape, dtype, device, seed=0, scale=4.0) -> torch.Tensor:
    """A merged [..., 2I] projection with gates in the SiLU / SiTU knees and ups up to ~100."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x[..., shape[-1] // 2:] *= 6
    return x.to(device=device, dtype=dtype)


def check_merged(shape, act, dtype, device, seed=0):
    k = kernels()
    gu = gate_up(shape, dtype, device, seed)
    out = poison((*shape[:-1], shape[-1] // 2), dtype, device)
    y = k.gated_activation_merged(gu, act, out=out)
    assert y is out
    ref = ref_act.gated_activation_merged(gu, act)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert rel_err(y, ref) < tol(dtype)
    return y, ref


def check_pair(gate, up, act, dtype, device):
    k = kernels()
    out = poison(gate.shape, dtype, device)
    y = k.gated_activation(gate, up, act, out=out)
    ref = ref_act.gated_activation(gate, up, act)
    assert rel_err(y, ref) < tol(dtype)
    return y, ref


# ----------------------------------------------------------------------------- CPU (interpreter)
@cpu_interp
@pytest.mark.parametrize("act", ACTS, ids=["silu", "situ", "situ-tight"])
@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 130), (37, 2 * 64), (3, 2 * 1025), (2, 3, 2 * 24)])
def test_merged_interp(shape, act):
    check_merged(shape, act, torch.float32, "cpu")


@cpu_interp
@pytest.mark.parametrize("act", ACTS, ids=["silu", "situ", "situ-tight"])
def test_pair_layouts_interp(act):
    """Separate tensors, the chunk views of a merged projection, a padded row stride, and 3-D."""
    gu = gate_up((7, 2 * 33), torch.float32, "cpu", seed=1)
    g, u = gu.chunk(2, dim=-1)  # strided halves, read in place
    y, _ = check_pair(g, u, act, torch.float32, "cpu")
    y2, _ = check_pair(g.contiguous(), u.contiguous(), act, torch.float32, "cpu")
    assert torch.equal(y, y2)
    assert torch.equal(y, kernels().gated_activation_merged(gu, act))  # one kernel, one function
    wide = gate_up((7, 100), torch.float32, "cpu", seed=2)[:, 3:36]  # row stride 100, offset 3
    check_pair(wide, u, act, torch.float32, "cpu")
    g3 = gate_up((2, 3, 20), torch.float32, "cpu", seed=3)
    check_pair(g3, g3.flip(-1), act, torch.float32, "cpu")


@cpu_interp
def test_situ_small_inputs_elementwise_interp():
    """Elementwise against an fp64 oracle over 1e-7 .. 30 (gate) and 1e-7 .. 1e3 (up), both signs."""
    a = torch.cat([torch.logspace(-7, 1.5, 60), -torch.logspace(-7, 1.5, 60)])
    u = torch.cat([torch.logspace(-7, 3, 60), -torch.logspace(-7, 3, 60)])
    g, up = a[:, None].expand(120, 120), u[None, :].expand(120, 120)
    for act in (SITU, SITU_TIGHT):
        y = kernels().gated_activation(g, up, act).double()
        ad, ud = g.double(), up.double()
        want = act.beta * torch.tanh(ad / act.beta) * torch.sigmoid(ad) * act.linear_beta * torch.tanh(
            ud / act.linear_beta)
        assert ((y - want).abs() / want.abs()).max().item() < 1e-6
    y = kernels().gated_activation(g, up, SILU).double()
    want = torch.nn.functional.silu(g.double()) * up.double()
    assert ((y - want).abs() / want.abs()).max().item() < 1e-6


@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
def test_fp16_single_rounding_interp(act):
    """fp16 in and out: the fp32 result rounded once, as the reference; a second rounding would show."""
    gu = gate_up((64, 2 * 96), torch.float16, "cpu", seed=4, scale=2.0)
    y, ref = check_merged(tuple(gu.shape), act, torch.float16, "cpu", seed=4)
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp_min(2 ** -14)
    assert ((y.float() - ref.float()).abs() <= ulp).all()
    assert (y != ref).double().mean().item() < 0.01
    # the mutation: round the gate branch to fp16 before the product
    g, u = gu.float().chunk(2, dim=-1)
    if act.kind == "silu":
        twice = (torch.nn.functional.silu(g).half().float() * u).half()
    else:
        gb = (act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)).half().float()
        twice = (gb * act.linear_beta * torch.tanh(u / act.linear_beta)).half()
    assert (twice != ref).double().mean().item() > 0.05


@cpu_interp
def test_errors_and_empty_interp():
    k = kernels()
    with pytest.raises(ValueError, match="unknown gated activation"):
        k.gated_activation_merged(torch.randn(2, 4), Activation("gelu"))
    with pytest.raises(ValueError, match="even"):
        k.gated_activation_merged(torch.randn(2, 5), SILU)
    with pytest.raises(ValueError, match="one shape"):
        k.gated_activation(torch.randn(2, 4), torch.randn(2, 3), SILU)
    with pytest.raises(ValueError, match="out must be"):
        k.gated_activation_merged(torch.randn(2, 4), SILU, out=torch.empty(2, 3))
    assert k.gated_activation_merged(torch.randn(0, 8), SILU).shape == (0, 4)


@cpu_interp
def test_public_ops_dispatch_interp(monkeypatch):
    """TOKENSPEED_OPS=triton routes both public ops to the kernel; reference mode and CPU auto do not."""
    from tokenspeed import ops

    k = kernels()
    calls = []
    for name in ("gated_activation", "gated_activation_merged"):
        real = getattr(k, name)
        monkeypatch.setattr(k, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw))
    gu = gate_up((3, 2 * 40), torch.float32, "cpu")
    g, u = gu.chunk(2, dim=-1)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    y1, y2 = ops.gated_activation_merged(gu, SITU), ops.gated_activation(g, u, SITU)
    assert calls == ["gated_activation_merged", "gated_activation"]
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    assert rel_err(y1, ops.gated_activation_merged(gu, SITU)) < 1e-5
    assert rel_err(y2, ops.gated_activation(g, u, SITU)) < 1e-5
    monkeypatch.delenv("TOKENSPEED_OPS")
    ops.gated_activation_merged(gu, SITU)  # CPU tensors under auto: the reference
    assert len(calls) == 2
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")  # outside the region: an odd width takes the reference (raises)
    with pytest.raises(ValueError, match="even"):
        ops.gated_activation_merged(gu[:, :-1], SITU)
    assert len(calls) == 2


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,I", [(1, 1024), (64, 1024), (8192, 1024), (1, 9216), (37, 9216), (5, 1000), (3, 1)])
def test_merged_gpu(T, I, dtype, act):
    check_merged((T, 2 * I), act, dtype, "cuda")
    gu = gate_up((T, 2 * I), dtype, "cuda")
    check_pair(*gu.chunk(2, dim=-1), act, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_gpu():
    k = kernels()
    gu = gate_up((4, 2048), torch.bfloat16, "cuda")
    k.gated_activation_merged(gu, SILU)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = k.gated_activation_merged(gu, SILU)
    for seed in (5, 6):
        gu.copy_(gate_up((4, 2048), torch.bfloat16, "cuda", seed))
        y.fill_(float("nan"))
        graph.replay()
        assert rel_err(y, ref_act.gated_activation_merged(gu, SILU)) < 1e-2
