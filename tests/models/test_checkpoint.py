"""Checkpoint round trips and failures.

Scenarios: a written-then-loaded tiny checkpoint (both presets; single file and sharded with an index) gives the
same logits as the in-memory model; official names are used (language_model. prefix for kimi_k3, per-expert
w1/w2/w3, separate q/k/v and conv tensors); A_log is accepted in its three stored shapes; vision tensors are
skipped; a missing, mis-shaped or unexpected tensor fails with the names in the message; a quantized checkpoint
fails with a ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import rel_err
from tokenspeed.errors import CheckpointError, ConfigError
from tokenspeed.models import forward_logits, load_model, write_tiny_checkpoint

IDS = [5, 17, 250, 3, 99, 42, 7, 300, 11, 64, 128, 1]


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_round_trip_gives_same_logits(tmp_path: Path, preset: str, num_shards: int) -> None:
    write_tiny_checkpoint(tmp_path, preset, torch.float32, seed=7, num_shards=num_shards)
    if num_shards > 1:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path, dtype=torch.float32)
    in_memory = load_model(preset, dtype=torch.float32, load_format="dummy", seed=7)
    assert rel_err(forward_logits(loaded, IDS), forward_logits(in_memory, IDS)) == 0.0


def test_official_names(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-k3")
    names = set(load_file(tmp_path / "model.safetensors"))
    kda, mla, moe = "language_model.model.layers.0.", "language_model.model.layers.2.", "language_model.model.layers.1."
    for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj",
              "q_conv1d", "k_conv1d", "v_conv1d", "o_norm"):
        assert f"{kda}self_attn.{n}.weight" in names
    for n in ("A_log", "dt_bias"):
        assert f"{kda}self_attn.{n}" in names
    for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "g_proj", "o_proj"):
        assert f"{mla}self_attn.{n}.weight" in names
    for n in ("gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
              "routed_expert_up_proj.weight", "routed_expert_norm.weight", "experts.7.w1.weight",
              "experts.0.w2.weight", "experts.3.w3.weight", "shared_experts.gate_proj.weight"):
        assert f"{moe}block_sparse_moe.{n}" in names
    for n in ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"):
        assert f"{kda}{n}.weight" in names
    for n in ("model.embed_tokens.weight", "model.norm.weight", "model.output_attn_res_norm.weight",
              "model.output_attn_res_proj.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight"):
        assert f"language_model.{n}" in names
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors[f"{kda}self_attn.q_conv1d.weight"].shape == (32, 1, 4)
    assert tensors[f"{kda}self_attn.A_log"].dtype == torch.float32


def _edit(path: Path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("shape", [(2,), (16,), (1, 1, 2, 1)])
def test_a_log_shapes_are_accepted(tmp_path: Path, shape: tuple[int, ...]) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-kimi-linear", seed=1)
    name = "model.layers.0.self_attn.A_log"
    values = torch.tensor([0.5, 1.5])

    def set_a_log(t):
        stored = torch.zeros(shape)
        stored.view(-1)[:2] = values
        t[name] = stored

    _edit(tmp_path, set_a_log)
    model = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(model.model.layers[0].self_attn.A_log, values)


def test_vision_tensors_are_skipped(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-k3")
    _edit(tmp_path, lambda t: t.update({"vision_tower.patch_embed.weight": torch.zeros(2, 2),
                                        "mm_projector.proj.weight": torch.zeros(2)}))
    load_model(tmp_path, dtype=torch.float32)


def test_corrupted_checkpoint_names_every_problem(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-kimi-linear")
    missing = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    wrong = "model.layers.2.self_attn.kv_b_proj.weight"
    extra = "model.layers.9.mlp.mystery.weight"

    def corrupt(t):
        del t[missing]
        t[wrong] = torch.zeros(3, 3)
        t[extra] = torch.zeros(1)

    _edit(tmp_path, corrupt)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path, dtype=torch.float32)
    msg = str(info.value)
    assert "1 missing" in msg and missing in msg
    assert "1 mis-shaped" in msg and wrong in msg and "(3, 3)" in msg
    assert "1 unexpected" in msg and extra in msg


def test_mis_shaped_combined_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-k3")
    name = "language_model.model.layers.0.self_attn.k_proj.weight"
    _edit(tmp_path, lambda t: t.update({name: torch.zeros(31, 64)}))
    with pytest.raises(CheckpointError, match="q_proj.weight"):
        load_model(tmp_path, dtype=torch.float32)


def test_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-kimi-linear")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="compressed-tensors"):
        load_model(tmp_path)
    load_model(tmp_path, load_format="dummy")  # the geometry still works with random weights


def test_bf16_load_keeps_fp32_islands(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-k3", dtype=torch.bfloat16)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.A_log.dtype == attn.dt_bias.dtype == attn.conv_weight.dtype == torch.float32
    assert attn.in_proj.weight.dtype == attn.f_b_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
