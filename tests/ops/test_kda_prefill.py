"""`ops.kda_prefill`: KDA from conv outputs and raw gate / beta logits.

CPU: it equals the explicit composition (L2 norm, gate, sigmoid, scan) in both forms, picks the form from the host
lengths, and mutates only the batch's state rows. GPU (fla-core): the fused chunk path, which does the norm, the
gate and the sigmoid inside fla's kernels, matches the fp32 CPU reference within bf16 tolerance for both gates.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tokenspeed import ops
from tokenspeed.ops import dispatch
from tokenspeed.ops.reference.kda import kda_chunk, kda_gate, kda_recurrent, l2_normalize


def _inputs(lens: list[int], H: int = 2, K: int = 32, seed: int = 0, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return dict(
        q=torch.randn(T, H, K, generator=gen), k=torch.randn(T, H, K, generator=gen),
        v=torch.randn(T, H, K, generator=gen), f=torch.randn(T, H, K, generator=gen),
        b=torch.randn(T, H, generator=gen), A_log=torch.randn(H, generator=gen) * 0.5,
        dt_bias=torch.randn(H, K, generator=gen) * 0.5, state=torch.randn(len(lens) + 2, H, K, K, generator=gen),
        cu_host=[0] + torch.tensor(lens).cumsum(0).tolist(),
    )


def _run(inp: dict, lower_bound: float | None, slots: list[int], device: str = "cpu", dtype=torch.float32,
         v_first: bool = False) -> tuple[Tensor, Tensor]:
    """o and the pool after the op ([K, V] per head whatever the layout it ran on: v_first runs on a [V, K] copy)."""
    state = inp["state"].to(device, copy=True)
    if v_first:
        state = state.transpose(-1, -2).contiguous()
    o = ops.kda_prefill(
        *(inp[n].to(device, dtype) for n in ("q", "k", "v", "f", "b")), inp["A_log"].to(device),
        inp["dt_bias"].to(device), lower_bound, scale=inp["q"].shape[-1] ** -0.5, state=state,
        state_indices=torch.tensor(slots, device=device), cu_seqlens=torch.tensor(inp["cu_host"], device=device),
        cu_seqlens_host=inp["cu_host"], state_v_first=v_first)
    return o.float().cpu(), (state.transpose(-1, -2) if v_first else state).cpu()


@pytest.mark.parametrize("lens", [[40, 17, 3], [5, 9, 1]])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_equals_composition_and_touches_only_its_slots(lens: list[int], lower_bound: float | None) -> None:
    inp = _inputs(lens)
    slots = [3, 0, 2]
    o, state = _run(inp, lower_bound, slots)
    form = kda_chunk if max(lens) > ops.KDA_CHUNK_MIN_TOKENS else kda_recurrent
    ref_o, ref_final = form(
        l2_normalize(inp["q"]), l2_normalize(inp["k"]), inp["v"], kda_gate(inp["f"], inp["A_log"], inp["dt_bias"],
                                                                            lower_bound),
        torch.sigmoid(inp["b"]), scale=inp["q"].shape[-1] ** -0.5, initial_state=inp["state"][slots],
        cu_seqlens=torch.tensor(inp["cu_host"]))
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[slots], ref_final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], inp["state"][1], rtol=0, atol=0)  # not in the batch
    torch.testing.assert_close(state[4], inp["state"][4], rtol=0, atol=0)


@pytest.mark.parametrize("lens", [[40, 17, 3], [5, 9, 1]])  # the chunked and the recurrent form
def test_v_first_pool_gives_the_kv_result(lens: list[int]) -> None:
    """A [V, K] pool (`state_v_first`, the model's layout) gives the same o and, transposed, the same pool (up to
    the rounding of matmuls on transposed operands: ~1e-8 here)."""
    inp = _inputs(lens)
    o, state = _run(inp, -5.0, [3, 0, 2])
    o_vf, state_vf = _run(inp, -5.0, [3, 0, 2], v_first=True)
    torch.testing.assert_close(o_vf, o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_vf, state, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_vf[[1, 4]], inp["state"][[1, 4]], rtol=0, atol=0)  # not in the batch


needs_fla = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.fla_available()),
                               reason="needs CUDA and fla-core")


@needs_fla
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("K", [128, 64])
def test_fused_fla_chunk_matches_reference(lower_bound: float | None, K: int) -> None:
    """bf16 inputs through fla's fused kernels vs the fp32 CPU reference of the same (rounded) inputs."""
    inp = _inputs([300, 64, 129, 17], H=4, K=K, seed=1)
    for n in ("q", "k", "v", "f", "b"):  # round once so both paths see the same values
        inp[n] = inp[n].to(torch.bfloat16).float()
    slots = [5, 1, 0, 3]
    inp["state"] = torch.randn(6, 4, K, K) * 0.1
    o_gpu, state_gpu = _run(inp, lower_bound, slots, "cuda", torch.bfloat16)
    o_ref, state_ref = _run(inp, lower_bound, slots)
    err_o = ((o_gpu - o_ref).norm() / o_ref.norm()).item()
    err_s = ((state_gpu - state_ref).norm() / state_ref.norm()).item()
    assert err_o < 1e-2 and err_s < 1e-2, (err_o, err_s)
    torch.testing.assert_close(state_gpu[[2, 4]], inp["state"][[2, 4]], rtol=0, atol=0)
    o_vf, state_vf = _run(inp, lower_bound, slots, "cuda", torch.bfloat16, v_first=True)  # the model's layout
    torch.testing.assert_close(o_vf, o_gpu, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_vf, state_gpu, rtol=1e-6, atol=1e-6)


def test_fla_host_offsets_shared_within_a_forward() -> None:
    """Every KDA layer of one forward gets the same CPU offsets tensor (fla's identity-keyed index cache then
    hits, so it builds and uploads its chunk table once per forward, not once per layer); a new batch or changed
    values get a new tensor."""
    from tokenspeed.ops.cuda.kda_chunk import _host_offsets

    cu = torch.tensor([0, 5, 9])
    first = _host_offsets(cu, [0, 5, 9])
    assert _host_offsets(cu, [0, 5, 9]) is first
    assert first.tolist() == [0, 5, 9] and first.dtype == torch.int64 and first.device.type == "cpu"
    other = _host_offsets(torch.tensor([0, 5, 9]), [0, 5, 9])
    assert other is not first
    changed = _host_offsets(cu, [0, 4, 9])
    assert changed is not first and changed.tolist() == [0, 4, 9]


@needs_fla
def test_fused_fla_chunk_second_layer_does_not_synchronise() -> None:
    """The second KDA layer of a forward (same batch offsets) issues fla's kernels without a device sync."""
    inp = _inputs([300, 64, 129], H=4, K=128, seed=2)
    dev = {n: inp[n].to("cuda", torch.bfloat16) for n in ("q", "k", "v", "f", "b")}
    state = torch.zeros(4, 4, 128, 128, device="cuda")
    slots = torch.tensor([0, 1, 2], device="cuda")
    host = [0, 300, 364, 493]
    cu = torch.tensor(host, device="cuda")
    a_log, dt_bias = inp["A_log"].cuda(), inp["dt_bias"].cuda()

    def layer() -> Tensor:
        return ops.kda_prefill(dev["q"], dev["k"], dev["v"], dev["f"], dev["b"], a_log, dt_bias, -5.0, scale=128 ** -0.5, state=state, state_indices=slots,
                               cu_seqlens=cu, cu_seqlens_host=host)

    layer()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
