"""The CUDA expanded-attention path (`tokenspeed.ops.cuda.sdpa`): a chunk with a cached history split into the
history part and its own causal square, merged by log-sum-exp.

* CPU: `attend_split` with a float32 attend that returns its log-sum-exp equals the bottom-right causal reference
  (1e-6), for histories of 1 row and longer, and `merge_partials` weighs two partials by their softmax mass.
* CPU: `split_worth` (no history: never; small work: never; large: when cuDNN is there); a cuDNN that refuses the
  split call switches to the masked call once, with a warning (out-of-memory is raised, not taken for a refusal).
* GPU: `attention_expanded` with the split forced (SPLIT_MIN_WORK 0) and not, bf16, on a batch of a fresh
  prompt, a short tail on a short history and a long chunk on a long history, with keys / values head-major
  views (what the model passes) and plain [S, H, D]: within bf16 tolerance of the float32 reference.
* CPU: with bucketed cuDNN plans every chunk with a history runs split; importing the module asks PyTorch for them
  unless the variable is set; length buckets, the spare rows of `padded_rows` and when `_with_slack` copies.
* GPU: after `warm_plans`, bucketed calls at odd lengths (squares, histories of 1 row and longer, keys with and
  without spare rows) are within bf16 tolerance of the float32 reference.
* CPU (fp32) and GPU (bf16): the MLA layer's per-head expansion (`_expand_per_head`, head-major and [S, H, d]
  layouts) gives the keys / values of the kv_b GEMM followed by the cat (the CPU path's construction), k_pe
  exactly, and is rebuilt after an in-place weight write.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.conftest import rel_err
from tests.ops.triton_env import needs_cuda
from tokenspeed.ops.cuda import sdpa
from tokenspeed.ops.reference.mla import mla_attention_expanded as reference


def _ref_attend(q, k, v, causal, scale):
    """[1, H, L, D] float32 attention with its natural-log log-sum-exp; causal = top-left (square calls)."""
    s = torch.einsum("bhld,bhsd->bhls", q, k) * scale
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhls,bhsd->bhld", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("L,S", [(1, 2), (5, 6), (7, 40), (16, 16 + 300)])
def test_attend_split_equals_bottom_right_causal(L: int, S: int) -> None:
    g = torch.Generator().manual_seed(L * 1000 + S)
    H, D, DV = 3, 24, 16
    q, k = torch.randn(L, H, D, generator=g), torch.randn(S, H, D, generator=g)
    v = torch.randn(S, H, DV, generator=g)
    want = reference(q, k, v, [0, L], [0, S], 0.3)
    got = sdpa.attend_split(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), 0.3, attend=_ref_attend)
    assert rel_err(got.squeeze(0).transpose(0, 1), want) < 1e-6


def test_merge_partials_weighs_by_softmax_mass() -> None:
    o1, o2 = torch.full((1, 2, 3, 4), 1.0), torch.full((1, 2, 3, 4), 3.0)
    lse1 = torch.zeros(1, 2, 3)
    lse2 = torch.log(torch.tensor(3.0)).expand(1, 2, 3)  # three times the mass: (1 * 1 + 3 * 3) / 4
    assert torch.allclose(sdpa.merge_partials(o1, lse1, o2, lse2), torch.full((1, 2, 3, 4), 2.5))
    # a partial with no mass at all (every key masked) leaves the other unchanged
    dead = torch.full((1, 2, 3), float("-inf"))
    assert torch.equal(sdpa.merge_partials(o1, lse1, o2, dead), o1)


def test_split_worth(monkeypatch) -> None:
    monkeypatch.setattr(sdpa, "_split_ok", True)
    monkeypatch.setenv(sdpa.BUCKETED_PLANS_ENV, "0")  # exact-shape plans: split only where the work pays for it
    assert not sdpa.split_worth(8192, 0)  # a fresh prompt: one causal call already
    assert not sdpa.split_worth(300, 3796)
    assert sdpa.split_worth(256, 65536) and sdpa.split_worth(8192, 8192)
    monkeypatch.setenv(sdpa.BUCKETED_PLANS_ENV, "1")  # bucketed plans: every chunk with a history (no mask tensor)
    assert sdpa.split_worth(300, 3796) and sdpa.split_worth(1, 1) and not sdpa.split_worth(8192, 0)
    monkeypatch.setattr(sdpa, "_split_ok", False)
    assert not sdpa.split_worth(8192, 65536)


def test_importing_asks_for_bucketed_plans_unless_told_otherwise() -> None:
    """The module sets TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 at import unless the variable is already set (checked in
    a fresh interpreter: PyTorch reads it once, so a test process cannot toggle it)."""
    import subprocess
    import sys

    code = "import os, tokenspeed.ops.cuda.sdpa as s; print(os.environ[s.BUCKETED_PLANS_ENV], s.bucketed_plans())"
    for given, want in ((None, "1 True"), ("0", "0 False")):
        env = {k: v for k, v in os.environ.items() if k != sdpa.BUCKETED_PLANS_ENV}
        if given is not None:
            env[sdpa.BUCKETED_PLANS_ENV] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == want.split()


def test_length_buckets_and_row_slack() -> None:
    assert sdpa.length_buckets(1) == [1] and sdpa.length_buckets(5) == [1, 2, 4, 8]
    assert sdpa.length_buckets(8192) == [1 << b for b in range(14)]
    t = sdpa.padded_rows(7, 3, 2, dtype=torch.float32, device="cpu")
    assert t.shape == (7, 3, 2) and t.is_contiguous()
    assert t.untyped_storage().nbytes() == (7 + sdpa.ROW_SLACK) * 6 * 4
    assert sdpa._with_slack(t, 7) is t  # the slack is there: no copy
    bare = torch.randn(7, 3, 2)
    got = sdpa._with_slack(bare, 7)
    assert got is not bare and torch.equal(got, bare) and got.untyped_storage().nbytes() >= (7 + sdpa.ROW_SLACK) * 24
    head_major = torch.randn(3, 7 + sdpa.ROW_SLACK, 2).transpose(0, 1)[:7]  # slack, but not [S, H, D]-major
    got = sdpa._with_slack(head_major, 7)
    assert got.is_contiguous() and torch.equal(got, head_major)
    assert sdpa.warm_plans(2, 8, 8, 16, 64, torch.float32, "cpu") == 0  # plans are a CUDA matter


def test_warm_plans_calls_each_bucket_once_and_stops_at_out_of_memory(monkeypatch, caplog) -> None:
    """Each query bucket's square, then its history part at each key bucket, on the smallest lengths of the
    buckets (queries never past the keys' limit); a call at new lengths inside built buckets that is as slow as a
    plan build (plans not shared: PyTorch read the variable too early) is reported with the fix; out of memory
    ends the warm-up with a warning, not an error."""
    calls = []

    def attend(q, k, v, causal, scale):
        calls.append((q.shape[2], k.shape[2], causal))
        return q, q[..., 0]

    monkeypatch.setattr(sdpa, "_split_ok", True)
    monkeypatch.setenv(sdpa.BUCKETED_PLANS_ENV, "1")
    monkeypatch.setattr(sdpa, "cudnn_attend", attend)
    assert sdpa.warm_plans(2, 8, 4, 16, 40, torch.float32, "cpu") == 5 * (1 + 7)
    squares = [(ql, ql, True) for ql in (1, 2, 3, 5, 9)]  # buckets 1, 2, 4, 8, 16
    history = [(ql, kl, False) for kl in (1, 2, 3, 5, 9, 17, 33) for ql in (1, 2, 3, 5, 9)]  # ... 64: 33 <= 40
    assert calls == squares + history + [(4, 6, False)]  # the last: whether plans are shared within a bucket
    calls.clear()
    assert sdpa.warm_plans(2, 8, 4, 100, 6, torch.float32, "cpu") == 4 * (1 + 4)  # queries cut at 6 keys
    assert max(c[0] for c in calls[:-1]) == 5 and max(c[1] for c in calls[:-1]) == 5

    def short_of_memory(q, k, v, causal, scale):
        if k.shape[2] > 9:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return attend(q, k, v, causal, scale)

    # lengths inside built buckets that still take a plan's time: told how to fix it
    def slow(q, k, v, causal, scale):
        if (q.shape[2], k.shape[2]) == (4, 6):
            time.sleep(2 * sdpa.PLAN_BUILT_S)
        return attend(q, k, v, causal, scale)

    monkeypatch.setattr(sdpa, "cudnn_attend", slow)
    assert sdpa.warm_plans(2, 8, 4, 16, 40, torch.float32, "cpu") == 40
    assert any("set TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 in the environment" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(sdpa, "cudnn_attend", short_of_memory)
    assert sdpa.warm_plans(2, 8, 4, 16, 40, torch.float32, "cpu") == 5 + 5 * 5  # squares, key buckets 1..16
    assert any("out of memory building cuDNN attention plans" in r.getMessage() for r in caplog.records)


def test_refused_split_falls_back_to_the_masked_call_once(monkeypatch, caplog) -> None:
    """A cuDNN that refuses the split call (a RuntimeError) switches the process to the masked call, with one
    warning, and the chunk's result is still right; out-of-memory is not taken for a refusal."""
    calls = []

    def refuse(*a):
        calls.append(1)
        raise RuntimeError("no engine for this graph")

    monkeypatch.setattr(sdpa, "_split_ok", True)
    monkeypatch.setattr(sdpa, "SPLIT_MIN_WORK", 0)
    monkeypatch.setattr(sdpa, "cudnn_attend", refuse)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 6, generator=g)
    want = reference(q, k, v, [0, 4], [0, 10], 0.5)
    for _ in range(2):
        got = sdpa.attention_expanded(q, k, v, [0, 4], [0, 10], 0.5)
        assert rel_err(got, want) < 1e-5
    assert calls == [1] and not sdpa._split_ok
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1

    def oom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(sdpa, "_split_ok", True)
    monkeypatch.setattr(sdpa, "cudnn_attend", oom)
    with pytest.raises(torch.OutOfMemoryError):
        sdpa.attention_expanded(q, k, v, [0, 4], [0, 10], 0.5)
    assert sdpa._split_ok


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("head_major", [False, True])
def test_attention_expanded_gpu(monkeypatch, force: bool, head_major: bool) -> None:
    if force:
        monkeypatch.setattr(sdpa, "SPLIT_MIN_WORK", 0)
    H, D, DV = 32, 192, 128
    batch = [(300, 300), (20, 900), (1300, 1300 + 20000), (4, 70)]  # (q_len, k_len)
    cu_q, cu_k = _offsets(batch)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(cu_q[-1], H, D, device="cuda", generator=g).bfloat16()
    if head_major:  # [S, H, d] views of contiguous [H, S, d], as the MLA layer passes them
        k = torch.randn(H, cu_k[-1], D, device="cuda", generator=g).bfloat16().transpose(0, 1)
        v = torch.randn(H, cu_k[-1], DV, device="cuda", generator=g).bfloat16().transpose(0, 1)
    else:
        k = torch.randn(cu_k[-1], H, D, device="cuda", generator=g).bfloat16()
        v = torch.randn(cu_k[-1], H, DV, device="cuda", generator=g).bfloat16()
    _check_each_sequence(q, k, v, cu_q, cu_k, batch)


