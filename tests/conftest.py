"""Shared test helpers: tiny models are built in code; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

# The suite runs many tiny forwards on a 2-core machine: one intra-op thread avoids oversubscription stalls.
torch.set_num_threads(1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (fp64)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def per_token_rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] max_v |a - b| / max |b| for logits [T, vocab]."""
    a, b = a.double(), b.double()
    return (a - b).abs().amax(-1) / b.abs().max().clamp_min(1e-30)


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: every token within 1e-4 relative. bf16: within 2e-2 relative for at least 80% of tokens.

    In bf16 two computations of the same function round differently (chunked vs recurrent KDA, GEMMs of other
    row counts). Where a MoE router has two near-tied experts (seen: scores 0.31925 vs 0.31920) that noise flips
    the top-k choice and moves that token's logits by up to ~30%, and through the MLA cache a little of the
    tokens after it. Those flips are the exception allowed here; the fp32 runs show the math itself is exact.
    """
    err = per_token_rel_err(got, ref)
    if dtype == torch.float32:
        assert err.max().item() < 1e-4, f"max relative error {err.max().item():.3g}"
        return
    frac = (err < 2e-2).double().mean().item()
    assert frac >= 0.8, f"only {frac:.0%} of tokens within 2e-2 (errors {err.tolist()})"
    assert err.median().item() < 1e-2, f"median relative error {err.median().item():.3g}"
