"""Triton causal depthwise conv1d (`tokenspeed.ops.triton.conv`) against the torch reference, and its dispatch.

CPU: the Triton interpreter, fp32. Every output starts poisoned (NaN) so an unwritten element fails; the state pool
is compared bit for bit (the new state is a copy of inputs), including the slots outside the batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # noqa: F401 - sets up Triton first
from tokenspeed import ops
from tokenspeed.ops import dispatch
from tokenspeed.ops.reference import conv as ref_conv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = [5, 0, 1, 2, 3, 37]  # zero-length, shorter than W-1, and long (several token blocks)
SLOTS = [6, 0, 3, 1, 9, 4]  # scattered, not in batch order
S = 11


def kernel():
    from tokenspeed.ops.triton import conv

    return conv


def cu_of(lens: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """cu_seqlens [N+1] on DEVICE for the given sequence lengths."""
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(DEVICE, dtype)


def make_inputs(lens: list[int], C: int, W: int, *, strided_x: bool = True, strided_state: bool = False):
    """x [T, C] (a column slice of a wider projection when strided_x), weight [C, W], state pool [S, C, W-1]."""
    T = sum(lens)
    if strided_x:
        x = torch.randn(T, C + 24, device=DEVICE)[:, 8:8 + C]
        assert x.stride() == (C + 24, 1)
    else:
        x = torch.randn(T, C, device=DEVICE)
    weight = torch.randn(C, W, device=DEVICE)
    if strided_state:  # channel-fastest pool [S, W-1, C] viewed as [S, C, W-1]
        state = torch.randn(S, W - 1, C, device=DEVICE).transpose(1, 2)
    else:
        state = torch.randn(S, C, W - 1, device=DEVICE)
    return x, weight, state


def run_both(x, weight, state, slots, cu, activation):
    """(y_triton, state_triton, y_ref, state_ref); each on its own copy of the pool, Triton output poisoned."""
    st_k, st_r = state.clone(), state.clone()
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    y_k = kernel().causal_conv1d(x, weight, st_k, slots, cu, activation, out=out)
    assert y_k is out
    y_r = ref_conv.causal_conv1d(x, weight, st_r, slots, cu, activation)
    return y_k, st_k, y_r, st_r


@pytest.mark.parametrize("W", [4, 3, 2])
@pytest.mark.parametrize("activation", ["silu", None])
def test_parity_mixed_lengths(W: int, activation: str | None) -> None:
    torch.manual_seed(W)
    x, weight, state = make_inputs(LENS, 300, W)  # C = 300: two channel blocks, the second partial
    slots = torch.tensor(SLOTS, device=DEVICE)
    y_k, st_k, y_r, st_r = run_both(x, weight, state, slots, cu_of(LENS), activation)
    assert y_k.dtype == x.dtype and y_k.shape == x.shape
    assert rel_err(y_k, y_r) < 1e-5
    assert torch.equal(st_k, st_r)  # batch slots advanced, zero-length slot 0 and slots outside the batch as before
    outside = [s for s in range(S) if s not in SLOTS]
    assert torch.equal(st_k[outside], state[outside]) and torch.equal(st_k[0], state[0])


@pytest.mark.parametrize("groups", [3, 4])
def test_grouped_output_each_group_contiguous(groups: int) -> None:
    """out = a [G, T, C/G] buffer permuted to [T, G, C/G] (KDA's q, k, v): every group's rows are the matching
    column block of the plain output, and the reference writes the same layout. C/G = 100 (3 groups) splits a
    channel block of the kernel across groups; every element is written (NaN poison)."""
    torch.manual_seed(groups)
    C = 300 if groups == 3 else 256
    x, weight, state = make_inputs(LENS, C, 4)
    slots, cu = torch.tensor(SLOTS, device=DEVICE), cu_of(LENS)
    T = x.shape[0]
    buf = torch.full((groups, T, C // groups), float("nan"), device=DEVICE)
    st_k, st_r = state.clone(), state.clone()
    got = kernel().causal_conv1d(x, weight, st_k, slots, cu, "silu", out=buf.permute(1, 0, 2))
    want = ref_conv.causal_conv1d(x, weight, st_r, slots, cu, "silu")
    assert got.data_ptr() == buf.data_ptr()
    for g in range(groups):
        assert rel_err(buf[g], want[:, g * (C // groups):(g + 1) * (C // groups)]) < 1e-5
    assert torch.equal(st_k, st_r)
    ref_buf = torch.empty_like(buf)
    ref_conv.causal_conv1d(x, weight, state.clone(), slots, cu, "silu", out=ref_buf.permute(1, 0, 2))
    assert torch.equal(ref_buf.permute(1, 0, 2).reshape(T, C), want)


def test_strided_state_weight_and_int32_indices() -> None:
    torch.manual_seed(1)
    x, weight, state = make_inputs(LENS, 72, 4, strided_x=False, strided_state=True)
    weight = weight.T.contiguous().T  # column-major [C, W]
    slots = torch.tensor(SLOTS, device=DEVICE, dtype=torch.int32)
    y_k, st_k, y_r, st_r = run_both(x, weight, state, slots, cu_of(LENS, torch.int32), "silu")
    assert rel_err(y_k, y_r) < 1e-5
    assert torch.equal(st_k, st_r)


def test_single_long_sequence_is_one_conv() -> None:
    torch.manual_seed(2)
    x, weight, state = make_inputs([70], 40, 4)
    slots = torch.tensor([2], device=DEVICE)
    y_k, st_k, y_r, st_r = run_both(x, weight, state, slots, cu_of([70]), "silu")
    assert rel_err(y_k, y_r) < 1e-5 and torch.equal(st_k, st_r)


@pytest.mark.parametrize("unroll", [2, 1])
def test_program_boundaries_inside_sequences(monkeypatch, unroll: int) -> None:
    """Programs of 32 tokens: one starts inside a sequence's first W-1 tokens (t = 32 is position 1 of the
    sequence starting at 31), one deep inside a sequence (t = 64); T = 69 is odd and not a multiple of 32."""
    conv = kernel()
    real = conv._conv_config
    monkeypatch.setattr(conv, "_conv_config", lambda T, C: (*real(T, C)[:3], unroll))
    torch.manual_seed(6)
    lens, slots = [30, 1, 2, 29, 7], [2, 7, 0, 5, 9]
    x, weight, state = make_inputs(lens, 40, 4)
    y_k, st_k, y_r, st_r = run_both(x, weight, state, torch.tensor(slots, device=DEVICE), cu_of(lens), "silu")
    assert real(69, 40)[0] == 32
    assert rel_err(y_k, y_r) < 1e-5 and torch.equal(st_k, st_r)


def test_negative_slot_is_zero_history_and_stores_nothing() -> None:
    torch.manual_seed(3)
    lens, slots = [4, 2, 6], [5, -1, 2]
    x, weight, state = make_inputs(lens, 48, 4)
    st_k = state.clone()
    out = torch.full(x.shape, float("nan"), device=DEVICE)
    y_k = kernel().causal_conv1d(x, weight, st_k, torch.tensor(slots, device=DEVICE), cu_of(lens), "silu", out=out)
    # Oracle: the reference with the padding row mapped to an extra, zeroed slot S.
    pool = torch.cat([state, torch.zeros(1, *state.shape[1:], device=DEVICE)])
    y_r = ref_conv.causal_conv1d(x, weight, pool, torch.tensor([5, S, 2], device=DEVICE), cu_of(lens), "silu")
    assert rel_err(y_k, y_r) < 1e-5
    assert torch.equal(st_k, pool[:S])  # slots 5 and 2 advanced, nothing else (no slot S-1 write-around)


def test_empty_batch_and_all_zero_lengths() -> None:
    x, weight, state = make_inputs([0, 0], 16, 4)
    st = state.clone()
    y = kernel().causal_conv1d(x, weight, st, torch.tensor([1, 2], device=DEVICE), cu_of([0, 0]))
    assert y.shape == (0, 16) and torch.equal(st, state)


def test_no_host_sync(monkeypatch) -> None:
    """The wrapper never reads a device value on the host (no .item() / .tolist() / int() / bool() of a tensor).

    (The interpreter reads tensors through numpy, not through these methods, so this also runs on the CPU.)"""
    x, weight, state = make_inputs([4, 5], 16, 4)
    slots, cu = torch.tensor([0, 1], device=DEVICE), cu_of([4, 5])
    kernel().causal_conv1d(x, weight, state.clone(), slots, cu)  # compile / warm up first

    def boom(*_a, **_k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    kernel().causal_conv1d(x, weight, state, slots, cu)


def test_shape_errors() -> None:
    x, weight, state = make_inputs([3], 16, 4)
    slots, cu = torch.tensor([0], device=DEVICE), cu_of([3])
    with pytest.raises(ValueError, match="activation"):
        kernel().causal_conv1d(x, weight, state, slots, cu, "gelu")
    with pytest.raises(ValueError, match="conv_state"):
        kernel().causal_conv1d(x, weight, state[:, :, :2], slots, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kernel().causal_conv1d(x, weight, state, slots, cu[:1])


def _spy(monkeypatch) -> list:
    mod = dispatch.kernels("conv")
    real = mod.causal_conv1d
    calls: list = []
    monkeypatch.setattr(mod, "causal_conv1d", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_public_op_forced_triton_takes_the_kernel(monkeypatch) -> None:
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = _spy(monkeypatch)
    x, weight, state = make_inputs(LENS, 40, 4)
    slots, cu = torch.tensor(SLOTS, device=DEVICE), cu_of(LENS)
    st_k, st_r = state.clone(), state.clone()
    y = ops.causal_conv1d(x, weight, st_k, slots, cu, activation="silu")
    assert calls == [1]
    assert rel_err(y, ref_conv.causal_conv1d(x, weight, st_r, slots, cu, "silu")) < 1e-5
    assert torch.equal(st_k, st_r)
    # Outside the supported region (W = 5, unknown activation) the reference runs (and raises for the latter).
    ops.causal_conv1d(x, torch.randn(40, 5, device=DEVICE), torch.randn(S, 40, 4, device=DEVICE), slots, cu)
    with pytest.raises(ValueError, match="activation"):
        ops.causal_conv1d(x, weight, state, slots, cu, activation="gelu")
    assert calls == [1]


@pytest.mark.parametrize("env", [None, "reference"])
def test_public_op_cpu_is_exactly_the_reference(monkeypatch, env: str | None) -> None:
    if env is None:
        monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    else:
        monkeypatch.setenv("TOKENSPEED_OPS", env)
    calls = _spy(monkeypatch)
    x, weight, state = make_inputs(LENS, 40, 4)
    x, weight, state = x.cpu(), weight.cpu(), state.cpu()
    slots, cu = torch.tensor(SLOTS), cu_of(LENS).cpu()
    st_p, st_r = state.clone(), state.clone()
    y = ops.causal_conv1d(x, weight, st_p, slots, cu)
    assert calls == []
    assert torch.equal(y, ref_conv.causal_conv1d(x, weight, st_r, slots, cu))
    assert torch.equal(st_p, st_r)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_bf16_parity_cuda(state_dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    lens = [700, 0, 1, 2, 3, 1000]
    x, weight, state = make_inputs(lens, 3 * 256, 4)
    x, state = x.bfloat16(), state.to(state_dtype)
    y_k, st_k, y_r, st_r = run_both(x, weight, state, torch.tensor(SLOTS, device=DEVICE), cu_of(lens), "silu")
    assert rel_err(y_k, y_r) < 1e-2
    assert torch.equal(st_k, st_r)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay() -> None:
    """The call is capturable (no host sync, grid from shapes) and a replay computes the same as the reference."""
    torch.manual_seed(5)
    x, weight, state = make_inputs(LENS, 256, 4)
    slots, cu = torch.tensor(SLOTS, device=DEVICE), cu_of(LENS)
    st_g, st_r = state.clone(), state.clone()
    kernel().causal_conv1d(x, weight, st_g, slots, cu)  # compile outside the capture
    st_g.copy_(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g = kernel().causal_conv1d(x, weight, st_g, slots, cu)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y_g, ref_conv.causal_conv1d(x, weight, st_r, slots, cu)) < 1e-5
    assert torch.equal(st_g, st_r)