def _offsets(batch: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Cumulative query / key offsets of a batch of (q_len, k_len)."""
    cu_q, cu_k = [0], [0]
    for ql, kl in batch:
        cu_q.append(cu_q[-1] + ql)
        cu_k.append(cu_k[-1] + kl)
    return cu_q, cu_k


def _check_each_sequence(q, k, v, cu_q, cu_k, batch, tag: object = None) -> None:
    """attention_expanded within bf16 tolerance (1e-2) of the float32 reference, sequence by sequence."""
    got = sdpa.attention_expanded(q, k, v, cu_q, cu_k, q.shape[-1] ** -0.5)
    want = reference(q.float(), k.float(), v.float(), cu_q, cu_k, q.shape[-1] ** -0.5)
    for n in range(len(batch)):
        rows = slice(cu_q[n], cu_q[n + 1])
        assert rel_err(got[rows].float(), want[rows]) < 1e-2, (batch[n], tag)


@pytest.mark.gpu
@needs_cuda
def test_bucketed_attention_after_warm_plans_gpu() -> None:
    """warm_plans builds the bucketed plans (up to 300 new tokens on 2,000 keys); chunks at lengths inside those
    buckets, odd and not, square and with histories of 1 row and longer, from [S, H, D] keys with and without
    slack, are within bf16 tolerance of the float32 reference."""
    H, D, DV = 8, 192, 128
    assert sdpa.bucketed_plans()
    # query buckets 1..512 (10), key buckets 1..2048 (12): a square and a history call each
    assert sdpa.warm_plans(H, D, DV, 300, 2000, torch.bfloat16, "cuda") == 10 * (1 + 12)
    batch = [(1, 1), (1, 2), (3, 3), (17, 1999), (300, 301), (129, 129 + 1000), (64, 64 + 1871)]
    cu_q, cu_k = _offsets(batch)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(cu_q[-1], H, D, device="cuda", generator=g).bfloat16()
    for slack in (True, False):
        k = sdpa.padded_rows(cu_k[-1], H, D, dtype=torch.bfloat16, device="cuda") if slack else \
            torch.empty(cu_k[-1], H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(k.shape[0], H, DV, device="cuda", dtype=torch.bfloat16)
        k.normal_(generator=g), v.normal_(generator=g)
        _check_each_sequence(q, k, v, cu_q, cu_k, batch, "slack" if slack else "exact")


def _mla_layer(dtype: torch.dtype, device: str, preset: str = "tiny-kimi-linear"):
    from tokenspeed.models import KimiForCausalLM, parse_hf_config, preset_hf_config
    from tokenspeed.models.weights import init_dummy_weights

    model = KimiForCausalLM(parse_hf_config(preset_hf_config(preset)), dtype=dtype, device=device).eval()
    init_dummy_weights(model, seed=2)
    return model.model.layers[model.config.mla_layers[0]].self_attn


def _check_expansion(attn, latent: torch.Tensor, layout: str, tol: float) -> None:
    """`_expand_per_head` in `layout` against the kv_b GEMM + cat; k_pe copied exactly; rebuilt after a reload."""
    r, h = attn.kv_lora_rank, attn.num_heads
    k, v = attn._expand_per_head(latent, layout)
    assert k.shape == (latent.shape[0], h, attn.nope + attn.rope) and v.shape == (latent.shape[0], h, attn.v_dim)
    kv = torch.nn.functional.linear(latent[:, :r], attn.kv_b_proj.weight).view(-1, h, attn.nope + attn.v_dim)
    assert torch.equal(k[..., attn.nope:], latent[:, None, r:].expand(-1, h, -1))  # through the identity block
    assert rel_err(k[..., : attn.nope].float(), kv[..., : attn.nope].float()) < tol
    assert rel_err(v.float(), kv[..., attn.nope:].float()) < tol
    with torch.no_grad():
        attn.kv_b_proj.weight.mul_(2)  # an in-place reload rebuilds the per-head weights
    assert rel_err(attn._expand_per_head(latent, layout)[1].float(), 2 * v.float()) < tol


@pytest.mark.parametrize("preset", ["tiny-kimi-linear", "tiny-k3"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_mla_per_head_expansion_equals_cat(layout: str, preset: str) -> None:
    attn = _mla_layer(torch.float32, "cpu", preset)
    latent = torch.randn(57, attn.kv_lora_rank + attn.rope, generator=torch.Generator().manual_seed(4))
    _check_expansion(attn, latent, layout, 1e-5)
    if layout == "bshd":  # storage with the spare rows the bucketed cuDNN calls take: attention copies neither
        k, v = attn._expand_per_head(latent, layout)
        assert sdpa._with_slack(k, 57) is k and sdpa._with_slack(v, 57) is v
    with pytest.raises(ValueError, match="bhsd or bshd"):
        attn._expand_per_head(latent, "hsbd")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_mla_per_head_expansion_equals_cat_gpu(layout: str) -> None:
    attn = _mla_layer(torch.bfloat16, "cuda")
    _check_expansion(attn, torch.randn(333, attn.kv_lora_rank + attn.rope, device="cuda").bfloat16(), layout, 1e-2)
