"""Shared by the MoE junction tests: two steps of a tiny model and every layer's residual stream."""

from __future__ import annotations

import torch

from tokenspeed.models import CacheBuffers, ForwardBatch

PAGE = 4


def run_two_steps(model) -> tuple[torch.Tensor, ...]:
    """Logits of a 2-sequence prefill (8 tokens) and a decode step, then every layer's residual stream of the
    decode (fresh cache each call, so two calls are comparable)."""
    n = model.config.num_hidden_layers
    cache = CacheBuffers.allocate(model.config, 8, PAGE, 4, torch.float32)
    pages = [[0, 1], [4, 5]]
    out = []
    with torch.no_grad():
        for tokens, cached in (([[5, 6, 7, 8, 9], [10, 11, 12]], [0, 0]), ([[13], [14]], [5, 3])):
            logits, feats = model(ForwardBatch.build(tokens, cached, pages, [1, 3], PAGE), cache,
                                  capture_layers=tuple(range(1, n + 1)))
            out.append(logits)
    return (*out, *feats)
