"""Benchmark routing (`ops.moe_simulate_routing`): the routed ids of a routing replaced in place by k consecutive
experts (mod E) from a hash of each row's first weight, its row index and a salt.

What a benchmark relies on: rows whose router outputs are identical still spread over the experts as uniform
routing does (distinct experts of a batch near E (1 - (1 - k/E)^T), each expert's load near T k / E); every row's k
ids are distinct and in [0, E); a folded shared expert's column and the weights are untouched; another salt (a
layer) gives another choice; the Triton kernel writes exactly the reference's ids (CPU interpreter), on a poisoned
tensor, and runs on the GPU inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda  # first: sets up Triton
from tokenspeed import ops
from tokenspeed.ops.reference.moe import simulate_uniform_routing as ref_simulate

E, K = 256, 8


def _routing(T: int, device: str = "cpu", shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and ids of T rows that a random-weight router sent to the same experts (identical rows up to the
    last bits of the weights), with the folded shared expert's column (id E, weight 1) when `shared`."""
    w = torch.full((T, K + shared), 1.0 / K, device=device)
    w[:, 0] += torch.arange(T, device=device) * 1e-9  # correlated tokens: equal up to rounding
    ids = torch.arange(K + shared, device=device).repeat(T, 1)
    if shared:
        w[:, K], ids[:, K] = 1.0, E
    return w, ids


def test_rows_with_one_router_choice_spread_like_uniform_routing() -> None:
    for T in (4, 16, 64, 512):
        w, ids = _routing(T)
        before = w.clone()
        out = ref_simulate(w, ids, K, E, salt=3)
        assert out is ids
        routed = ids[:, :K]
        assert ((routed >= 0) & (routed < E)).all()
        assert all(len(set(r)) == K for r in routed.tolist())  # distinct within a row
        assert (ids[:, K] == E).all() and torch.equal(w, before)  # shared column and weights kept
        expected = E * (1 - (1 - K / E) ** T)
        assert abs(routed.unique().numel() - expected) < 0.15 * expected + 2, (T, routed.unique().numel(), expected)
    load = torch.bincount(routed.flatten(), minlength=E).float()  # T = 512: 16 rows per expert on average
    assert load.max() < 3 * load.mean()


def test_salt_changes_the_choice_and_the_choice_is_deterministic() -> None:
    a = ref_simulate(*_routing(64), K, E, salt=0)
    b = ref_simulate(*_routing(64), K, E, salt=1)
    assert not torch.equal(a, b)
    assert torch.equal(a, ref_simulate(*_routing(64), K, E, salt=0))


@cpu_interp
@pytest.mark.parametrize("T,k,e,shared", [(1, 8, 256, True), (37, 8, 256, False), (5, 6, 20, True)])
def test_triton_matches_reference(T: int, k: int, e: int, shared: bool) -> None:
    from tokenspeed.ops.triton.moe_route import simulate_uniform_routing

    w = torch.rand(T, k + shared)
    ids = torch.full((T, k + shared), -7, dtype=torch.int64)
    if shared:
        ids[:, k] = e
    ref = ref_simulate(w, ids.clone(), k, e, salt=11)
    got = simulate_uniform_routing(w, ids, k, e, salt=11)
    assert got is ids and torch.equal(got, ref)


@pytest.mark.gpu
@needs_cuda
def test_triton_in_a_cuda_graph_gpu() -> None:
    w, ids = _routing(64, "cuda")
    ref = ref_simulate(w.cpu(), ids.cpu().clone(), K, E, salt=5)
    ops.moe_simulate_routing(w, ids, K, E, 5)  # compile outside the capture
    ids.copy_(_routing(64, "cuda")[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_simulate_routing(w, ids, K, E, 5)
    ids.copy_(_routing(64, "cuda")[1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), ref)
