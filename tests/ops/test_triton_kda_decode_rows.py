"""The row-chunk KDA decode schedule (`KdaConfig(rows=True)`, ops/triton/kda_decode_rows.py) against the torch
composition: outputs, both pools, idle slots untouched, padding rows, several tokens per sequence, the fused
norm epilogue; and the launches it refuses. Interpreter (fp32) on the CPU, bf16 K3 shapes on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import check, check_poisoned_decode, clone, make
from tests.ops.test_triton_kda_norm_epilogue import check as check_norm
from tests.ops.triton_env import cpu_interp, needs_cuda  # sets up Triton first
from tokenspeed.ops.triton.kda_config import KdaConfig, config_from_label


@cpu_interp
@pytest.mark.parametrize("D,RB", [(16, 4), (32, 8), (32, 32), (64, 16)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_rows_decode_interp(D, RB, lower_bound):
    """Two heads on `check_poisoned_decode`'s batch: several tokens per sequence, a padding row, poisoned idle
    slots and outputs."""
    check_poisoned_decode(KdaConfig(RB, rows=True, num_stages=3), 2, D, lower_bound)


@cpu_interp
def test_rows_norm_epilogue_interp():
    """The fused gated RMSNorm on the row-chunk schedule equals the Triton norm of its plain output bit for bit
    and the reference within 1e-5 (decode and a 3-token sequence beside a padding row)."""
    check_norm([1, 3, 1], 2, 32, slots=[2, -1, 5], config=KdaConfig(8, rows=True))


@cpu_interp
def test_rows_refuses_what_it_cannot_run():
    """Verify (no pool update), a head dim that is not a power of two, and the multi-layer replay are clear
    errors, not a silent fallback; the label round-trips."""
    from tokenspeed.ops.triton.kda_decode import kda_decode

    cfg = KdaConfig(8, rows=True)
    assert config_from_label(cfg.label) == cfg and cfg.label == "bv8-rows-w4"
    inp = make([1, 2], 1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="is for decode"):
        kda_decode(**clone(inp), lower_bound=-5.0, scale=1.0, update_state=False, config=cfg)
    odd = make([1], 1, 48, torch.float32, "cpu")
    with pytest.raises(ValueError, match="power-of-two head dim"):
        kda_decode(**clone(odd), lower_bound=-5.0, scale=1.0, config=KdaConfig(16, rows=True))


@cpu_interp
def test_rows_not_in_the_replay(monkeypatch):
    """The multi-layer replay refuses an explicit row-chunk config, and a decode config forced to it through
    TOKENSPEED_KDA_DECODE leaves the replay on its own schedule (same pools as without the variable)."""
    from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors
    from tokenspeed.ops.triton import kda_config
    from tokenspeed.ops.triton.kda_decode import kda_replay_layers

    def replay(**kw):
        inp = clone(make([1, 1], 1, 64, torch.float32, "cpu"))  # head dim >= 64: the decode table applies
        table = KdaLayerTable.build([KdaLayerTensors(*(inp[k] for k in KdaLayerTensors._fields))] * 2, strict=True)
        kda_replay_layers(table, inp["state_indices"], inp["cu_seqlens"], None, lower_bound=-5.0, **kw)
        return inp["state"], inp["conv_state"]

    with pytest.raises(ValueError, match="not the replay"):
        replay(config=KdaConfig(16, rows=True))
    plain = replay()
    monkeypatch.setenv(kda_config.DECODE_ENV, "bv16-rows-w4")
    forced = replay()
    assert all(torch.equal(a, b) for a, b in zip(plain, forced, strict=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", ["bv32-rows-w4-s3", "bv16-rows-w4-s4", "bv32-rows-w8-s2"])
@pytest.mark.parametrize("lens", [[1] * 3, [2, 1, 4]])
def test_rows_k3_gpu(lens, cfg):
    check(lens, 12, 128, torch.bfloat16, "cuda", config=config_from_label(cfg))


@pytest.mark.gpu
@needs_cuda
def test_rows_96_heads_and_padding_gpu():
    check([1, 1, 1, 1], 96, 128, torch.bfloat16, "cuda", slots=[3, -1, 7, 0], config=KdaConfig(32, rows=True,
                                                                                                  num_stages=3))
