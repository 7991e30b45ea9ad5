"""Model layers against formulas written out independently of the model code.

Scenarios: the MoE block (LatentMoE of tiny-k3, hidden-space MoE with routed scaling of tiny-kimi-linear) equals
a per-token loop over the selected experts; the Block AttnRes residual stream of tiny-k3 equals the section 2.3
pseudo-code written with Python lists; Kimi Linear's plain pre-norm residual likewise.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import rel_err
from tokenspeed.models import CacheBuffers, ForwardBatch, forward_logits, load_model


def _situ(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * 25.0 * torch.tanh(u / 25.0)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _moe_token(moe, x: torch.Tensor) -> torch.Tensor:
    """One token through the MoE block, written from section 2.7."""
    c = moe.config
    act = _situ if c.hidden_act == "situ" else (lambda a, u: torch.nn.functional.silu(a) * u)
    scores = torch.sigmoid(moe.gate.weight @ x)
    biased = (scores + moe.gate.e_score_correction_bias).tolist()
    chosen = sorted(range(c.num_experts), key=lambda e: (-biased[e], e))[: c.num_experts_per_token]
    total = sum(scores[e] for e in chosen)
    z = moe.routed_expert_down_proj.weight @ x if c.routed_expert_hidden_size else x
    routed = sum(scores[e] / total * c.routed_scaling_factor * (moe.w2[e] @ act(moe.w1[e] @ z, moe.w3[e] @ z))
                 for e in chosen)
    if c.routed_expert_hidden_size:
        routed = moe.routed_expert_up_proj.weight @ _rms(routed, moe.routed_expert_norm.weight, c.rms_norm_eps)
    if not hasattr(moe, "shared_experts"):  # folded: the shared expert is slot E of the stacked expert weights
        e = c.num_experts
        return routed + moe.w2[e] @ act(moe.w1[e] @ x, moe.w3[e] @ x)
    sh = moe.shared_experts
    gate, up = (sh.gate_up_proj.weight @ x).chunk(2)
    return routed + sh.down_proj.weight @ act(gate, up)


def test_moe_block_matches_per_token_formula() -> None:
    for preset in ("tiny-k3", "tiny-kimi-linear"):
        model = load_model(preset, dtype=torch.float32, seed=4)
        moe = model.model.layers[1].block_sparse_moe
        x = torch.randn(13, model.config.hidden_size)
        expected = torch.stack([_moe_token(moe, row) for row in x])
        assert rel_err(moe(x), expected) < 1e-5, preset


def _mix(cands: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """softmax over depth of RMSNorm_gamma(v_i) . w, then the weighted sum of the raw v_i (section 2.3)."""
    logits = torch.stack([_rms(v, norm_w, eps) @ proj_w[0] for v in cands])  # [n, T]
    alpha = torch.softmax(logits, dim=0)
    return sum(a[:, None] * v for a, v in zip(alpha, cands, strict=False))


def _one_sequence(model, ids: list[int]):
    page = 8
    pages = list(range(math.ceil(len(ids) / page)))
    cache = CacheBuffers.allocate(model.config, len(pages), page, 1, model.dtype)
    return ForwardBatch.build([ids], [0], [pages], [0], page), cache


def test_attn_res_stream_matches_pseudocode() -> None:
    model = load_model("tiny-k3", dtype=torch.float32, seed=5)
    c, eps = model.config, model.config.rms_norm_eps
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    batch, cache = _one_sequence(model, ids)
    with torch.no_grad():
        partial, blocks = model.model.embed_tokens.weight[torch.tensor(ids)], []
        for layer in model.model.layers:
            l = layer.layer_id
            x_a = _mix(blocks + [partial], layer.self_attention_res_norm.weight,
                       layer.self_attention_res_proj.weight, eps) if blocks else partial
            if l % c.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
            a = layer.self_attn(_rms(x_a, layer.input_layernorm.weight, eps), batch, cache)
            partial = a if partial is None else partial + a
            x_m = _mix(blocks + [partial], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
            partial = partial + layer.ffn(_rms(x_m, layer.post_attention_layernorm.weight, eps))
        out = _mix(blocks + [partial], model.model.output_attn_res_norm.weight,
                   model.model.output_attn_res_proj.weight, eps)
        expected = _rms(out, model.model.norm.weight, eps) @ model.lm_head.weight.t()
    assert len(blocks) == 3  # 6 layers, blocks of 2: snapshots at layers 0, 2, 4
    assert rel_err(forward_logits(model, ids), expected) < 1e-5


def test_plain_residual_matches_pseudocode() -> None:
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=6)
    eps = model.config.rms_norm_eps
    ids = [7, 1, 8, 2, 8, 1, 8, 2, 8]
    batch, cache = _one_sequence(model, ids)
    with torch.no_grad():
        h = model.model.embed_tokens.weight[torch.tensor(ids)]
        for layer in model.model.layers:
            h = h + layer.self_attn(_rms(h, layer.input_layernorm.weight, eps), batch, cache)
            h = h + layer.ffn(_rms(h, layer.post_attention_layernorm.weight, eps))
        expected = _rms(h, model.model.norm.weight, eps) @ model.lm_head.weight.t()
    assert rel_err(forward_logits(model, ids), expected) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_bf16_gemm_equals_fp32_logits() -> None:
    """On CUDA the router takes one bf16 GEMM with fp32 output: the fp32 GEMM's logits up to summation order."""
    from tokenspeed.models.config import KimiConfig
    from tokenspeed.models.kimi.moe import Router

    cfg = KimiConfig(hidden_size=2304, num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024)
    router = Router(cfg, torch.bfloat16, "cuda")
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(333, 2304, device="cuda", dtype=torch.bfloat16)
    got = router(x)
    want = x.double() @ router.weight.double().t()
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5
