"""Which KDA path a batch takes (`takes_fused_path`): the fused kernel for decode / verify windows everywhere, and
on CUDA for short prompt tails and steps that mix them with decodes or verify windows; the chunked scan for long
prefill chunks (beside verify windows too) and for everything non-uniform on the CPU (the reference numerics)."""

from __future__ import annotations

import pytest

from tokenspeed.models import ForwardBatch
from tokenspeed.models.kimi import kda
from tokenspeed.models.kimi.kda import takes_fused_path


def _batch(qlens: list[int], verify: bool = False) -> ForwardBatch:
    pages = [[n] for n in range(len(qlens))]
    return ForwardBatch.build([[3] * q for q in qlens], [4] * len(qlens), [[p[0] * 4 + j for j in range(4)]
                              for p in pages], list(range(len(qlens))), 1024, "cpu", verify=verify)


@pytest.mark.parametrize("qlens,verify,on_cuda,fused", [
    ([1, 1, 1], False, False, True),                                   # decode
    ([4, 4], True, False, True),                                       # verify window
    ([kda.FUSED_MAX_QUERY_LEN + 1], False, False, False),              # CPU prefill: chunked
    ([kda.FUSED_MAX_QUERY_LEN + 1], False, True, True),                # CUDA short tail
    ([kda.FUSED_MAX_TAIL_CUDA, 1, 1], False, True, True),              # CUDA tail beside decodes
    ([kda.FUSED_MAX_TAIL_CUDA + 1, 1], False, True, False),            # CUDA long chunk
    ([3, 1], False, False, False),                                     # CPU mixed step
    ([3, 1], True, True, True),                                        # CUDA verify window beside a short tail
    ([kda.FUSED_MAX_VERIFY_TAIL_CUDA, 4], True, True, True),           # tail beside a window: replayed with it
    ([kda.FUSED_MAX_VERIFY_TAIL_CUDA + 1, 4], True, True, False),      # longer chunk beside a window: scratch states
    ([kda.FUSED_MAX_VERIFY_TAIL_CUDA + 1, 1], False, True, True),      # the same tail beside decodes: fused
    ([3, 1], True, False, False),                                      # CPU non-uniform verify: scratch states
])
def test_kda_path_choice(qlens: list[int], verify: bool, on_cuda: bool, fused: bool) -> None:
    assert takes_fused_path(_batch(qlens, verify), on_cuda) is fused
