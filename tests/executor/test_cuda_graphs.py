"""Decode CUDA graphs: the batch-size ladder (CPU) and, on a GPU, that replaying graphs changes no greedy token.

The GPU tests use a tiny-k3 checkpoint in fp32 (KDA head dim 16, inside the fused kernel's region), so a token can
only differ through a bug, not through bf16 rounding: graphs vs eager on the GPU, and GPU vs the CPU reference path,
for a mixed batch whose requests finish at different steps (the graph bucket shrinks and pads as they leave). The
default model (KDA head dim 48, a padded tile in the fused kernel) captures graphs too. A tiny Kimi-Linear with the
real MLA widths serves in bf16 at page 64 with the Gluon MLA split kernel on and off: the same tokens.
"""

from __future__ import annotations

import gc
import itertools
import os

import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.executor.cuda_graphs import batch_size_ladder
from tokenspeed.models.default_model import default_model_path
from tokenspeed.models.loader import write_tiny_checkpoint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def fibonacci(n):", "In 1905,", "Hello", "A"]


def test_ladder_covers_every_batch_size() -> None:
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = batch_size_ladder(100)
    assert sizes[-1] == 100 and sizes == sorted(set(sizes))
    assert all(b - a <= 32 for a, b in itertools.pairwise(sizes))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-k3")
    write_tiny_checkpoint(path, "tiny-k3", seed=3)
    return str(path)


def _outputs(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


EAGLE3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "tiny-eagle3",
          "speculative_num_steps": 3}


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "repeat", "speculative_num_steps": 3}, EAGLE3],
                         ids=["decode", "verify", "eagle3"])
def test_padded_static_batches_equal_plain_steps(spec: dict) -> None:
    """The graphs' padded static batches, run eagerly on the CPU: padding rows (slot -1, kv_len 0, scratch page)
    change no token, for decode and for 4-token verify steps with KDA replay, as requests leave the batch; with
    EAGLE3 the static batches also hand the drafter its target features."""
    plain = _outputs(LLM("tiny-k3", max_num_seqs=8, cache_memory_gb=0.05, **spec))
    llm = LLM("tiny-k3", max_num_seqs=8, cache_memory_gb=0.05, **spec)
    query_lens = (1, 4) if spec else (1,)
    llm.engine.runner.capture_graphs(8, llm.engine.max_model_len, query_lens, use_graphs=False)
    used = {q: 0 for q in query_lens}
    for q, graphs in llm.engine.runner.graphs.items():
        run = graphs.run

        def counted(batch, run=run, q=q):
            used[q] += 1
            return run(batch)

        graphs.run = counted
    proposals = _record_proposals(llm)
    assert _outputs(llm) == plain
    assert used[max(query_lens)] > 0, used  # with speculation every step after a prefill is a full verify window
    if spec is EAGLE3:  # the drafter saw the same target features: it proposed exactly the same drafts
        eager = LLM("tiny-k3", max_num_seqs=8, cache_memory_gb=0.05, **spec)
        eager_proposals = _record_proposals(eager)
        _outputs(eager)
        assert proposals == eager_proposals and any(any(d) for d in proposals[1:])


def _record_proposals(llm: LLM) -> list[dict]:
    """Every EAGLE3 proposal of `llm`'s drafter, in order (empty without one)."""
    drafter, seen = llm.engine.runner.drafter, []
    if drafter is not None:
        propose = drafter.propose

        def recorded(reqs):
            out = propose(reqs)
            seen.append({rid: list(d) for rid, d in out.items()})
            return out

        drafter.propose = recorded
    return seen


GPU_PAGES = 1024  # a fixed cache on the GPU: an engine's size must not depend on what earlier tests left allocated


def _greedy(model: str, device: str, **options) -> list[list[int]]:
    if device == "cuda":
        torch.cuda.empty_cache()
        options.setdefault("num_pages", GPU_PAGES)
    options.setdefault("dtype", "float32")
    llm = LLM(model, device=device, max_num_seqs=8, **options)
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    _release(llm)
    return out


def _release(llm: LLM) -> None:
    """Give the engine's device memory back (each LLM sizes its cache from what the device has free)."""
    del llm.engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "repeat", "speculative_num_steps": 3}, EAGLE3],
                         ids=["decode", "verify", "eagle3"])
