"""The direct mode's gate_up + down in one persistent launch (`tokenspeed.ops.triton.moe_fused`) against the two
launches of the direct mode (same config: the same bits) and the torch reference.

CPU (Triton interpreter, fp32; one program does every item): the per-pair buffer bit for bit the two-launch
direct mode's at T = 1..4, k = 1, 2, 8, ragged D / I, SiLU and SiTU, ids outside [0, E), with the tails' tile
heights; the counter buffer is zero again after every call; `moe_experts` takes the fused launch under
TOKENSPEED_MOE_FUSED=1 and gives the same output; the switch rejects other values; the residency rule.
CUDA (`-m gpu`): bf16 at the Kimi-Linear-48B shapes (T = 1, 2, 4, with invalid ids), the buffer and the combined
output bit for bit the two-launch path's with the grid of the first call (one program a SM) and of the later
ones (the compiled residency); a K3-slice-like shape (E 64, k 16, D 3584, I 3072); graph replay of the fused
launch under PDL, 50 replays with new ids each time, every replay bit for bit the eager two-launch result and the
counters zero at the end.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter
from tests.ops.moe_inputs import KIMI, make_weights
from tests.ops.test_triton_moe_direct import SILU, SITU, routing
from tokenspeed.ops.reference.moe import moe_experts as ref_experts


def fused_and_two(x, w1, w3, w2, ids, act, cfg):
    """(fused buffer, two-launch buffer) of the direct mode under cfg."""
    from tokenspeed.ops.triton import moe_experts as tk
    from tokenspeed.ops.triton import moe_fused

    k = ids.shape[1]
    flat = ids.reshape(-1).contiguous()
    fused = moe_fused.experts_direct_fused(x, w1, w3, w2, flat, k, act, cfg)
    two = tk.down_direct(tk.gate_up_direct(x, w1, w3, flat, k, act, cfg), w2, flat, cfg)
    assert fused is not None and fused.shape == two.shape == (flat.numel(), w2.shape[1])
    sync = moe_fused.sync_buffer(x.device, flat.numel())
    assert int(sync.abs().sum()) == 0, "the counters must be zero again after the launch"
    return fused, two


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
@cpu_interp
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("k,E", [(1, 8), (2, 8), (8, 64)])
def test_fused_equals_two_launches_interp(T, k, E, poison_empty):
    from tokenspeed.ops.triton.moe_experts import default_config

    w1, w3, w2 = make_weights(E, 48, 40, torch.float32, "cpu", seed=T)
    x, tw, ids = routing(T, k, E, 48, torch.float32, "cpu", seed=T * 10 + k, invalid=T == 3, shared=T == 4)
    act = SITU if T % 2 else SILU
    fused, two = fused_and_two(x, w1, w3, w2, ids, act, default_config(T, k, E, 48, 40, 4))
    assert torch.equal(fused, two)


@cpu_interp
@pytest.mark.parametrize("T", [1, 3])
def test_fused_ticket_order_interp(T, monkeypatch, poison_empty):
    """The ticket-counter work order (DYNAMIC) gives the same bits, and leaves the ticket at zero."""
    from tokenspeed.ops.triton import moe_fused
    from tokenspeed.ops.triton.moe_experts import default_config

    monkeypatch.setattr(moe_fused, "DYNAMIC", True)
    w1, w3, w2 = make_weights(64, 48, 40, torch.float32, "cpu", seed=T)
    x, tw, ids = routing(T, 8, 64, 48, torch.float32, "cpu", seed=T, invalid=T == 3)
    fused, two = fused_and_two(x, w1, w3, w2, ids, SILU, default_config(T, 8, 64, 48, 40, 4))
    assert torch.equal(fused, two)


@cpu_interp
@pytest.mark.parametrize("D,DI", [(33, 17), (64, 64), (200, 40)])
@pytest.mark.parametrize("tails", [False, True])
def test_fused_dims_and_tails_interp(D, DI, tails, poison_empty):
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    cfg = ExpertsConfig(32 if tails else 16, 32, 32, 4, 2, 32, 64, 4, 2, tail_m1=tails, tail_m2=tails)
    w1, w3, w2 = make_weights(64, D, DI, torch.float32, "cpu", seed=D)
    x, tw, ids = routing(2, 4, 64, D, torch.float32, "cpu", seed=D + DI, invalid=True)
    fused, two = fused_and_two(x, w1, w3, w2, ids, SITU, cfg)
    assert torch.equal(fused, two)


@cpu_interp
@pytest.mark.parametrize("T", [1, 4])
def test_moe_experts_takes_fused_launch_interp(T, monkeypatch, poison_empty):
    """Under TOKENSPEED_MOE_FUSED=1 `moe_experts` runs the fused launch (and not gate_up / down) with the same
    output, which is within 1e-5 of the reference."""
    from tokenspeed.ops.triton import moe_experts as tk

    w1, w3, w2 = make_weights(64, 48, 40, torch.float32, "cpu")
    x, tw, ids = routing(T, 8, 64, 48, torch.float32, "cpu", seed=T, invalid=True)
    s = torch.randn(T, 48)
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "0")
    want = tk.moe_experts(x, w1, w3, w2, tw, ids, SITU, add=s)
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "1")

    def boom(*a, **kw):
        raise AssertionError("the two-launch direct mode ran")

    monkeypatch.setattr(tk, "gate_up_direct", boom)
    monkeypatch.setattr(tk, "down_direct", boom)
    got = tk.moe_experts(x, w1, w3, w2, tw, ids, SITU, add=s)
    assert torch.equal(got, want)
    assert rel_err(got, ref_experts(x, w1, w3, w2, tw, ids, SITU, add=s)) < 1e-5


def test_switch(monkeypatch):
    from tokenspeed.ops.triton import moe_fused

    monkeypatch.delenv("TOKENSPEED_MOE_FUSED", raising=False)
    assert moe_fused.fused_on() == moe_fused.FUSED
    for v, want in (("0", False), ("1", True)):
        monkeypatch.setenv("TOKENSPEED_MOE_FUSED", v)
        assert moe_fused.fused_on() is want
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "yes")
    with pytest.raises(ValueError, match="TOKENSPEED_MOE_FUSED"):
        moe_fused.fused_on()


def test_programs_per_sm():
    from tokenspeed.ops.triton.moe_fused import programs_per_sm

    assert programs_per_sm(128, 60 * 1024, 4, cap=8) == 3  # shared memory: 3 x 61 KB
    assert programs_per_sm(255, 0, 8, cap=8) == 1  # registers: 8 warps x 32 x 256
    assert programs_per_sm(64, 10 * 1024, 4, cap=2) == 2  # the cap
    assert programs_per_sm(96, 0, 16, cap=8) == 1  # registers: 96 x 512 threads = 48K of 64K
    assert programs_per_sm(32, 0, 16, cap=8) == 4  # threads: 2048 / 512
    assert programs_per_sm(255, 200 * 1024, 8, cap=8) == 1  # never below one


def test_sync_buffer_limits():
    from tokenspeed.ops.triton import moe_fused

    assert moe_fused.sync_buffer(torch.device("cpu"), moe_fused.MAX_PAIRS + 1) is None
    buf = moe_fused.sync_buffer(torch.device("cpu"), 9)
    assert buf.dtype == torch.int32 and buf.numel() == 2 + moe_fused.MAX_PAIRS
    assert moe_fused.sync_buffer(torch.device("cpu"), 9) is buf  # made once a device


# ----------------------------------------------------------------------------- CUDA
def _kimi(T, seed, invalid=False):
    w1, w3, w2 = make_weights(KIMI["E"], KIMI["D"], KIMI["I"], torch.bfloat16, "cuda")
    x, tw, ids = routing(T, KIMI["k"], KIMI["E"], KIMI["D"], torch.bfloat16, "cuda", seed=seed, invalid=invalid)
    return w1, w3, w2, x, tw, ids


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dynamic,prefetch", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_fused_kimi_bf16_gpu(T, dynamic, prefetch, monkeypatch, poison_empty):
    from tokenspeed.ops.triton import moe_fused
    from tokenspeed.ops.triton.moe_experts import default_config

    monkeypatch.setattr(moe_fused, "DYNAMIC", dynamic)
    monkeypatch.setattr(moe_fused, "PREFETCH_W2", prefetch)
    monkeypatch.setattr(moe_fused, "PROGRAMS_PER_SM", 3)
    w1, w3, w2, x, tw, ids = _kimi(T, T, invalid=T == 4)
    cfg = default_config(T, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"])
    moe_fused._resident.clear()
    for _ in range(3):  # first call: one program a SM; then the compiled residency
        fused, two = fused_and_two(x, w1, w3, w2, ids, SITU, cfg)
        assert torch.equal(fused, two)
    assert max(moe_fused._resident.values()) >= 1


@pytest.mark.gpu
@needs_cuda
def test_fused_k3_like_gpu(poison_empty):
    from tokenspeed.ops.triton.moe_experts import default_config

    E, k, D, DI = 64, 16, 3584, 3072
    w1, w3, w2 = make_weights(E, D, DI, torch.bfloat16, "cuda")
    for T in (1, 3):
        x, tw, ids = routing(T, k, E, D, torch.bfloat16, "cuda", seed=T, invalid=T == 3)
        fused, two = fused_and_two(x, w1, w3, w2, ids, SILU, default_config(T, k, E, D, DI))
        assert torch.equal(fused, two)


@pytest.mark.gpu
@needs_cuda
def test_fused_graph_replay_gpu(monkeypatch, poison_empty):
    from tokenspeed.ops.triton import moe_experts as tk
    from tokenspeed.ops.triton import moe_fused

    T = 1
    w1, w3, w2, x, tw, ids = _kimi(T, 3)
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "1")
    for _ in range(2):
        tk.moe_experts(x, w1, w3, w2, tw, ids, SITU)  # compile, residency
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = tk.moe_experts(x, w1, w3, w2, tw, ids, SITU)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(50):
        _, tw_i, ids_i = routing(T, KIMI["k"], KIMI["E"], KIMI["D"], torch.bfloat16, "cuda", seed=100 + i,
                                 invalid=i % 5 == 0)
        ids.copy_(ids_i)
        tw.copy_(tw_i)
        g.replay()
        monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "0")
        want = tk.moe_experts(x, w1, w3, w2, tw, ids, SITU)
        monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "1")
        torch.cuda.synchronize()
        assert torch.equal(out, want), i
    assert int(moe_fused.sync_buffer(x.device, 9).abs().sum()) == 0
