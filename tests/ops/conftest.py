"""Fixtures of the op tests (no Triton import here: `triton_env` must set up the interpreter first)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poison_empty(monkeypatch):
    """Floating torch.empty allocations start as NaN (buffers the op must fully write before reading)."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