def test_graphs_capture_and_equal_eager_and_cpu(tiny_dir: str, spec: dict) -> None:
    """Decode graphs, and with speculation verify graphs plus the captured KDA replay graphs (EAGLE3: the verify
    graphs also output the drafter's target features)."""
    torch.cuda.empty_cache()
    llm = LLM(tiny_dir, device="cuda", dtype="float32", max_num_seqs=8, num_pages=GPU_PAGES, **spec)
    sizes = llm.engine.runner.graphs[1].sizes
    replay_sizes = sorted(llm.engine.runner.graphs[4].replay_graphs) if spec else None
    _release(llm)  # before asserting: a failure's traceback must not keep the engine's memory alive
    assert sizes == [1, 2, 4, 8]
    if spec:
        assert replay_sizes == [1, 2, 4, 8]
    tokens = _greedy(tiny_dir, "cuda", **spec)
    assert tokens == _greedy(tiny_dir, "cuda", enforce_eager=True, **spec)
    assert tokens == _greedy(tiny_dir, "cpu", **spec)


@needs_cuda
def test_prompt_tails_beside_verify_windows_gpu(tiny_dir: str) -> None:
    """N-gram speculation with prompts arriving while others verify (chunks of 16 beside verify windows: on CUDA the
    fused KDA kernel without state writes, the prompt tails replayed with the windows): the greedy tokens of the
    CUDA engine (fp32, graphs) equal the CPU engine's (the chunked scan, prompt chunks committed in the forward)."""
    import random

    from tests.engine.test_spec import _prompts, _staggered

    rng = random.Random(7)
    prompts = [(p * 8)[: rng.randint(30, 70)] for p in _prompts(6, 13)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    opts = {"dtype": "float32", "max_num_seqs": 8, "chunked_prefill_size": 16, "max_num_batched_tokens": 32,
                "speculative_algorithm": "ngram", "speculative_num_steps": 3}
    torch.cuda.empty_cache()
    llm = LLM(tiny_dir, device="cuda", num_pages=GPU_PAGES, **opts)
    got = _staggered(llm, prompts, params)
    _release(llm)
    assert got == _staggered(LLM(tiny_dir, device="cpu", **opts), prompts, params)


@needs_cuda
def test_default_model_graphs_equal_cpu() -> None:
    """The default model (KDA head dim 48: the fused kernel's padded lanes) captures decode graphs and gives the
    CPU reference's greedy tokens."""
    torch.cuda.empty_cache()
    llm = LLM(default_model_path(), device="cuda", dtype="float32", max_num_seqs=4, num_pages=GPU_PAGES)
    assert 1 in llm.engine.runner.graphs
    _release(llm)
    assert _greedy(default_model_path(), "cuda") == _greedy(default_model_path(), "cpu")


@needs_cuda
def test_kimi_linear_graphs_equal_eager_and_cpu(tmp_path) -> None:
    """Kimi Linear's plain pre-norm decode path on the GPU, where the decode-size fusions apply (the MoE gate:
    add + norm + router + routing; the experts' gate/up + down in one launch; the KDA gate up-projections in
    kda_decode; MLA's store + W_UK absorption and combine + W_UV), in graphs and eager, gives the CPU
    reference's greedy tokens."""
    path = str(write_tiny_checkpoint(tmp_path / "tiny-kimi-linear", "tiny-kimi-linear", seed=3))
    tokens = _greedy(path, "cuda")
    assert tokens == _greedy(path, "cuda", enforce_eager=True)
    assert tokens == _greedy(path, "cpu")


# A tiny Kimi-Linear with the real MLA latent (512 + 64 columns) and 32 heads: the shapes of the Gluon split kernel.
REAL_MLA = {"num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


def test_real_mla_widths_checkpoint_serves_on_cpu(tmp_path) -> None:
    """The checkpoint the Gluon test below serves: `write_tiny_checkpoint`'s overrides reach the config, and the
    model generates on the CPU reference path."""
    path = write_tiny_checkpoint(tmp_path / "tiny-kimi-linear-mla", "tiny-kimi-linear", seed=3, overrides=REAL_MLA)
    llm = LLM(str(path), device="cpu", page_size=64, cache_memory_gb=0.05)
    cfg = llm.engine.runner.model.config
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads) == (512, 64, 32)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@needs_cuda
@pytest.mark.parametrize("page_size", [16, 64])
def test_gluon_mla_in_the_served_model_gpu(tmp_path, monkeypatch, page_size) -> None:
    """The served model with the real MLA widths, bf16, pages of 16 (the engine's default: `mla_gluon.SMALL_PAGES`,
    a page-table entry per key row) and 64, decode graphs (6 requests finishing one by one:
    the fused W_UV path from 4 sequences, the plain combine below): the same greedy tokens with the Gluon split
    kernel (TOKENSPEED_MLA_GLUON=1) as with the Triton one (=0): with the per-tile softmax sum
    (TOKENSPEED_MLA_GLUON_LAZY_SUM=0) its outputs equal the Triton kernel's bit for bit, and the served default (the
    lazy sum) gives the same tokens; on an sm_90 GPU with Gluon of `mla_gluon.TRITON_VERSIONS`, the Gluon kernel is
    the one that ran."""
    from tokenspeed.ops.triton import mla_gluon

    path = str(write_tiny_checkpoint(tmp_path / "tiny-kimi-linear-mla", "tiny-kimi-linear", dtype=torch.bfloat16,
                                     seed=3, overrides=REAL_MLA))
    calls = []
    real = mla_gluon.launch
    monkeypatch.setattr(mla_gluon, "launch", lambda *a, **k: (calls.append(1), real(*a, **k)))
    tokens = {}
    for on, lazy in (("0", "0"), ("1", "0"), ("1", "")):  # Triton; Gluon with the per-tile sum; Gluon as served
        monkeypatch.setenv(mla_gluon.ENV, on)
        monkeypatch.setenv(mla_gluon.LAZY_SUM_ENV, lazy)
        calls.clear()
        tokens[on, lazy] = _greedy(path, "cuda", dtype="bfloat16", page_size=page_size)
        if on == "0":
            assert not calls
        assert bool(calls) == (on == "1" and mla_gluon._hopper(torch.device("cuda")))
    assert tokens["1", "0"] == tokens["0", "0"]
    assert tokens["1", ""] == tokens["0", "0"]


# A tiny Kimi-Linear with 32 KDA heads of head dim 128 (the real widths): decode batches of 2-6 sequences are 64-192
# (sequence, head) pairs, the Gluon KDA decode's region (`kda_config.GLUON_DECODE_TABLE`).
REAL_KDA = {"linear_attn_config": {"full_attn_layers": [3, 5], "kda_layers": [1, 2, 4], "num_heads": 32,
                                   "head_dim": 128, "short_conv_kernel_size": 4}}


@needs_cuda
def test_gluon_kda_decode_in_the_served_model_gpu(tmp_path, monkeypatch) -> None:
    """The served model with the real KDA widths, bf16, decode graphs (6 requests finishing one by one): the same
    greedy tokens with the Gluon KDA decode (the default) as with DECODE_TABLE's Triton rows
    (TOKENSPEED_KDA_GLUON=0); on an sm_90 GPU with Gluon of `gluon_common.TRITON_VERSIONS` the Gluon kernel is the
    one that ran."""
    from tokenspeed.ops.triton import kda_decode_gluon
    from tokenspeed.ops.triton.kda_config import GLUON_ENV

    path = str(write_tiny_checkpoint(tmp_path / "tiny-kimi-linear-kda", "tiny-kimi-linear", dtype=torch.bfloat16,
                                     seed=3, overrides=REAL_KDA))
    calls = []
    real = kda_decode_gluon.launch
    monkeypatch.setattr(kda_decode_gluon, "launch", lambda *a, **k: (calls.append(1), real(*a, **k)))
    tokens = {}
    for on in ("0", ""):
        monkeypatch.setenv(GLUON_ENV, on)
        calls.clear()
        tokens[on] = _greedy(path, "cuda", dtype="bfloat16")
        assert bool(calls) == (on == "" and kda_decode_gluon._hopper(torch.device("cuda")))
    assert tokens[""] == tokens["0"]


@needs_cuda
def test_second_engine_in_a_process_gets_the_memory_of_a_deleted_one() -> None:
    """An engine sized from the free device memory after another engine was deleted gets the same cache: the
    first one's blocks, cached by torch's allocator, count as free (they used to shrink the second cache). Not under
    pytest-xdist: other workers' engines change the device's free memory between the two. A first engine runs
    before the two compared: the kernels its step loads (Triton modules, cuBLAS workspaces) stay resident in the
    process outside torch's allocator, a one-time cost (0.5% of tiny-k3's pages on the H200)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("reads the whole device's free memory: run without xdist workers")
    def pages() -> int:
        llm = LLM("tiny-k3", device="cuda", dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                  max_num_seqs=4)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        n = llm.engine.cache.plan.num_pages
        del llm
        return n

    gc.collect()
    torch.cuda.empty_cache()
    pages()  # loads the step's kernels
    first = pages()
    assert pages() == first


# Serving shapes after start-up: (decoding requests, new prompt tokens beside them, cached history of the new
# prompt's own first turn or 0). Eager steps of 2..16 tokens take the small-M GEMV where graphs take it too (the MoE
# router's fp32 GEMV has no table bucket above 8 rows, so its launches specialise on the row count being a multiple
# of 16 or not); longer ones the prefill kernels.
MIXED_AFTER_START = [(1, 1, 0), (2, 6, 0), (3, 9, 0), (1, 14, 0), (4, 12, 0), (2, 30, 0), (3, 5, 40), (1, 70, 40)]


@needs_cuda
@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "ngram", "speculative_num_steps": 3}],
                         ids=["plain", "ngram"])
def test_no_triton_kernel_compiles_after_start_up_gpu(tmp_path, spec: dict) -> None:
    """A bf16 Kimi-Linear served with graphs: once the engine is built (warm-up and capture), steps of decodes
    beside new prompts or new turns of 1 to 70 tokens (eager mixed steps of 2 to 71 tokens) compile or load no
    Triton kernel, so no request stalls on a compile mid-serve; with n-gram speculation the decodes are verify
    windows (both passed on the H200 in the 2026-12-02 `kda_round_h200.sh lowrank` round). A failure names each
    late variant, the step that asked for it and how its specialisation differs from the start-up variants of the
    same kernel."""
    from tokenspeed.executor import compile_watch

    path = str(write_tiny_checkpoint(tmp_path / "tiny-kimi-linear", "tiny-kimi-linear", dtype=torch.bfloat16,
                                     seed=3))
    torch.cuda.empty_cache()
    late: list[str] = []  # "step: kernel differences from the closest variant compiled before"
    llm = None
    try:
        llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=8, num_pages=GPU_PAGES, **spec)
        assert compile_watch.watch_compiles()  # the engine installed it before its warm-up
        for decoding, new, history in MIXED_AFTER_START:
            before = compile_watch.compiled_variants()
            _mixed_step(llm, decoding, new, history)
            late += [f"{decoding} decoding + {new} new tokens (history {history}): {name} {diff or variant}"
                     for name, variant, diff in compile_watch.new_variants(before)]
    finally:
        if llm is not None:
            _release(llm)
    assert not late, "Triton kernels compiled after start-up:\n" + "\n".join(late)


@needs_cuda
def test_no_compile_at_the_end_of_a_context_gpu(tmp_path) -> None:
    """With n-gram speculation, requests that run into max_model_len verify shorter windows at their last steps
    (fewer drafts fit: no graph, an eager verification, alone or beside a full window): the start-up warm-up has
    compiled those kernels, so none compiles then (written without a device run: not yet run on a GPU)."""
    from tokenspeed.executor import compile_watch

    path = str(write_tiny_checkpoint(tmp_path / "tiny-kimi-linear", "tiny-kimi-linear", dtype=torch.bfloat16,
                                     seed=3))
    torch.cuda.empty_cache()
    llm = None
    try:
        llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=8, num_pages=GPU_PAGES, max_model_len=48,
                  speculative_algorithm="ngram", speculative_num_steps=3)
        assert compile_watch.watch_compiles()
        before = compile_watch.compiled_variants()
        vocab = llm.engine.vocab_size
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = [[(100 + 7 * (i % 5) + r) % vocab for i in range(24 + 3 * r)] for r in range(3)]  # repeats
        outs = llm.generate(prompts, params)
        late = [f"{name} {diff or variant}" for name, variant, diff in compile_watch.new_variants(before)]
    finally:
        if llm is not None:
            _release(llm)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)  # each ran into max_model_len
    assert not late, "Triton kernels compiled after start-up:\n" + "\n".join(late)


def _mixed_step(llm: LLM, decoding: int, new: int, history: int) -> None:
    """`decoding` requests reach their decode phase, then a request of `new` prompt tokens joins them (after a
    first turn of `history` tokens that left its prefix in the cache, if any); run until all finish."""
    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    turn = [(500 + 3 * i) % vocab for i in range(history)]
    if history:
        llm.generate([turn], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for r in range(decoding):
        llm.add_request([(100 + 11 * r + i) % vocab for i in range(5)], params)
    while llm.engine.has_work and llm.engine.scheduler.waiting:  # until every one of them is decoding
        llm.engine.step()
    llm.engine.step()
    llm.add_request(turn + [(900 + 7 * i) % vocab for i in range(new)], params)
    while llm.engine.has_work:
        llm.engine.step()
