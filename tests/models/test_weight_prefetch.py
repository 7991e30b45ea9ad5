"""Side-stream L2 weight prefetch (`models.weight_prefetch`): what a decoder layer prefetches (its output
projection, the router, the folded shared expert's rows, each a contiguous view of the weight the kernels read),
the switch and its errors, and that nothing is launched off the GPU or for large steps. On a GPU: the prefetch
kernel covers a tensor's bytes and changes nothing, and a served model gives the same greedy tokens, from decode
graphs that contain the prefetches, as without them."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.models import KimiForCausalLM, parse_hf_config, preset_hf_config
from tokenspeed.models import weight_prefetch as wp
from tokenspeed.models.kimi.moe import SparseMoE
from tokenspeed.models.loader import write_tiny_checkpoint
from tokenspeed.models.weights import init_dummy_weights

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(preset: str = "tiny-kimi-linear") -> KimiForCausalLM:
    model = KimiForCausalLM(parse_hf_config(preset_hf_config(preset)), dtype=torch.float32).eval()
    init_dummy_weights(model, seed=3)
    return model


def test_a_layer_prefetches_its_output_projection_router_and_shared_expert() -> None:
    model = _model()
    layers = model.model.layers
    moe_layers = [layer for layer in layers if hasattr(layer, "block_sparse_moe")]
    assert moe_layers
    for layer in layers:
        targets = layer.prefetch_targets()
        assert targets[0] is layer.self_attn.o_proj.weight or targets[1] is layer.self_attn.o_proj.weight
        assert all(t.is_contiguous() for t in targets)
    layer = moe_layers[0]
    moe: SparseMoE = layer.block_sparse_moe
    targets = layer.prefetch_targets()
    assert any(t is moe.gate.weight for t in targets)
    assert moe.fold_shared  # Kimi Linear's one shared expert is expert E of the stacked weights
    e = moe.config.num_experts
    views = targets[-3:]
    for view, stacked in zip(views, (moe.w1, moe.w3, moe.w2), strict=True):
        assert view.data_ptr() == stacked[e].data_ptr() and view.shape == stacked.shape[1:]


def test_switch_is_off_by_default_and_a_bad_value_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv(wp.ENV, raising=False)
    assert not wp.enabled()
    monkeypatch.setenv(wp.ENV, "1")
    assert wp.enabled()
    monkeypatch.setenv(wp.ENV, "yes")
    with pytest.raises(ValueError, match=wp.ENV):
        wp.enabled()


def test_nothing_is_launched_on_the_cpu_or_for_large_steps(monkeypatch) -> None:
    monkeypatch.setenv(wp.ENV, "1")
    prefetch = wp.SideStreamPrefetch()
    w = torch.ones(64, 64)
    assert prefetch.fork([w], 1) == 0
    prefetch.join()  # nothing forked: a no-op
    model = _model()
    x = torch.randn(3, model.config.hidden_size)
    assert prefetch.fork(model.model.layers[1].prefetch_targets(), x.shape[0]) == 0


@needs_cuda
@pytest.mark.gpu
def test_prefetch_kernel_covers_the_bytes_and_changes_nothing_gpu(monkeypatch) -> None:
    from tokenspeed.ops.triton.l2_prefetch import l2_prefetch, prefetchable

    w = torch.randn(1000, 333, device="cuda", dtype=torch.bfloat16)  # 666,000 bytes: a ragged last piece
    before = w.clone()
    capable = prefetchable(w)
    assert l2_prefetch(w) == (666_000 // 16 * 16 if capable else 0)
    assert not prefetchable(w[:, 1:])  # not contiguous
    monkeypatch.setenv(wp.ENV, "1")
    prefetch = wp.SideStreamPrefetch()
    x = torch.randn(1, 333, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert prefetch.fork([w], 1) == (666_000 // 16 * 16 if capable else 0)
        y = x @ w.t()
        prefetch.join()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    assert torch.equal(y, x @ w.t())


def _greedy(path: str) -> list[list[int]]:
    torch.cuda.empty_cache()
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=4, num_pages=256)
    prompts = ["The quick brown fox", "Once upon a time", "def f(n):", "Hello"]
    params = [SamplingParams(max_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm.engine
    gc.collect()
    return out


@needs_cuda
@pytest.mark.gpu
def test_served_model_gives_the_same_tokens_with_the_prefetch_gpu(tmp_path, monkeypatch) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "tiny-kimi-linear", "tiny-kimi-linear", dtype=torch.bfloat16,
                                     seed=3))
    issued = []
    real = wp.SideStreamPrefetch.fork
    monkeypatch.setattr(wp.SideStreamPrefetch, "fork", lambda self, *a: issued.append(real(self, *a)) or issued[-1])
    monkeypatch.setenv(wp.ENV, "0")
    off = _greedy(path)
    assert not any(issued)
    monkeypatch.setenv(wp.ENV, "1")
    on = _greedy(path)
    assert any(issued)
    assert on == off
