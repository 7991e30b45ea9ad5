"""`ModelRunner.copy_states`: the batched gather-scatter path gives exactly the state of applying the copies one by
one, in order, for random lists (zeroing, copies, chains, repeated destinations)."""

from __future__ import annotations

import random

import torch

from tokenspeed.executor.runner import ModelRunner
from tokenspeed.models import CacheBuffers
from tokenspeed.scheduler.batch import ZERO_SLOT


def _runner() -> ModelRunner:
    gen = torch.Generator().manual_seed(0)
    runner = ModelRunner.__new__(ModelRunner)  # only the buffers matter here
    runner.device = torch.device("cpu")
    runner.buffers = CacheBuffers(
        page_size=4, mla_latent=[],
        kda_conv=[torch.randn(6, 3, 2, generator=gen) for _ in range(2)],
        kda_recurrent=[torch.randn(6, 2, 2, 2, generator=gen) for _ in range(2)],
    )
    return runner


def test_batched_copies_equal_sequential() -> None:
    rng = random.Random(0)
    batched_seen = 0
    for _ in range(300):
        copies = [(rng.choice([ZERO_SLOT, 0, 1, 2, 3, 4, 5]), rng.randint(0, 5)) for _ in range(rng.randint(1, 4))]
        fast, slow = _runner(), _runner()
        fast.copy_states(copies)
        for src, dst in copies:
            slow._copy_sequential(src, dst)
        pools = zip(fast.buffers.kda_conv + fast.buffers.kda_recurrent,
                    slow.buffers.kda_conv + slow.buffers.kda_recurrent, strict=True)
        assert all(torch.equal(a, b) for a, b in pools), copies
        dsts = [d for _, d in copies]
        batched_seen += len(copies) > 1 and len(set(dsts)) == len(dsts) and not set(dsts) & {s for s, _ in copies}
    assert batched_seen > 20  # the batched path was exercised, not only the fallback
