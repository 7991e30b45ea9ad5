"""EAGLE3-MLA draft model (k3-architecture.md section 4.2).

Scenarios: config parsing (the tiny and K3 presets, no q-LoRA, YaRN names, feature-layer defaults) and every
refusal; write -> load round trips give identical logits (own or target embedding, sharded, `model.` prefix) with
the official tensor names, and broken checkpoints are reported by name; the target features captured during the
target forward equal the AttnRes partial sums P (tiny-k3) / the residual stream h (tiny-kimi-linear) rebuilt from
the sublayer outputs; the draft equals an independent dense implementation of the section 4.2 math; a prefix in one
call equals token by token and chunked through the paged draft cache, also along the engine's chain protocol
(catch-up over target features, then steps on the draft's own hidden); the d2t map and the borrowed lm_head.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import rel_err
from tokenspeed import ops
from tokenspeed.errors import CheckpointError, ConfigError
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model
from tokenspeed.models.eagle3 import (
    Eagle3Draft,
    eagle3_preset_hf_config,
    init_dummy_eagle3_weights,
    load_eagle3_config,
    load_eagle3_draft,
    parse_eagle3_config,
    write_tiny_eagle3_checkpoint,
)
from tokenspeed.models.kimi.moe import SparseMoE
from tokenspeed.models.weights import param_sources

F32 = torch.float32
PAGE = 4
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 11, 64, 128, 1, 77, 400]  # 14 tokens: > 8, the expanded MLA form


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Toy-sized GEMMs: intra-op threads only add synchronisation (seconds per forward on a busy shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def k3() -> torch.nn.Module:
    return load_model("tiny-k3", dtype=F32, load_format="dummy", seed=3)


@pytest.fixture(scope="module")
def kimi_linear() -> torch.nn.Module:
    return load_model("tiny-kimi-linear", dtype=F32, load_format="dummy", seed=4)


_FEATURES: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}


def _target_features(target, ids: list[int], layers) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(logits, features) of one target prefill with capture_layers (memoised: the target forward dominates)."""
    key = (id(target), tuple(ids), tuple(layers))
    if key not in _FEATURES:
        pages = max(1, math.ceil(len(ids) / PAGE))
        cache = CacheBuffers.allocate(target.config, pages, PAGE, 1, F32)
        batch = ForwardBatch.build([ids], [0], [list(range(pages))], [0], PAGE)
        with torch.no_grad():
            _FEATURES[key] = target(batch, cache, capture_layers=layers)
    return _FEATURES[key]


def _draft(target, hf: dict | None = None, seed: int = 1, own_embedding: bool = False) -> Eagle3Draft:
    draft = Eagle3Draft(parse_eagle3_config(hf or eagle3_preset_hf_config("tiny-eagle3")), dtype=F32,
                        own_embedding=own_embedding)
    init_dummy_eagle3_weights(draft, seed)
    draft.bind_target(target)
    return draft.eval()


def _no_qlora() -> dict:
    hf = eagle3_preset_hf_config("tiny-eagle3")
    hf["q_lora_rank"] = None
    hf["rope_scaling"] = None  # plain RoPE on this variant
    return hf


# ----------------------------------------------------------------------------------------------------- config
def test_tiny_preset_parses() -> None:
    c = parse_eagle3_config(eagle3_preset_hf_config("tiny-eagle3"))
    assert (c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.q_lora_rank) == (64, 64, 4, 32)
    assert (c.vocab_size, c.draft_vocab_size, c.lm_head_vocab_size) == (512, 256, 256)
    assert c.aux_layer_ids == (2, 3, 4) and c.fc_in_features == 3 * 64
    assert c.rope_scaling_dict["factor"] == 4.0 and c.rope_theta == 50000.0
    assert c.mla_latent_dim == 32 + 8
    assert c.capture_layers(6) == (2, 3, 4) and c.capture_layers(5) == (2, 3, 4)


def test_k3_preset_and_defaults() -> None:
    hf = eagle3_preset_hf_config("kimi-k3-eagle3-mla")
    c = parse_eagle3_config(hf)
    assert c.mla_latent_dim == 576 and c.fc_in_features == 3 * 7168 and c.capture_layers(93) == (2, 46, 90)
    del hf["eagle_config"]
    assert parse_eagle3_config(hf).capture_layers(93) == (2, 46, 90)  # [2, n // 2, n - 3]
    assert parse_eagle3_config(eagle3_preset_hf_config("kimi-linear-48b-a3b-eagle3")).capture_layers(27) == (2, 13, 24)


