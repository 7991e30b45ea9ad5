"""KDA's merged input projection (`in_proj`: q|k|v|[g]|f_a|[g_a]|b in one GEMM) and stacked f_b|g_b (`fg_b_proj`).

Scenarios (fp32, both presets: tiny-k3 has the full-rank output gate, tiny-kimi-linear the low-rank one): weights
loaded from a tiny checkpoint written to a temp dir give projections equal to the unmerged computation (one
F.linear per stored weight, sharded by hand) at TP=1 and on one rank of TP=2 (no process group is needed to load
or project); q/k/v and b are views of one merged output (no copy); writing the loaded model back gives the stored
tensors; a mis-shaped replicated part is named; the fused decode (Triton, interpreter) reads the merged views in
place, and a decode / verify / prefill step through the Triton ops equals the reference ops.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.conftest import rel_err

# tests.ops.triton_env sets up Triton (the interpreter) before anything imports it
from tests.ops.triton_env import cpu_interp
from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.errors import CheckpointError
from tokenspeed.models import CacheBuffers, ForwardBatch, load_model
from tokenspeed.models.checkpoint import checkpoint_tensors
from tokenspeed.models.layers import MergedLinear, Part, weight
from tokenspeed.models.loader import write_tiny_checkpoint
from tokenspeed.models.weights import checkpoint_prefix

PRESETS = ["tiny-k3", "tiny-kimi-linear"]


def _layer_prefix(model, layer: int) -> str:
    return f"{checkpoint_prefix(model.config)}model.layers.{layer}.self_attn."


def _unmerged(stored: dict, pre: str, x: torch.Tensor, full_rank: bool, tp: int, rank: int):
    """(qkv, f, b, gate) from the stored weights, one F.linear each; sharded ones cut by hand (rank of tp)."""
    def w(name: str, sharded: bool = True) -> torch.Tensor:
        t = stored[f"{pre}{name}.weight"]
        return t.chunk(tp, dim=0)[rank] if sharded else t

    qkv = torch.cat([F.linear(x, w(n)) for n in ("q_proj", "k_proj", "v_proj")], dim=-1)
    f = F.linear(F.linear(x, w("f_a_proj", False)), w("f_b_proj"))
    gate = F.linear(x, w("g_proj")) if full_rank else F.linear(F.linear(x, w("g_a_proj", False)), w("g_b_proj"))
    return qkv, f, F.linear(x, w("b_proj")), gate


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_merged_projections_equal_unmerged(tmp_path: Path, preset: str, tp: int, rank: int) -> None:
    ckpt = write_tiny_checkpoint(tmp_path, preset, torch.float32, seed=5)
    stored = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt, dtype=torch.float32, parallel=ParallelContext(tp_size=tp, tp_rank=rank))
    layer = model.config.kda_layers[0]
    attn = model.model.layers[layer].self_attn
    x = torch.randn(7, model.config.hidden_size)
    with torch.no_grad():
        got = attn.projections(x)
    expected = _unmerged(stored, _layer_prefix(model, layer), x, model.config.use_full_rank_gate, tp, rank)
    for name, g, e in zip(("qkv", "f", "b", "gate"), got, expected, strict=True):
        assert g.shape == e.shape, name
        assert rel_err(g, e) < 1e-5, name
    qkv, _, b, _ = got
    width = attn.in_proj.weight.shape[0]
    assert qkv.stride() == b.stride() == (width, 1)  # views of the merged output, read in place
    assert qkv.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert attn.in_proj.part_weight("f_a_proj").shape[0] == model.config.kda_head_dim  # replicated on every rank


@pytest.mark.parametrize("preset", PRESETS)
def test_written_checkpoint_gives_the_stored_tensors(tmp_path: Path, preset: str) -> None:
    ckpt = write_tiny_checkpoint(tmp_path, preset, torch.float32, seed=6)
    stored = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt, dtype=torch.float32)
    written = checkpoint_tensors(model, checkpoint_prefix(model.config))
    assert written.keys() == stored.keys()
    assert all(torch.equal(written[n], stored[n]) for n in stored)


def test_mis_shaped_replicated_part_is_named(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path, "tiny-kimi-linear")
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.0.self_attn.g_a_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="g_a_proj.weight gives 15 rows"):
        load_model(ckpt, dtype=torch.float32)


def test_merged_linear_parts_and_metadata_checks() -> None:
    lin = MergedLinear(4, [Part("a", 3, True), Part("b", 2, False), Part("c", 1, True)], torch.float32)
    assert lin.weight.tp_shard_dim == (0, None, 0) and lin.weight.hf_split_sizes == (3, 2, 1)
    y = torch.arange(12.0).view(2, 6)
    assert torch.equal(lin.part(y, "b"), y[:, 3:5]) and torch.equal(lin.part(y, "a", "b"), y[:, :5])
    with pytest.raises(ValueError, match="comes before"):
        lin.part(y, "c", "a")
    with pytest.raises(ValueError, match="shard_dim"):
        weight((4, 2), torch.float32, sources=("x", "y"), shard_dim=(0,))
    with pytest.raises(ValueError, match="split_sizes"):
        weight((4, 2), torch.float32, sources=("x", "y"), split_sizes=(1, 2))


def _step(model, attn, cache, ids_per_seq, cached, slots, verify=False):
    pages = [[s] for s in slots]
    batch = ForwardBatch.build(ids_per_seq, cached, pages, slots, 16, verify=verify)
    x = torch.randn(sum(map(len, ids_per_seq)), model.config.hidden_size)
    with torch.no_grad():
        return attn(x, batch, cache)


@cpu_interp
@pytest.mark.parametrize("stacked", [False, True], ids=["bmm", "stacked_gemv"])
@pytest.mark.parametrize("preset", PRESETS)
def test_triton_kda_reads_merged_views(monkeypatch, preset: str, stacked: bool) -> None:
    """TOKENSPEED_OPS=triton (interpreter): prefill (Triton conv on the strided q|k|v), decode and verify (fused
    kda_decode on the strided q|k|v and b, no copy, told each sequence's token count) equal the reference ops,
    outputs and pools; also with the low-rank gate's up-projections on the stacked GEMV kernel
    (TOKENSPEED_STACKED_GEMV=1, reading the f_a | g_a columns of the merged output in place)."""
    from tokenspeed.ops.triton import kda_decode as mod
    from tokenspeed.ops.triton import stacked_gemv

    stacked_calls = []
    real_stacked = stacked_gemv.stacked_linear
    monkeypatch.setattr(stacked_gemv, "stacked_linear", lambda x, w, out=None: stacked_calls.append(x.stride()) or
                        real_stacked(x, w, out))
    monkeypatch.setenv(ops.STACKED_GEMV_ENV, "1" if stacked else "0")

    model = load_model(preset, dtype=torch.float32, seed=4)
    attn = model.model.layers[model.config.kda_layers[0]].self_attn
    width = attn.in_proj.weight.shape[0]
    seen = []
    fused = mod.kda_decode
    monkeypatch.setattr(mod, "kda_decode", lambda qkv, f, b, *a, **k: seen.append((qkv.stride(), b.stride(),
                                                                                  k.get("max_seq_tokens")))
                        or fused(qkv, f, b, *a, **k))
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("TOKENSPEED_OPS", mode)
        torch.manual_seed(1)
        cache = CacheBuffers.allocate(model.config, 8, 16, 4, torch.float32)
        outs = [_step(model, attn, cache, [[1, 2, 3, 4, 5], [6, 7]], [0, 0], [1, 3]),     # prefill
                _step(model, attn, cache, [[8], [9]], [5, 2], [1, 3]),                      # decode
                _step(model, attn, cache, [[1, 2, 3], [4, 5, 6]], [6, 3], [1, 3], True)]    # verify
        results[mode] = (outs, [t.clone() for t in (cache.kda_conv[0], cache.kda_recurrent[0])])
    # decode and verify, reading the merged output in place, told the uniform window (the WY verify's bound)
    assert seen == [((width, 1), (width, 1), 1), ((width, 1), (width, 1), 3)]
    for got, ref in zip(results["triton"][0] + results["triton"][1], results["reference"][0] + results["reference"][1],
                        strict=True):
        assert rel_err(got, ref) < 1e-5
    low_rank = not model.config.use_full_rank_gate
    assert bool(stacked_calls) == (stacked and low_rank)
    assert all(st == (width, 1) for st in stacked_calls)  # the merged output, read in place


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_with_gate_projections_in_the_kernel(monkeypatch, preset: str, mode: str) -> None:
    """A decode step whose low-rank gate up projections run inside `kda_decode` (`low_rank_inputs`,
    TOKENSPEED_KDA_FUSED_GATES=1) equals the step that runs them first (=0): outputs and both pools, on the reference
    ops and the Triton ones (interpreter); the fused step passes f_a (and, low-rank output gate, g_a) as column views
    of the merged output with the up weights, and no f."""
    from tokenspeed.ops.triton import kda_decode as mod

    model = load_model(preset, dtype=torch.float32, seed=4)
    attn = model.model.layers[model.config.kda_layers[0]].self_attn
    width = attn.in_proj.weight.shape[0]
    calls = []
    real = mod.kda_decode
    monkeypatch.setattr(mod, "kda_decode", lambda *a, **k: calls.append((a[1], k.get("f_low_rank"),
                                                                          k.get("gate_low_rank"))) or real(*a, **k))
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    results = {}
    for fuse in ("0", "1"):
        monkeypatch.setenv(ops.KDA_FUSED_GATES_ENV, fuse)
        torch.manual_seed(1)
        cache = CacheBuffers.allocate(model.config, 8, 16, 4, torch.float32)
        outs = [_step(model, attn, cache, [[1, 2, 3], [6, 7]], [0, 0], [1, 3]),   # prefill (never fused)
                _step(model, attn, cache, [[8], [9]], [3, 2], [1, 3]),             # decode
                _step(model, attn, cache, [[5], [4]], [4, 3], [1, 3])]             # decode
        results[fuse] = outs + [cache.kda_conv[0].clone(), cache.kda_recurrent[0].clone()]
    for got, ref in zip(results["1"], results["0"], strict=True):
        assert rel_err(got, ref) < 1e-5
    if mode == "triton":
        fused_calls = calls[2:]  # the two decodes of the "1" run
        assert [c[0] is None for c in calls] == [False, False, True, True]
        for _, f_in, g_in in fused_calls:
            assert f_in[0].stride() == (width, 1)
            assert (g_in is None) == model.config.use_full_rank_gate
