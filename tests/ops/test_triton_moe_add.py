"""`ops.moe_experts(..., add=s)`: the shared experts' output added in the routed experts' combine kernel.

Contract (reference and Triton): cast(routed sum) + s, i.e. the routed fp32 sum rounded to x.dtype first, then the
add rounded again: exactly the two-step `moe_experts(...) + s` it replaces.
CPU (Triton interpreter): fp32 against the reference within 1e-5 and bit for bit against the unfused kernel plus
torch's add; strided `add` rows; odd T, k, D; ids outside [0, E); empty calls; bad `add` rejected by both. The
combine kernel alone in fp16 (the interpreter rounds fp32 -> fp16 to nearest): bit for bit the two roundings, and
a single rounding (acc + s, one cast: the fusion done wrong) differs on many elements of the same data. Every
torch.empty of the op starts as NaN (fixture), so an unwritten element fails.
CUDA (`-m gpu`): bf16 at the kimi-linear shapes (E 256, k 8, D 2304, I 1024; T = 1, 64, 512) bit for bit against
`moe_experts(...) + s`, and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter
from tests.ops.moe_inputs import KIMI, make_weights
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts

SILU = Activation("silu")
SITU = Activation("situ")


def make_routing(T, k, E, D, dtype, device, seed=1, invalid=False):
    """x [T, D] and k distinct ids per token (with invalid: some -1 and E), positive weights summing to ~2.5."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    if invalid:
        drop = torch.rand(T, k, generator=g)
        ids = torch.where(drop < 0.2, torch.full_like(ids, -1), ids)
        ids = torch.where((drop >= 0.2) & (drop < 0.4), torch.full_like(ids, E), ids)
    w = torch.rand(T, k, generator=g) + 0.1
    return x, (w / w.sum(-1, keepdim=True) * 2.5).to(device), ids.to(device)


def shared_like(T: int, D: int, dtype, device, seed: int = 7, strided: bool = False) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    if strided:
        return (torch.randn(T, D + 9, generator=g) * 0.5).to(device=device, dtype=dtype)[:, 4:4 + D]
    return (torch.randn(T, D, generator=g) * 0.5).to(device=device, dtype=dtype)


def triton_experts():
    from tokenspeed.ops.triton.moe_experts import moe_experts

    return moe_experts


def check_add(T, k, E, D, DI, act, dtype, device, *, strided=False, invalid=False):
    """Fused vs reference (tolerance) and vs the unfused kernel + torch add (bit for bit)."""
    w1, w3, w2 = make_weights(E, D, DI, dtype, device)
    x, tw, ids = make_routing(T, k, E, D, dtype, device, invalid=invalid)
    s = shared_like(T, D, dtype, device, strided=strided)
    s_before = s.clone()
    fn = triton_experts()
    y = fn(x, w1, w3, w2, tw, ids, act, add=s)
    assert y.shape == (T, D) and y.dtype == dtype
    ref = ref_experts(x, w1, w3, w2, tw, ids, act, add=s)
    assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(y, fn(x, w1, w3, w2, tw, ids, act) + s)
    assert torch.equal(s, s_before)  # add is only read
    return y


# ----------------------------------------------------------------------------- CPU (interpreter)
@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("T,k,E,D", [(1, 1, 8, 48), (3, 2, 8, 48), (37, 4, 8, 40), (5, 8, 64, 48), (9, 3, 8, 1100)])
def test_add_interp(T, k, E, D, act, poison_empty):
    check_add(T, k, E, D, 40, act, torch.float32, "cpu", strided=T == 3, invalid=T == 37)


@cpu_interp
def test_add_empty_and_errors_interp(poison_empty):
    fn = triton_experts()
    w1, w3, w2 = make_weights(4, 32, 16, torch.float32, "cpu")
    x, tw, ids = make_routing(3, 2, 4, 32, torch.float32, "cpu")
    s = shared_like(3, 32, torch.float32, "cpu")
    for bad in (s[:, :31], s.double(), s[:2]):
        with pytest.raises(ValueError, match="add must be"):
            fn(x, w1, w3, w2, tw, ids, SILU, add=bad)
        with pytest.raises(ValueError, match="add must be"):
            ref_experts(x, w1, w3, w2, tw, ids, SILU, add=bad)
    assert torch.equal(fn(x, w1, w3, w2, tw[:, :0], ids[:, :0], SILU, add=s), s)  # k = 0: nothing routed
    assert fn(x[:0], w1, w3, w2, tw[:0], ids[:0], SILU, add=s[:0]).shape == (0, 32)


def _combine(buf: torch.Tensor, tw: torch.Tensor, add: torch.Tensor | None, k: int) -> torch.Tensor:
    import triton

    from tokenspeed.ops.triton.moe_combine import _combine_kernel

    T, D = buf.shape[0] // k, buf.shape[1]
    out = torch.full((T, D), float("nan"), dtype=buf.dtype)
    block_d = min(1024, triton.next_power_of_2(D))
    _combine_kernel[(T, triton.cdiv(D, block_d))](
        buf, tw, out, out if add is None else add, D, 0 if add is None else add.stride(0),
        TOP_K=k, BLOCK_D=block_d, HAS_ADD=add is not None, num_warps=4)
    return out


@cpu_interp
def test_combine_fp16_two_roundings_interp():
    T, k, D = 33, 6, 300
    g = torch.Generator().manual_seed(11)
    buf = (torch.randn(T * k, D, generator=g) * 4).half()
    tw = torch.rand(T, k, generator=g).reshape(-1) + 0.05
    s = (torch.randn(T, D, generator=g) * 4).half()
    acc = torch.zeros(T, D)
    for j in range(k):  # the kernel's order: slot by slot, fp32
        acc = acc + tw.view(T, k)[:, j:j + 1] * buf.view(T, k, D)[:, j].float()
    want = (acc.half().float() + s.float()).half()  # routed sum rounded, then the add rounded
    assert torch.equal(_combine(buf, tw, None, k), acc.half())
    assert torch.equal(_combine(buf, tw, s, k), want)
    once = (acc + s.float()).half()
    assert (once != want).double().mean().item() > 0.05  # a single rounding is a different function


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 512])
def test_add_kimi_gpu(T):
    check_add(T, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"], SILU, torch.bfloat16, "cuda", strided=T == 64)


@pytest.mark.gpu
@needs_cuda
def test_add_graph_gpu():
    fn = triton_experts()
    T, k, E, D, DI = 4, 8, 64, 2304, 256
    w1, w3, w2 = make_weights(E, D, DI, torch.bfloat16, "cuda")
    x, tw, ids = make_routing(T, k, E, D, torch.bfloat16, "cuda")
    s = shared_like(T, D, torch.bfloat16, "cuda")
    fn(x, w1, w3, w2, tw, ids, SILU, add=s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, w1, w3, w2, tw, ids, SILU, add=s)
    for seed in (8, 9):
        s.copy_(shared_like(T, D, torch.bfloat16, "cuda", seed=seed))
        y.fill_(float("nan"))
        graph.replay()
        assert torch.equal(y, fn(x, w1, w3, w2, tw, ids, SILU) + s)
