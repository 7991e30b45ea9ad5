"""The grouped-GEMM routed-experts path (`tokenspeed.ops.cuda.moe_grouped`) against the reference.

Scenarios (CPU, and CUDA when present; torch's grouped GEMM has a CPU path):
* silu and situ, fp32 rel < 1e-5 and bf16 exact-ish (< 1e-2) against `ops.reference.moe.moe_experts`, with ids
  outside [0, E) (-1 and E) mixed in; a token whose ids are all non-local gets zeros; experts with no tokens;
  a T=1 call; the result is x.dtype [T, D] and the inputs are not mutated.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err
from tokenspeed.ops.cuda import moe_grouped
from tokenspeed.ops.reference import moe as ref_moe
from tokenspeed.ops.reference.activation import Activation

pytestmark = pytest.mark.skipif(not moe_grouped.available(), reason="torch without _grouped_mm")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make(T: int, D: int, I: int, E: int, k: int, dtype: torch.dtype, dev: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dev, dtype)
    w1, w3 = (torch.randn(E, I, D, generator=g).mul(D**-0.5).to(dev, dtype) for _ in range(2))
    w2 = torch.randn(E, D, I, generator=g).mul(I**-0.5).to(dev, dtype)
    tw = torch.rand(T, k, generator=g).to(dev)
    ids = torch.randint(-1, E + 1, (T, k), generator=g).to(dev)
    return x, w1, w3, w2, tw, ids


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("kind", ["silu", "situ"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_reference(dev: str, kind: str, dtype: torch.dtype, tol: float) -> None:
    if dev == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA grouped GEMM is bf16 only")
    act = Activation(kind)
    x, w1, w3, w2, tw, ids = make(53, 64, 32, 12, 4, dtype, dev)
    ids[7] = -1  # all non-local
    ids[ids == 5] = 6  # expert 5 gets no tokens
    before = [t.clone() for t in (x, w1, w3, w2, tw, ids)]
    got = moe_grouped.moe_experts(x, w1, w3, w2, tw, ids, act)
    want = ref_moe.moe_experts(x, w1, w3, w2, tw, ids, act)
    assert got.dtype == x.dtype and got.shape == (53, 64)
    assert rel_err(got.float(), want.float()) < tol
    assert (got[7] == 0).all()
    for a, b in zip(before, (x, w1, w3, w2, tw, ids)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dev", DEVICES)
def test_single_token(dev: str) -> None:
    dtype = torch.bfloat16
    x, w1, w3, w2, tw, ids = make(1, 32, 16, 4, 2, dtype, dev, seed=3)
    ids = torch.tensor([[2, 0]], device=dev)
    got = moe_grouped.moe_experts(x, w1, w3, w2, tw, ids, Activation("silu"))
    want = ref_moe.moe_experts(x, w1, w3, w2, tw, ids, Activation("silu"))
    assert rel_err(got.float(), want.float()) < 1e-2
