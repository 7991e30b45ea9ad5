"""The MLA layer's merged input projection (`q_kv_a_proj`: q_proj and kv_a_proj_with_mqa as one GEMM, no q-LoRA).

* Checkpoints keep the two official names: a written checkpoint has `q_proj.weight` and `kv_a_proj_with_mqa.weight`
  (and no merged name); loading a checkpoint written with independent random tensors under those names puts them in
  the merged weight's parts, bit for bit; tensor parallelism (rank 1 of 2, loaded without processes): the q part
  holds that rank's heads of q_proj, the kv_a part all of kv_a_proj_with_mqa.
* Outputs: `_project` (one `ops.linear` call) gives q [T, H, nope + rope] and kv_a [T, kv_lora + rope] as strided
  views of one output, equal to the separate projections x @ W^T; the whole layer (prefill, decodes, verify; the
  reference ops, and the Triton ops in the interpreter with the fused decode on) gives the outputs and cache of the
  same layer fed contiguous separate projections.
* The q-LoRA config (tiny-k3) keeps its separate projections.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import rel_err

# tests.ops.triton_env sets up Triton (the interpreter) before anything imports it
from tests.ops.triton_env import cpu_interp
from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models import load_model, write_tiny_checkpoint

PRESET = "tiny-kimi-linear"
Q, KV = "q_proj", "kv_a_proj_with_mqa"


def _mla_layers(model) -> list:
    return [model.model.layers[i].self_attn for i in model.config.mla_layers]


def _random_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny-kimi-linear checkpoint whose MLA q_proj / kv_a_proj_with_mqa tensors are replaced by fresh random
    ones (not what the merged model wrote); returns (dir, {name: tensor} of those)."""
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", PRESET, torch.float32, seed=3)
    tensors = load_file(ckpt / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    fresh = {k: torch.randn(v.shape, generator=g) for k, v in tensors.items()
             if k.endswith((f".{Q}.weight", f".{KV}.weight")) and ".self_attn." in k}
    save_file({**tensors, **fresh}, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return ckpt, fresh


def test_checkpoint_keeps_the_official_names(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", PRESET, torch.float32, seed=3)
    names = set(load_file(ckpt / "model.safetensors"))
    model = load_model(ckpt, dtype=torch.float32)
    for i in model.config.mla_layers:
        assert {f"model.layers.{i}.self_attn.{Q}.weight", f"model.layers.{i}.self_attn.{KV}.weight"} <= names
    assert not any("q_kv_a_proj" in n for n in names)
    assert all(hasattr(a, "q_kv_a_proj") and not hasattr(a, Q) and not hasattr(a, KV) for a in _mla_layers(model))


def test_merged_projection_loads_the_separate_tensors(tmp_path: Path) -> None:
    ckpt, fresh = _random_checkpoint(tmp_path)
    model = load_model(ckpt, dtype=torch.float32)
    for i, a in zip(model.config.mla_layers, _mla_layers(model), strict=True):
        for name in (Q, KV):
            assert torch.equal(a.projection_weight(name), fresh[f"model.layers.{i}.self_attn.{name}.weight"])
        w = a.q_kv_a_proj.weight
        assert a.projection_weight(Q).data_ptr() == w.data_ptr()  # parts are views of the one merged weight


def test_merged_projection_tensor_parallel_shards(tmp_path: Path) -> None:
    """Rank 1 of 2: q_proj's second half of heads (its rows), kv_a_proj_with_mqa replicated."""
    ckpt, fresh = _random_checkpoint(tmp_path)
    model = load_model(ckpt, dtype=torch.float32, parallel=ParallelContext(tp_size=2, tp_rank=1))
    for i, a in zip(model.config.mla_layers, _mla_layers(model), strict=True):
        wq, wkv = (fresh[f"model.layers.{i}.self_attn.{n}.weight"] for n in (Q, KV))
        assert a.num_heads == model.config.num_attention_heads // 2
        assert torch.equal(a.projection_weight(Q), wq.chunk(2, dim=0)[1])
        assert torch.equal(a.projection_weight(KV), wkv)


def test_project_is_one_linear_of_strided_views(monkeypatch, tmp_path: Path) -> None:
    ckpt, fresh = _random_checkpoint(tmp_path)
    model = load_model(ckpt, dtype=torch.float32)
    i, a = model.config.mla_layers[0], _mla_layers(model)[0]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    calls = []
    linear = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *args, **kw: calls.append(args[1].shape) or linear(*args, **kw))
    q, kv_a = a._project(x)
    assert calls == [a.q_kv_a_proj.weight.shape]  # one GEMM
    width = a.q_kv_a_proj.weight.shape[0]
    assert q.shape == (5, a.num_heads, a.nope + a.rope) and q.stride() == (width, a.nope + a.rope, 1)
    assert kv_a.shape == (5, a.kv_lora_rank + a.rope) and kv_a.stride() == (width, 1)
    wq, wkv = (fresh[f"model.layers.{i}.self_attn.{n}.weight"] for n in (Q, KV))
    assert rel_err(q.reshape(5, -1), x @ wq.t()) < 1e-6
    assert rel_err(kv_a, x @ wkv.t()) < 1e-6


def _separate_project(a, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's projections as two separate contiguous GEMMs (what the unmerged layer computed)."""
    wq, wkv = a.projection_weight(Q).clone(), a.projection_weight(KV).clone()
    return (x @ wq.t()).view(x.shape[0], a.num_heads, a.nope + a.rope), x @ wkv.t()


def _layer_steps(monkeypatch, separate: bool):
    from tests.models.test_mla_triton_path import _layer, _steps

    model, attn = _layer(False)
    if separate:
        monkeypatch.setattr(attn, "_project", lambda x: _separate_project(attn, x))
    return _steps(model, attn)


def _assert_same_layer(got, ref) -> None:
    (outs, cache), (ref_outs, ref_cache) = got, ref
    for o, r in zip(outs, ref_outs, strict=True):
        assert rel_err(o, r) < 1e-5
    assert rel_err(cache.nan_to_num(0.0), ref_cache.nan_to_num(0.0)) < 1e-5


def test_layer_matches_separate_projections_reference(monkeypatch) -> None:
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    ref = _layer_steps(monkeypatch, separate=True)
    monkeypatch.undo()
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    _assert_same_layer(_layer_steps(monkeypatch, separate=False), ref)


@cpu_interp
def test_layer_matches_separate_projections_triton(monkeypatch) -> None:
    """Through the Triton ops (fused decode on): the strided q / kv_a views feed the store + absorption kernel and
    mla_decode's q_rope as the contiguous separate projections do."""
    from tokenspeed.ops.triton import mla_decode as dec

    monkeypatch.setenv("TOKENSPEED_MLA_FUSED", "1")  # fused decode at any batch size
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setattr(dec, "DEFAULT_WAVES", 0.06)  # a fast interpreter: few split slots
    ref = _layer_steps(monkeypatch, separate=True)
    got = _layer_steps(monkeypatch, separate=False)
    _assert_same_layer(got, ref)


def test_q_lora_keeps_separate_projections() -> None:
    model = load_model("tiny-k3", dtype=torch.float32, load_format="dummy")
    for a in _mla_layers(model):
        assert not hasattr(a, "q_kv_a_proj") and hasattr(a, "q_a_proj") and hasattr(a, KV)
        assert a.projection_weight(KV) is a.kv_a_proj_with_mqa.weight
        x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        q, kv_a = a._project(x)
        assert q.shape == (3, a.num_heads, a.nope + a.rope) and kv_a.is_contiguous()
        assert torch.equal(kv_a, a.kv_a_proj_with_mqa(x))
