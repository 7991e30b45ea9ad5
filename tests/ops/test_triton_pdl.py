"""Programmatic dependent launch plumbing of the decode kernels (`tokenspeed.ops.triton.pdl`), host only.

The interpreter cannot run a PDL kernel (its wait is inline asm), so these tests catch the launches instead of
running them: with `pdl.enabled` forced True, every kernel of the norm, activation, conv, AttnRes and GEMV wrappers
is launched with `PDL=True` and `launch_pdl=True` (the GEMV with its default "l2" weight prefetch); with it False,
`PDL=False` and no `launch_pdl` (a kernel launched as a dependent without its wait compiled in would read its
input early). That the PDL variants compile for sm_90, with the wait before the trigger and the prefetch before
the wait, is checked by benchmarks/pdl_compile_sm90.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp  # first: sets up Triton
from tokenspeed.ops.reference.activation import Activation


def _mods():
    from tokenspeed.ops.triton import activation, attn_res, conv, gemv, norm, pdl

    return pdl, norm, activation, conv, attn_res, gemv


def _catch(monkeypatch, modules) -> list[tuple[str, dict]]:
    """Replace every `*_kernel` of the modules by a recorder of (name, launch keywords)."""
    calls: list[tuple[str, dict]] = []

    class Catch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((self.name, kw))

    for module in modules:
        for name in dir(module):
            if name.endswith("_kernel"):
                monkeypatch.setattr(module, name, Catch(name))
    return calls


def _wrapper_calls():
    """Calls of every PDL wrapper at small fp32 shapes (the kernels are caught, never run)."""
    _, norm, activation, conv, attn_res, gemv = _mods()
    x, w = torch.randn(2, 64), torch.ones(64)
    blocks, q = torch.randn(3, 2, 64), torch.randn(64)
    cx, cw, cs = torch.randn(3, 32), torch.randn(32, 4), torch.zeros(4, 32, 3)
    si, cu = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    return [
        lambda: norm.rms_norm(x, w, 1e-6),
        lambda: norm.gated_rms_norm(x, x, w, 1e-6),
        lambda: norm.add_rms_norm(x, x.clone(), w, 1e-6),
        lambda: activation.gated_activation_merged(x, Activation("silu")),
        lambda: activation.gated_activation(x, x, Activation("situ")),
        lambda: conv.causal_conv1d(cx, cw, cs, si, cu),
        lambda: gemv.gemv(x, torch.randn(48, 64), kind="fma"),
        lambda: gemv.gemv(x, torch.randn(48, 64), kind="dot", block_n=16, block_k=16, split_k=2, reduce="launch"),
        *[lambda s=s: attn_res.attn_res_mix_rms_norm(blocks, x, q, 1e-6, w, 1e-6, schedule=s)
          for s in ("split", "tile", "online")],
    ]


@cpu_interp
@pytest.mark.parametrize("on", [True, False])
def test_every_launch_gets_pdl_from_one_decision(on, monkeypatch):
    pdl, *mods = _mods()
    attn_res = mods[3]
    monkeypatch.setattr(pdl, "enabled", lambda device, family="": on)
    monkeypatch.setitem(attn_res._NUM_SMS, torch.device("cpu"), 132)  # the split schedule's residency check
    calls = _catch(monkeypatch, mods)
    for call in _wrapper_calls():
        call()
    for name, kw in calls:
        assert kw.get("PDL") is on, (name, kw)
        assert kw.get("launch_pdl", False) is on, (name, kw)
        if name in ("_gemv_dot_kernel", "_gemv_fma_kernel"):
            assert kw["PREFETCH"] == "regs", kw  # the default mode: compiled with or without PDL (then a peel)
    assert {name for name, _ in calls} == {
        "_rms_norm_kernel", "_gated_activation_kernel", "_conv_kernel", "_state_kernel", "_gemv_dot_kernel",
        "_gemv_fma_kernel", "_splitk_reduce_kernel", "_attn_res_split_kernel", "_attn_res_tile_kernel",
        "_attn_res_online_kernel"}


def test_enabled_off_the_gpu_and_env_switch(monkeypatch):
    pdl = _mods()[0]
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu) and pdl.launch_kwargs(cpu) == {} and pdl.kernel_kwargs(cpu) == {"PDL": False}
    monkeypatch.setenv("TOKENSPEED_PDL", "0")
    monkeypatch.setitem(pdl._capable, 0, True)  # a capable device 0, switched off by the environment
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    assert pdl.enabled(torch.device("cuda", 0))
    assert pdl.kernel_kwargs(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}


def test_pdl_families_from_the_environment(monkeypatch):
    """TOKENSPEED_PDL: unset / "1" every family, "0" none, "a,b" only those, "-a" all but a; typos raise."""
    from tokenspeed.ops.triton import pdl

    assert pdl.family_on("mla", "") and pdl.family_on("mla", "1") and not pdl.family_on("mla", "0")
    assert pdl.family_on("gemv", "gemv,moe") and not pdl.family_on("mla", "gemv,moe")
    assert not pdl.family_on("mla", "-mla,-kda") and pdl.family_on("gemv", "-mla,-kda")
    with pytest.raises(ValueError, match="unknown family"):
        pdl.family_on("gemv", "-mal")
    monkeypatch.setenv("TOKENSPEED_PDL", "gemv")
    assert not pdl.enabled(torch.device("cpu"), "gemv")  # never on the CPU (interpreter)


def test_l2_prefetch_setting_per_kind(monkeypatch):
    from tokenspeed.ops.triton import pdl

    monkeypatch.delenv("TOKENSPEED_L2_PREFETCH", raising=False)
    assert not pdl.l2_prefetch_on() and not pdl.l2_prefetch_on("down")
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "1")
    assert all(pdl.l2_prefetch_on(k) for k in ("", *pdl.L2_PREFETCH_KINDS))
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "down")
    assert pdl.l2_prefetch_on("down") and pdl.l2_prefetch_on() and not pdl.l2_prefetch_on("gate_up")
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "up")
    with pytest.raises(ValueError, match="TOKENSPEED_L2_PREFETCH"):
        pdl.l2_prefetch_on("down")
