"""Tensor parallelism on the CPU: two gloo processes, each loading its shard, give the single-process logits.

Scenarios (fp32, both presets): KDA heads, conv channels, A_log/dt_bias, MLA heads, dense/shared MLP and expert
intermediate dims are split over 2 ranks by the loader (the KDA merged input projection per part: q/k/v/g/b
sharded, f_a/g_a replicated); row-parallel outputs are all-reduced.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import rel_err
from tokenspeed.distributed import ParallelContext
from tokenspeed.models import forward_logits, load_model, write_tiny_checkpoint

IDS = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30, 40, 50]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel = ParallelContext(tp_size=world, tp_rank=rank, group=dist.group.WORLD)
        model = load_model(ckpt, dtype=torch.float32, parallel=parallel)
        attn = model.model.layers[0].self_attn
        rows = {name: attn.in_proj.part_weight(name).shape[0] for name in attn.in_proj.slices}
        result = {"logits": forward_logits(model, IDS), "kda_rows": rows}
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_tp2_matches_single_process(tmp_path: Path, preset: str) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", preset, torch.float32, seed=2)
    expected = forward_logits(load_model(ckpt, dtype=torch.float32), IDS)
    mp.spawn(_worker, args=(2, _free_port(), str(ckpt), str(tmp_path)), nprocs=2, join=True)
    config = load_model(preset, load_format="dummy").config
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        rows = result["kda_rows"]  # the merged KDA input projection: heads really sharded, f_a / g_a replicated
        assert rows["q_proj"] == rows["k_proj"] == rows["v_proj"] == config.kda_num_heads * config.kda_head_dim // 2
        assert rows["b_proj"] == config.kda_num_heads // 2 and rows["f_a_proj"] == config.kda_head_dim
        assert rows.get("g_a_proj", config.kda_head_dim) == config.kda_head_dim
        assert rel_err(result["logits"], expected) < 1e-5
