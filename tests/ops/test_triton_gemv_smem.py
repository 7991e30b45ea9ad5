"""The GEMV kind "smem" (`tokenspeed/ops/triton/gemv_smem.py`: weight rows copied into shared memory before the
PDL wait, Gluon on sm_90) against F.linear, and its routing.

On an sm_90 GPU with Gluon of `gemv_smem.TRITON_VERSIONS` (gpu marker): outputs from poisoned memory within bf16
tolerance of F.linear over M 1-4, N that leave the last row tile short, K of one and many chunks (kimi-linear's
o_proj / in_proj, K3's 7168), one program a tile and persistent grids with 1-3 buffers (programs with more tiles
than buffers refill them), fp32 output, PDL on and off, and replays of a CUDA graph where a PDL producer writes x
just before (the kernel reads x only after its wait). On the CPU: the host's acceptance rules and the fallback
to the Triton kernels where the kind cannot run (the interpreter, fp32, M > 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err
from tokenspeed.ops import dispatch
from tokenspeed.ops.triton import gemv, gemv_smem
from tokenspeed.ops.triton.gemv import GemvConfig

needs_hopper_gluon = pytest.mark.skipif(
    not (torch.cuda.is_available() and gemv_smem._hopper(torch.device("cuda"))),
    reason="needs an sm_90 GPU and Gluon of TRITON_VERSIONS")

# (block_n, block_k, num_warps, num_stages, programs_per_sm)
CONFIGS = [(8, 256, 4, 1, 0), (4, 256, 4, 1, 0), (2, 256, 2, 1, 0), (16, 256, 8, 1, 0), (8, 256, 4, 2, 1),
           (4, 256, 4, 3, 1), (8, 256, 4, 1, 2), (4, 512, 4, 2, 1)]


def _config(cfg: tuple) -> dict:
    bn, bk, warps, stages, per_sm = cfg
    return {"kind": "smem", "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
            "programs_per_sm": per_sm}


def test_config_validation():
    assert GemvConfig("smem", 8, 256, programs_per_sm=2).validate().programs_per_sm == 2
    with pytest.raises(ValueError, match="programs_per_sm"):
        GemvConfig("smem", 8, 256, programs_per_sm=-1).validate()
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig("smem", 6, 256).validate()


def test_table_carries_programs_per_sm():
    raw = {"dtypes": ["bfloat16"], "entries": {"2304,4096": {"1": {"kernel": "triton", **_config((8, 256, 4, 2, 1)),
                                                                  "split_k": 1, "us": 2.0}}}}
    table = dispatch.parse_linear_table(raw)
    cfg = dispatch.linear_route(1, 2304, 4096, torch.bfloat16, table)
    assert cfg == {**_config((8, 256, 4, 2, 1)), "split_k": 1}
    assert GemvConfig(**cfg).validate().kind == "smem"


def test_unusable_reasons_on_the_host():
    x, w = torch.randn(1, 4096, dtype=torch.bfloat16), torch.randn(2304, 4096, dtype=torch.bfloat16)
    assert "sm_90" in gemv_smem.unusable_reason(x, w, 8, 256, 4, 1)
    assert gemv_smem.smem_bytes(1, 4096, 2, 8, 1) == (8 + 1) * 4096 * 2
    assert gemv_smem.smem_bytes(3, 2304, 2, 4, 3) == (12 + 4) * 2304 * 2
    assert gemv_smem.warps_split(2, 4) == (2, 2) and gemv_smem.warps_split(16, 8) == (8, 1)


@cpu_interp
@pytest.mark.parametrize("M", [1, 3, 6])
def test_falls_back_where_it_cannot_run(M):
    """In the interpreter (and for fp32, M > 4) kind "smem" runs `default_config`'s Triton kernel: same result."""
    x, w = torch.randn(M, 512), torch.randn(40, 512)
    y = gemv.gemv(x, w, **_config((8, 256, 4, 1, 0)))
    assert rel_err(y, F.linear(x, w)) < 1e-5


def _poisoned(M: int, N: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((M, N), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("M,N,K", [(1, 2304, 4096), (2, 1000, 4096), (3, 12576, 2304), (4, 301, 7168),
                                   (1, 6720, 2304), (1, 37, 512)])
@pytest.mark.parametrize("pdl_on", [True, False])
def test_matches_linear_on_the_gpu(M, N, K, cfg, pdl_on, monkeypatch):
    monkeypatch.setenv("TOKENSPEED_PDL", "1" if pdl_on else "0")
    x = torch.randn(M, K, device="cuda").bfloat16()
    w = torch.randn(N, K, device="cuda").bfloat16()
    kw = _config(cfg)
    why = gemv_smem.unusable_reason(x, w, kw["block_n"], kw["block_k"], kw["num_warps"], kw["num_stages"])
    if why is not None:
        pytest.skip(why)
    ref = F.linear(x.float(), w.float())
    out = _poisoned(M, N, torch.bfloat16)
    assert gemv.gemv(x, w, out=out, **kw) is out
    assert not out.isnan().any()
    assert rel_err(out.float(), ref) < 1e-2
    out32 = _poisoned(M, N, torch.float32)
    gemv.gemv(x, w, out=out32, out_dtype=torch.float32, **kw)
    assert rel_err(out32, ref) < 1e-5


@pytest.mark.gpu
@needs_cuda
@needs_hopper_gluon
@pytest.mark.parametrize("cfg", [(8, 256, 4, 1, 0), (4, 256, 4, 2, 1)])
def test_graph_after_a_pdl_producer(cfg, monkeypatch):
    """A CUDA graph of (producer writes x, smem GEMV reads it), replayed on new inputs: the GEMV must see each
    replay's x, i.e. read it only after its PDL wait, while its weights were copied before."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gemv_pdl_chain_h200 import produce

    monkeypatch.setenv("TOKENSPEED_PDL", "1")
    M, N, K = 1, 2304, 4096
    w = torch.randn(N, K, device="cuda").bfloat16()
    src = torch.randn(M, K, device="cuda").bfloat16()
    x = torch.zeros_like(src)
    out = _poisoned(M, N, torch.bfloat16)
    kw = _config(cfg)
    for _ in range(2):  # compile outside the capture
        produce(src, x, 20000, True)
        gemv.gemv(x, w, out=out, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        produce(src, x, 20000, True)
        gemv.gemv(x, w, out=out, **kw)
    for _ in range(3):
        src.copy_(torch.randn(M, K, device="cuda").bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out.float(), F.linear(src.float(), w.float())) < 1e-2


def test_copy_delay_setting(monkeypatch):
    monkeypatch.delenv(gemv_smem.DELAY_ENV, raising=False)
    assert gemv_smem.copy_delay() == 0
    monkeypatch.setenv(gemv_smem.DELAY_ENV, "4000")
    assert gemv_smem.copy_delay() == 4000
    for bad in ("-1", "2us"):
        monkeypatch.setenv(gemv_smem.DELAY_ENV, bad)
        with pytest.raises(ValueError, match=gemv_smem.DELAY_ENV):
            gemv_smem.copy_delay()
