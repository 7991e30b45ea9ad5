"""The KDA and MLA layers against section 2.4 / 2.5 written out token by token, independent of the ops.

Scenarios: K3 KDA (full-rank output gate, lower-bound sigmoid decay) and Kimi Linear KDA (low-rank gate, softplus
decay); K3 gated NoPE MLA with q-LoRA and Kimi Linear MLA without either; the layer writes exactly the normalised
c_kv and raw k_pe into its cache rows.
"""

from __future__ import annotations

import math

import torch

from tests.conftest import rel_err
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _setup(preset: str, layer_id: int, n: int):
    model = load_model(preset, dtype=torch.float32, seed=11)
    layer = model.model.layers[layer_id].self_attn
    cache = CacheBuffers.allocate(model.config, 8, 4, 2, torch.float32)
    batch = ForwardBatch.build([list(range(n))], [0], [[5, 2, 7, 0, 6, 1, 3, 4][: math.ceil(n / 4)]], [1], 4)
    x = torch.randn(n, model.config.hidden_size)
    return model.config, layer, cache, batch, x


def _kda_reference(c, a, x):
    """Section 2.4, one token at a time, fresh state."""
    h, d = a.num_heads, a.head_dim
    w_q, w_k, w_v = (a.in_proj.part_weight(n) for n in ("q_proj", "k_proj", "v_proj"))
    w_fa, w_b = a.in_proj.part_weight("f_a_proj"), a.in_proj.part_weight("b_proj")
    w_fb = a.f_b_proj.weight if c.use_full_rank_gate else a.fg_b_proj.weight[0]
    conv_q, conv_k, conv_v = a.conv_weight.chunk(3)
    gate_w = a.in_proj.part_weight("g_proj") if c.use_full_rank_gate else (
        a.fg_b_proj.weight[1] @ a.in_proj.part_weight("g_a_proj"))
    width = conv_q.shape[1]
    pre = {name: x @ w.t() for name, w in (("q", w_q), ("k", w_k), ("v", w_v))}
    state = torch.zeros(h, d, d)
    outs = []
    for t in range(x.shape[0]):
        conv = {}
        for name, weight in (("q", conv_q), ("k", conv_k), ("v", conv_v)):
            window = [pre[name][t - width + 1 + j] if t - width + 1 + j >= 0 else torch.zeros(h * d)
                      for j in range(width)]
            conv[name] = torch.nn.functional.silu(sum(weight[:, j] * window[j] for j in range(width))).view(h, d)
        q = conv["q"] / torch.sqrt((conv["q"] ** 2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(d)
        k = conv["k"] / torch.sqrt((conv["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
        f = (w_fb @ (w_fa @ x[t])).view(h, d) + a.dt_bias
        A = torch.exp(a.A_log)[:, None]
        g = c.gate_lower_bound * torch.sigmoid(A * f) if c.gate_lower_bound is not None else (
            -A * torch.nn.functional.softplus(f))
        beta = torch.sigmoid(w_b @ x[t])
        o = torch.zeros(h, d)
        for i in range(h):
            s = torch.exp(g[i])[:, None] * state[i]
            nu = beta[i] * (conv["v"][i] - s.t() @ k[i])
            state[i] = s + torch.outer(k[i], nu)
            o[i] = state[i].t() @ q[i]
        gate = (gate_w @ x[t]).view(h, d)
        o = _rms(o, a.o_norm.weight, c.rms_norm_eps) * torch.sigmoid(gate)
        outs.append(a.o_proj.weight @ o.reshape(-1))
    return torch.stack(outs), state


def test_kda_layer_matches_section_2_4() -> None:
    for preset in ("tiny-k3", "tiny-kimi-linear"):
        c, layer, cache, batch, x = _setup(preset, 0, 11)
        expected, state = _kda_reference(c, layer, x)
        with torch.no_grad():
            got = layer(x, batch, cache)
        assert rel_err(got, expected) < 1e-5, preset
        pooled = cache.kda_recurrent[0][1]  # [V, K] per head in the model's pools (CacheBuffers docstring)
        assert cache.kda_state_v_first
        assert rel_err(pooled.transpose(-1, -2), state) < 1e-5, preset
        assert cache.kda_recurrent[0][0].abs().max() == 0  # other slot untouched


def _mla_reference(c, a, x):
    """Section 2.5 in the expanded form, causal, no rotation."""
    h, nope, rope, v_dim, r = a.num_heads, a.nope, a.rope, a.v_dim, a.kv_lora_rank
    if c.q_lora_rank is not None:
        q = _rms(x @ a.q_a_proj.weight.t(), a.q_a_layernorm.weight, 1e-6) @ a.q_b_proj.weight.t()
    else:
        q = x @ a.projection_weight("q_proj").t()
    q = q.view(-1, h, nope + rope)
    kv_a = x @ a.projection_weight("kv_a_proj_with_mqa").t()
    c_kv, k_pe = _rms(kv_a[:, :r], a.kv_a_layernorm.weight, 1e-6), kv_a[:, r:]
    kv = (c_kv @ a.kv_b_proj.weight.t()).view(-1, h, nope + v_dim)
    out = torch.zeros(x.shape[0], h, v_dim)
    for t in range(x.shape[0]):
        for i in range(h):
            keys = torch.cat([kv[: t + 1, i, :nope], k_pe[: t + 1]], dim=-1)
            p = torch.softmax(keys @ q[t, i] / math.sqrt(nope + rope), dim=0)
            out[t, i] = p @ kv[: t + 1, i, nope:]
    out = out.reshape(x.shape[0], -1)
    if c.mla_use_output_gate:
        out = out * torch.sigmoid(x @ a.g_proj.weight.t())
    return out @ a.o_proj.weight.t(), torch.cat([c_kv, k_pe], dim=-1)


def test_mla_layer_matches_section_2_5() -> None:
    for preset in ("tiny-k3", "tiny-kimi-linear"):
        for n in (5, 12):  # absorbed (<= 8 new tokens) and expanded forms
            c, layer, cache, batch, x = _setup(preset, 2, n)
            expected, latent = _mla_reference(c, layer, x)
            with torch.no_grad():
                got = layer(x, batch, cache)
            assert rel_err(got, expected) < 1e-5, (preset, n)
            rows = cache.mla_latent[0].view(-1, latent.shape[-1])[batch.slot_mapping]
            assert rel_err(rows, latent) < 1e-6