def test_optional_fields() -> None:
    hf = eagle3_preset_hf_config("tiny-eagle3")
    for k in ("draft_vocab_size", "target_hidden_size", "architectures"):
        del hf[k]
    hf["q_lora_rank"] = None
    hf["rope_scaling"] = {"rope_type": "deepseek_yarn", "factor": 2.0}
    c = parse_eagle3_config(hf)
    assert c.q_lora_rank is None and c.draft_vocab_size is None and not c.has_own_lm_head
    assert c.lm_head_vocab_size == 512 and c.target_hidden_size == 64
    assert c.rope_scaling_dict["rope_type"] == "yarn"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "architecture"),
        ({"hidden_act": "gelu"}, "SiLU"),
        ({"num_hidden_layers": 2}, "one decoder layer"),
        ({"draft_vocab_size": 600}, "draft_vocab_size"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"type": "yarn"}}, "factor"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"norm_output": True}, "EAGLE3.1"),
        ({"qk_rope_head_dim": 7}, "even"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}}, "non-empty"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "EAGLE3"),
        ({"mla_use_output_gate": True}, "output gate"),
    ],
)
def test_config_errors(change: dict, match: str) -> None:
    hf = {**eagle3_preset_hf_config("tiny-eagle3"), **change}
    with pytest.raises(ConfigError, match=match):
        parse_eagle3_config(hf)


def test_config_errors_against_target(tmp_path: Path, k3) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        load_eagle3_config(tmp_path)
    with pytest.raises(ConfigError, match="outside 1..6"):
        parse_eagle3_config({**eagle3_preset_hf_config("tiny-eagle3"),
                             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 7]}}).capture_layers(6)
    wide = {**eagle3_preset_hf_config("tiny-eagle3"), "target_hidden_size": 128}
    with pytest.raises(ConfigError, match="target_hidden_size"):
        Eagle3Draft(parse_eagle3_config(wide), dtype=F32).bind_target(k3)
    with pytest.raises(ConfigError, match="vocab_size"):
        Eagle3Draft(parse_eagle3_config({**eagle3_preset_hf_config("tiny-eagle3"), "vocab_size": 1024}),
                    dtype=F32).bind_target(k3)


# ----------------------------------------------------------------------------------------------- checkpoints
def _draft_logits(draft: Eagle3Draft, target, ids=PROMPT) -> torch.Tensor:
    _, feats = _target_features(target, ids, draft.capture_layers(target))
    pages = math.ceil(len(ids) / PAGE)
    cache = draft.allocate_cache(pages, PAGE)
    batch = ForwardBatch.build([ids[1:] + [9]], [0], [list(range(pages))], [0], PAGE)
    with torch.no_grad():
        return draft(batch, cache, None, draft.fuse(feats))[0]


@pytest.mark.parametrize("num_shards", [1, 2])
def test_round_trip_own_embedding(tmp_path: Path, k3, num_shards: int) -> None:
    write_tiny_eagle3_checkpoint(tmp_path, seed=5, num_shards=num_shards)
    loaded = load_eagle3_draft(tmp_path, k3, dtype=F32, share_target_embedding=False)
    assert loaded.has_own_embedding
    in_memory = _draft(k3, seed=5, own_embedding=True)
    assert rel_err(_draft_logits(loaded, k3), _draft_logits(in_memory, k3)) == 0.0
    assert torch.equal(loaded.d2t, in_memory.d2t)


def test_round_trip_target_embedding(tmp_path: Path, k3) -> None:
    write_tiny_eagle3_checkpoint(tmp_path, seed=5, with_embedding=False)
    loaded = load_eagle3_draft(tmp_path, k3, dtype=F32)
    assert not loaded.has_own_embedding and not loaded.needs_target
    assert loaded.embed(torch.tensor([3])).data_ptr() != 0
    assert torch.equal(loaded.embed(torch.tensor([3, 7])), k3.model.embed_tokens.weight[[3, 7]])
    in_memory = _draft(k3, seed=5)
    assert rel_err(_draft_logits(loaded, k3), _draft_logits(in_memory, k3)) == 0.0
    # A checkpoint's own embedding is skipped when the target's is shared (the default).
    write_tiny_eagle3_checkpoint(tmp_path / "with", seed=5)
    assert not load_eagle3_draft(tmp_path / "with", k3, dtype=F32).has_own_embedding


