"""The start-up warm-up's mixed steps reach every fused-KDA launch variant that serving's committing mixed steps
(decodes beside one short prompt tail) select on the benchmark geometry, so none compiles mid-serve.

Host-side only: the variant of a committing `kda_decode` launch is fixed by its launch constants (`_split`: the
config row for N * H (sequence, head) pairs, tiles, stages, the window flag) and the fused norm's rows per step;
this computes them for kimi-linear-48b-a3b's 32 KDA heads of dim 128 the way the launch does. The full-scale
swe-smith runs compiled one such variant mid-serve (BV 16 at 3+ sequences) while the warm-up ran its mixed steps
as verifications; a new `MULTI_TABLE` row would need a warm-up step that reaches it.
"""

from __future__ import annotations

import tests.ops.triton_env  # noqa: F401 - first: the Triton interpreter on a machine without CUDA
from tokenspeed.engine.core import WARM_UP_LONG_TAILS, WARM_UP_MIXED
from tokenspeed.models.kimi.kda import FUSED_MAX_TAIL_CUDA
from tokenspeed.ops.triton.kda_decode import _split, norm_rows

H, D = 32, 128  # kimi-linear-48b-a3b's KDA heads, one GPU
MAX_NUM_SEQS = 32  # the swe-smith server's


def _committing_variant(qlens: tuple[int, ...]) -> tuple:
    """The launch constants of a committing fused-KDA step with these new tokens per sequence (several tokens in
    some sequence: never the WY verify kernels, which do not commit)."""
    n, t = len(qlens), sum(qlens)
    opts = _split(n * H, D, -(-t // n), None, None, None, None, None, None)
    opts.pop("WY"), opts.pop("KP")
    return tuple(sorted(opts.items())) + (("NORM_ROWS", norm_rows(t, n)),)


def test_warm_up_reaches_every_committing_fused_kda_variant_of_mixed_serving() -> None:
    warmed = {_committing_variant(q) for q in WARM_UP_MIXED if max(q) <= FUSED_MAX_TAIL_CUDA}
    serving = {_committing_variant((1,) * decodes + (tail,))
               for decodes in range(1, MAX_NUM_SEQS) for tail in (2, 4, 17, 100, FUSED_MAX_TAIL_CUDA)}
    missing = serving - warmed
    assert not missing, f"fused-KDA variants no warm-up mixed step compiles: {sorted(missing)}"
    assert len(serving) >= 2  # the table's two rows (split window loop at BV 32 and at BV 16) are both met


def test_warm_up_also_runs_the_chunked_kda_scan_beside_decodes_and_on_a_history() -> None:
    """Tails longer than the fused limit take the chunked scan from cached states: a mixed step and the long-history
    tails must reach it, whatever FUSED_MAX_TAIL_CUDA is set to."""
    assert any(len(q) > 1 and max(q) > FUSED_MAX_TAIL_CUDA for q in WARM_UP_MIXED)
    assert all(t > FUSED_MAX_TAIL_CUDA for t in WARM_UP_LONG_TAILS)