def test_official_names(tmp_path: Path) -> None:
    write_tiny_eagle3_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    attn = [f"midlayer.self_attn.{n}.weight" for n in
            ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]
    mlp = [f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    norms = [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    assert set(tensors) == {"fc.weight", "embed_tokens.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                            *attn, *mlp, *norms}
    assert tensors["fc.weight"].shape == (64, 192)
    assert tensors["midlayer.self_attn.q_a_proj.weight"].shape == (32, 128)  # reads 2 * hidden
    assert tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (40, 128)
    assert tensors["midlayer.self_attn.o_proj.weight"].shape == (64, 4 * 16)
    assert tensors["lm_head.weight"].shape == (256, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == 256
    assert torch.equal(tensors["t2d"].nonzero().flatten(), torch.arange(256) + tensors["d2t"])
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]


def test_no_qlora_names(tmp_path: Path) -> None:
    cfg = parse_eagle3_config(_no_qlora())
    # checkpoint names (q_proj is a part of the merged `q_kv_a_proj` parameter)
    names = {n for src in param_sources(Eagle3Draft(cfg, dtype=F32), "") for n in src.hf_names}
    assert "midlayer.self_attn.q_proj.weight" in names and not any("q_a_proj" in n for n in names)


def test_model_prefix_and_full_vocab_without_d2t(tmp_path: Path, k3) -> None:
    write_tiny_eagle3_checkpoint(tmp_path, seed=2)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({(k if k in ("lm_head.weight", "d2t", "t2d") else f"model.{k}"): v for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))
    a = load_eagle3_draft(tmp_path, k3, dtype=F32, share_target_embedding=False)
    assert rel_err(_draft_logits(a, k3), _draft_logits(_draft(k3, seed=2, own_embedding=True), k3)) == 0.0
    # draft_vocab_size == vocab_size: d2t may be absent (identity).
    hf = {**eagle3_preset_hf_config("tiny-eagle3"), "draft_vocab_size": 512}
    full = tmp_path / "full"
    draft = Eagle3Draft(parse_eagle3_config(hf), dtype=F32)
    init_dummy_eagle3_weights(draft, 2)
    from tokenspeed.models.eagle3 import save_eagle3_checkpoint

    save_eagle3_checkpoint(draft, hf, full, write_t2d=False)
    t = load_file(full / "model.safetensors")
    del t["d2t"]
    save_file(t, str(full / "model.safetensors"))
    loaded = load_eagle3_draft(full, k3, dtype=F32)
    assert torch.equal(loaded.to_target_ids(torch.arange(512)), torch.arange(512))


def _edit(path: Path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_broken_checkpoints_are_reported(tmp_path: Path, k3) -> None:
    write_tiny_eagle3_checkpoint(tmp_path)

    def damage(t):
        del t["midlayer.hidden_norm.weight"]
        del t["d2t"]
        t["midlayer.extra.weight"] = torch.zeros(2)
        t["fc.weight"] = torch.zeros(64, 128)

    _edit(tmp_path, damage)
    with pytest.raises(CheckpointError) as e:
        load_eagle3_draft(tmp_path, k3, dtype=F32)
    msg = str(e.value)
    for part in ("2 missing", "midlayer.hidden_norm.weight", "d2t", "1 unexpected", "midlayer.extra.weight",
                 "1 mis-shaped", "fc.weight: expected (64, 192), got (64, 128)"):
        assert part in msg
    write_tiny_eagle3_checkpoint(tmp_path / "bad_map")
    _edit(tmp_path / "bad_map", lambda t: t.__setitem__("d2t", torch.full((256,), 400, dtype=torch.int64)))
    with pytest.raises(CheckpointError, match="d2t maps"):
        load_eagle3_draft(tmp_path / "bad_map", k3, dtype=F32)
    write_tiny_eagle3_checkpoint(tmp_path / "no_embed", with_embedding=False)
    with pytest.raises(RuntimeError, match="bind_target"):
        load_eagle3_draft(tmp_path / "no_embed", dtype=F32).embed(torch.tensor([1]))


# --------------------------------------------------------------------------------------------------- features
def _sublayer_outputs(target, ids) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """(embeddings, [(attn_out, ffn_out) per layer], logits) of a plain forward, recorded with hooks. A MoE layer's
    junction runs unfused here (its output is materialised only then; fused, the same bits)."""
    outs: dict[tuple[int, str], torch.Tensor] = {}
    fused_junction = SparseMoE.forward_add_norm
    SparseMoE.forward_add_norm = lambda self, x, r, n: ops.add_rms_norm(self(x), r, n.weight, n.eps)
    hooks = []
    for i, layer in enumerate(target.model.layers):
        ffn = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        for kind, mod in (("attn", layer.self_attn), ("ffn", ffn)):
            hooks.append(mod.register_forward_hook(lambda m, a, o, key=(i, kind): outs.__setitem__(key, o)))
    pages = math.ceil(len(ids) / PAGE)
    cache = CacheBuffers.allocate(target.config, pages, PAGE, 1, F32)
    try:
        with torch.no_grad():
            logits = target(ForwardBatch.build([ids], [0], [list(range(pages))], [0], PAGE), cache)
    finally:
        SparseMoE.forward_add_norm = fused_junction
        for h in hooks:
            h.remove()
    n = target.config.num_hidden_layers
    emb = target.model.embed_tokens.weight[torch.tensor(ids)]
    return emb, [(outs[(i, "attn")], outs[(i, "ffn")]) for i in range(n)], logits


def test_k3_features_are_attn_res_partial_sums(k3) -> None:
    block = k3.config.attn_res_block_size
    _, sub, plain_logits = _sublayer_outputs(k3, PROMPT)
    layers = (2, 3, 4, 6, 3)  # duplicates allowed; 6 = the last layer
    logits, feats = _target_features(k3, PROMPT, layers)
    assert torch.equal(logits, plain_logits)  # capturing does not change the forward
    for layer, got in zip(layers, feats, strict=True):
        start = (layer - 1) // block * block  # first 0-based layer of the block holding 0-based layer-1
        want = None
        for i in range(start, layer):  # P: the sublayer outputs since that block's snapshot (no embedding)
            for out in sub[i]:
                want = out if want is None else want + out
        assert got.shape == (len(PROMPT), 64)
        assert rel_err(got, want) < 1e-6, layer
    # After 1-based layer 2 (0-based 1): P = attn0 + mlp0 + attn1 + mlp1, as section 4.2 spells it out.
    assert rel_err(feats[0], sub[0][0] + sub[0][1] + sub[1][0] + sub[1][1]) < 1e-6


def test_kimi_linear_features_are_residual_stream(kimi_linear) -> None:
    emb, sub, plain_logits = _sublayer_outputs(kimi_linear, PROMPT)
    layers = (2, 3, 4)
    logits, feats = _target_features(kimi_linear, PROMPT, layers)
    assert torch.equal(logits, plain_logits)
    for layer, got in zip(layers, feats, strict=True):
        want = emb
        for i in range(layer):
            want = want + sub[i][0] + sub[i][1]
        assert rel_err(got, want) < 1e-6, layer


def test_capture_layer_range_and_logits_indices(k3) -> None:
    with pytest.raises(ValueError, match="outside 1..6"):
        _target_features(k3, PROMPT[:4], (0,))
    pages = 1
    cache = CacheBuffers.allocate(k3.config, pages, PAGE, 1, F32)
    batch = ForwardBatch.build([PROMPT[:4]], [0], [[0]], [0], PAGE)
    with torch.no_grad():
        logits, feats = k3(batch, cache, torch.tensor([3]), capture_layers=(2,))
    assert logits.shape == (1, 512) and feats[0].shape == (4, 64)  # features cover every token


# --------------------------------------------------------------------------------------------------- the draft
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_draft(draft: Eagle3Draft, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
    """Section 4.2 written out densely: per-head keys/values, causal softmax, interleaved RoPE; fp32."""
    c, m = draft.config, draft.midlayer
    a, eps = m.self_attn, c.rms_norm_eps
    h_, nope, rope, vd, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    x = torch.cat([_rms(draft.embed(ids), m.input_layernorm.weight, eps), _rms(g, m.hidden_norm.weight, eps)], -1)
    if c.q_lora_rank is not None:
        q = _rms(x @ a.q_a_proj.weight.T, a.q_a_layernorm.weight, eps) @ a.q_b_proj.weight.T
    else:
        q = x @ a.projection_weight("q_proj").T
    q = q.view(-1, h_, nope + rope)
    kv_a = x @ a.projection_weight("kv_a_proj_with_mqa").T
    c_kv, k_pe = _rms(kv_a[:, :r], a.kv_a_layernorm.weight, eps), kv_a[:, r:]
    cos, sin = ops.rope_cos_sin(positions, rope, c.rope_theta, c.rope_scaling_dict)

    def rotate(t):  # t [T, H, rope]: pairs (2i, 2i+1)
        even, odd = t[..., 0::2], t[..., 1::2]
        cc, ss = cos[:, None], sin[:, None]
        return torch.stack([even * cc - odd * ss, even * ss + odd * cc], -1).flatten(-2)

    kv = (c_kv @ a.kv_b_proj.weight.T).view(-1, h_, nope + vd)
    k = torch.cat([kv[..., :nope], rotate(k_pe[:, None]).expand(-1, h_, -1)], -1)
    q = torch.cat([q[..., :nope], rotate(q[..., nope:])], -1)
    scale = 1 / math.sqrt(nope + rope)
    s = c.rope_scaling_dict
    if s and s.get("mscale_all_dim"):
        scale *= (0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1) ** 2
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    t = len(ids)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., nope:]).reshape(t, h_ * vd)
    res = g + o @ a.o_proj.weight.T
    post = _rms(res, m.post_attention_layernorm.weight, eps)
    gate, up = (post @ m.mlp.gate_up_proj.weight.T).chunk(2, -1)
    h = res + (torch.nn.functional.silu(gate) * up) @ m.mlp.down_proj.weight.T
    return draft.head(h), h


@pytest.mark.parametrize("variant", ["tiny", "no_qlora"])
def test_draft_matches_section_4_2(k3, variant: str) -> None:
    draft = _draft(k3, None if variant == "tiny" else _no_qlora())
    _, feats = _target_features(k3, PROMPT, draft.capture_layers(k3))
    g = draft.fuse(feats)
    assert torch.allclose(g, torch.cat(feats, -1) @ draft.fc.weight.T, atol=1e-6)
    ids = PROMPT[1:] + [9]
    pages = math.ceil(len(ids) / PAGE)
    for chunk in (len(ids), 3):  # expanded form over the whole prefix, absorbed form over chunks of 3
        cache = draft.allocate_cache(pages, PAGE)
        logits, hs = [], []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            batch = ForwardBatch.build([part], [start], [list(range(pages))], [0], PAGE)
            with torch.no_grad():
                lo, h = draft(batch, cache, None, g[start:start + chunk])
            logits.append(lo)
            hs.append(h)
        with torch.no_grad():
            ref_logits, ref_h = _reference_draft(draft, torch.tensor(ids), g, torch.arange(len(ids)))
        assert rel_err(torch.cat(hs), ref_h) < 1e-5
        assert rel_err(torch.cat(logits), ref_logits) < 1e-5


@pytest.mark.parametrize("variant", ["tiny", "no_qlora"])
def test_prefix_in_one_call_equals_token_by_token(k3, variant: str) -> None:
    draft = _draft(k3, None if variant == "tiny" else _no_qlora())
    _, feats = _target_features(k3, PROMPT, draft.capture_layers(k3))
    g = draft.fuse(feats)
    ids = PROMPT[1:] + [9]
    pages = math.ceil(len(ids) / PAGE)
    table = [list(reversed(range(pages)))]  # non-contiguous pages
    cache = draft.allocate_cache(pages, PAGE)
    with torch.no_grad():
        full_logits, full_h = draft(ForwardBatch.build([ids], [0], table, [0], PAGE), cache, None, g)
    cache = draft.allocate_cache(pages, PAGE)
    step_logits, step_h = [], []
    for i, tok in enumerate(ids):
        batch = ForwardBatch.build([[tok]], [i], table, [0], PAGE)
        with torch.no_grad():
            lo, h = draft(batch, cache, torch.tensor([tok]), g[i:i + 1])
        step_logits.append(lo)
        step_h.append(h)
    assert rel_err(torch.cat(step_logits), full_logits) < 1e-5
    assert rel_err(torch.cat(step_h), full_h) < 1e-5
    # Positions matter (RoPE): the same inputs one position later give different logits.
    shifted_cache = draft.allocate_cache(pages + 1, PAGE)
    with torch.no_grad():
        shifted, _ = draft(ForwardBatch.build([ids[:1]], [1], [list(range(pages + 1))], [0], PAGE), shifted_cache,
                           None, g[:1])
    assert rel_err(shifted, full_logits[:1]) > 1e-4


def test_chain_protocol_and_mixed_batch(k3) -> None:
    """Catch-up over target features, then 2 steps on the draft's own hidden, for 2 sequences in one batch;
    equal to one call per sequence over all positions with the same hidden inputs."""
    draft = _draft(k3)
    layers = draft.capture_layers(k3)
    seqs = [PROMPT, PROMPT[3:10]]
    bonus = [9, 33]  # the token the target sampled after each prompt
    g = [draft.fuse(_target_features(k3, s, layers)[1]) for s in seqs]
    pages = [math.ceil((len(s) + 3) / PAGE) for s in seqs]
    tables = [list(range(pages[0])), list(range(pages[0], pages[0] + pages[1]))]
    cache = draft.allocate_cache(sum(pages), PAGE)
    # step 1 (catch-up): positions 0..L-1, inputs shifted by one, hidden = fc(features); logits of the last only.
    new = [s[1:] + [b] for s, b in zip(seqs, bonus, strict=True)]
    batch = ForwardBatch.build(new, [0, 0], tables, [0, 0], PAGE)
    last = torch.tensor([len(new[0]) - 1, len(new[0]) + len(new[1]) - 1])
    with torch.no_grad():
        logits, h = draft(batch, cache, None, torch.cat(g), last)
    proposals = [draft.propose(logits)]
    hidden = h[last]
    used_hidden = [[g[0]], [g[1]]]
    used_ids = [list(n) for n in new]
    for _ in range(2):  # steps 2, 3: one token each at the next position, hidden = previous step's h
        toks = proposals[-1].tolist()
        cached = [len(u) for u in used_ids]
        batch = ForwardBatch.build([[t] for t in toks], cached, tables, [0, 0], PAGE)
        with torch.no_grad():
            logits, h = draft(batch, cache, None, hidden)
        for n in range(2):
            used_hidden[n].append(hidden[n:n + 1])
            used_ids[n].append(toks[n])
        proposals.append(draft.propose(logits))
        hidden = h
    chain = torch.stack(proposals, dim=1)  # [2 seqs, 3 draft tokens], target ids
    assert chain.shape == (2, 3) and bool((chain < 512).all())
    for n in range(2):
        ids = used_ids[n]
        solo = draft.allocate_cache(pages[n], PAGE)
        with torch.no_grad():
            lo, _ = draft(ForwardBatch.build([ids], [0], [list(range(pages[n]))], [0], PAGE), solo, None,
                          torch.cat(used_hidden[n]))
        want = draft.propose(lo[len(new[n]) - 1:])
        assert torch.equal(want, chain[n]), (want, chain[n])


# ----------------------------------------------------------------------------------------------- vocabulary
def test_d2t_map(k3) -> None:
    draft = _draft(k3)
    d = torch.arange(256)
    targets = draft.to_target_ids(d)
    assert torch.equal(targets, d + draft.d2t)
    assert not torch.equal(targets, d)  # a real (non-identity) map
    assert len(set(targets.tolist())) == 256 and int(targets.max()) < 512
    logits = torch.randn(5, 256)
    full = draft.target_vocab_logits(logits)
    assert full.shape == (5, 512)
    assert torch.equal(full[:, targets], logits)
    assert bool(torch.isinf(full).sum(-1).eq(512 - 256).all())
    assert torch.equal(full.argmax(-1), draft.propose(logits))


def test_borrowed_lm_head(k3) -> None:
    hf = eagle3_preset_hf_config("tiny-eagle3")
    del hf["draft_vocab_size"]
    draft = _draft(k3, hf)
    assert not hasattr(draft, "lm_head") and not hasattr(draft, "d2t")
    h = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.allclose(draft.head(h), k3.lm_head(draft.norm(h)).float())
    assert torch.equal(draft.to_target_ids(torch.tensor([5, 400])), torch.tensor([5, 400]))
    assert draft.target_vocab_logits(torch.ones(1, 512)).shape == (1, 512)
