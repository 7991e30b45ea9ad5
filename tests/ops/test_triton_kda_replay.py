"""One launch of the KDA state replay over several layers (`ops.kda_replay_layers`) against per-layer replays.

Each layer's tensors are allocated separately (qkv / b strided slices of their own merged projection, pools and
weights each the head of its own NaN-tailed buffer), so the kernel must address them through the offset table.
Checked, on the CPU interpreter in fp32: conv and recurrent pools equal L reference `ops.kda_decode` replays
(seq_lens = accepted counts 0..k, one clamped past k, a padding row) within 1e-5; state slots outside the batch
(poisoned with NaN) untouched; one kernel launch; the V split's per-(layer, sequence, head) counters back at zero;
a power-of-two and a padded head dim (48), split and chunked launch variants; a table built once and reused for a
second replay; non-uniform layers (no offset table, per-layer fallback) and the host checks of `KdaLayerTable` /
`layer_offsets`.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import make, tails_intact
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed import ops
from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors, layer_offsets

LOWER = -5.0


def make_layers(L: int, lens: list[int], H: int, D: int, slots: list[int], num_slots: int) -> list[dict]:
    """L independent layers' inputs (separate allocations, different weights / states), shared slots and lens;
    pool slots outside `slots` poisoned with NaN."""
    layers = []
    for layer in range(L):
        inp = make(lens, H, D, torch.float32, "cpu", slots=slots, num_slots=num_slots, seed=10 + layer)
        idle = [s for s in range(num_slots) if s not in slots]
        inp["conv_state"][idle] = float("nan")
        inp["state"][idle] = float("nan")
        layers.append(inp)
    return layers


def tensors(inp: dict) -> KdaLayerTensors:
    return KdaLayerTensors(*(inp[k] for k in KdaLayerTensors._fields))


def pools(layers: list[dict]) -> list[torch.Tensor]:
    return [t.clone() for inp in layers for t in (inp["conv_state"], inp["state"])]


def reference_replay(layers: list[dict], accepted: torch.Tensor, monkeypatch,
                     lower_bound: float | None = LOWER) -> list[torch.Tensor]:
    """Pools after per-layer reference `ops.kda_decode` replays on copies of the layers (the gate's lower bound as
    given; None: the softplus gate)."""
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    out = []
    for inp in layers:
        x = dict(inp, conv_state=inp["conv_state"].clone(), state=inp["state"].clone())
        ops.kda_decode(**x, lower_bound=lower_bound, scale=1.0, update_state=True, seq_lens=accepted)
        out += [x["conv_state"], x["state"]]
    return out


def two_layer_case(lens: list[int], slots: list[int], accepted: list[int], H: int, D: int, num_slots: int,
                   monkeypatch) -> tuple[list[dict], torch.Tensor, list[torch.Tensor]]:
    """Two layers' inputs (`make_layers`), the accepted counts as a tensor, and the pools the per-layer reference
    replay leaves (`reference_replay`)."""
    layers = make_layers(2, lens, H, D, slots, num_slots)
    acc = torch.tensor(accepted)
    return layers, acc, reference_replay(layers, acc, monkeypatch)


def count_launches(monkeypatch) -> dict[str, int]:
    """Count the Triton wrappers' calls: one multi-layer launch vs per-layer kda_decode launches."""
    from tokenspeed.ops.triton import kda_decode as mod

    calls = {"multi": 0, "single": 0}
    multi, single = mod.kda_replay_layers, mod.kda_decode
    monkeypatch.setattr(mod, "kda_replay_layers",
                        lambda *a, **k: calls.__setitem__("multi", calls["multi"] + 1) or multi(*a, **k))
    monkeypatch.setattr(mod, "kda_decode",
                        lambda *a, **k: calls.__setitem__("single", calls["single"] + 1) or single(*a, **k))
    return calls


def assert_pools_match(got: list[torch.Tensor], want: list[torch.Tensor], used: list[int]) -> None:
    """Batch slots within 1e-5 (no NaN); every other slot still all NaN."""
    for a, b in zip(got, want):
        idle = [s for s in range(a.shape[0]) if s not in used]
        assert rel_err(a[used], b[used]) < 1e-5
        assert a[idle].isnan().all()


# (D, BV, chunked): D=16 whole V per program and split V (NV=2: the counters), D=48 padded (BK=BV=64, NV=1) and
# split with a masked tail block (BV 32, NV=2); the chunked variant (one program per (layer, sequence, head) walking
# its tiles, token by token through the pools) for D=16 (2 tiles) and D=48 (BV 16: 3 real tiles of 4).
CASES = [(16, None, None), (16, 8, None), (48, None, None), (48, 32, None), (16, 8, True), (48, 16, True)]


@cpu_interp
@pytest.mark.parametrize("D,BV,chunked", CASES)
def test_multi_layer_replay_equals_per_layer_reference(D, BV, chunked, monkeypatch):
    from tokenspeed.ops.triton import kda_decode as mod

    H, k, L, S = (2 if D == 16 else 1), 4, 3, 11
    lens = [k] * 7
    slots = [4, 0, 9, -1, 2, 7, 5]
    accepted = torch.tensor([0, k, 2, 3, 1, 6, 3])  # 0 and k, a padding row, one past k (clamped)
    used = [s for s in slots if s >= 0]
    layers = make_layers(L, lens, H, D, slots, S)
    want = reference_replay(layers, accepted, monkeypatch)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = count_launches(monkeypatch)
    table = KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    if BV is not None:  # the public op takes the default split; this one forces the V split / the chunked variant
        monkeypatch.setattr(mod, "kda_replay_layers", lambda *a, _f=mod.kda_replay_layers, **kw: (
            calls.__setitem__("multi", calls["multi"] + 1), _f(*a, BV=BV, chunked=chunked, **kw))[-1])
    ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER)
    assert calls["multi"] >= 1 and calls["single"] == 0
    assert_pools_match(pools(layers), want, used)
    assert tails_intact(*(inp[k] for inp in layers for k in ("conv_state", "state", "conv_weight", "dt_bias")))
    assert not mod._counters(torch.device("cpu"), L * len(lens) * H)[: L * len(lens) * H].any()


@cpu_interp
def test_table_built_once_serves_two_replays(monkeypatch):
    """The recorded inputs rewritten in place between two replays (as a verify graph does): the same table (same
    addresses) gives the same pools as two reference replays."""
    H, D, k, L, S = 1, 16, 3, 3, 6
    lens, slots = [k] * 3, [3, 1, 5]
    layers = make_layers(L, lens, H, D, slots, S)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    table = KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    ref = [dict(inp, conv_state=inp["conv_state"].clone(), state=inp["state"].clone()) for inp in layers]
    for step, acc in enumerate(([1, 3, 0], [2, 0, 3])):
        accepted = torch.tensor(acc)
        if step:  # new verify rows written into the same buffers
            for inp, r in zip(layers, ref):
                fresh = make(lens, H, D, torch.float32, "cpu", slots=slots, num_slots=S, seed=99 + step)
                for name in ("qkv", "f", "b"):
                    inp[name].copy_(fresh[name])
                    r[name] = inp[name]
        ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted,
                              lower_bound=LOWER)
        want = reference_replay(ref, accepted, monkeypatch)
        for r, (cs, st) in zip(ref, zip(want[::2], want[1::2])):
            r["conv_state"], r["state"] = cs, st
        monkeypatch.setenv("TOKENSPEED_OPS", "triton")
        assert_pools_match(pools(layers), want, slots)


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_non_uniform_layers_fall_back_per_layer(mode, monkeypatch):
    """A layer with a different pool size: no offset table (strict build raises), and the op launches per layer
    (Triton kda_decode or the reference), with the same result."""
    H, D, k = 1, 16, 2
    lens, slots = [k, k], [1, 3]
    accepted = torch.tensor([2, 1])
    layers = make_layers(2, lens, H, D, slots, 5)
    layers.append(make_layers(1, lens, H, D, slots, 6)[0])  # 6 slots: conv_state / state shapes differ
    want = reference_replay(layers, accepted, monkeypatch)
    with pytest.raises(ValueError, match="conv_state of layer 2"):
        KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    table = KdaLayerTable.build([tensors(inp) for inp in layers])
    assert table.offsets is None and "conv_state of layer 2" in table.reason
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    calls = count_launches(monkeypatch)
    ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER)
    assert calls == {"multi": 0, "single": 3 if mode == "triton" else 0}
    assert_pools_match(pools(layers), want, slots)


def test_layer_offsets_host_checks():
    """Element offsets of separately allocated tensors (possibly negative); a stride, dtype or misaligned
    address raises ValueError; `matches` tells the very tensors a table was built from."""
    a, b = torch.zeros(4, 6), torch.zeros(4, 6)
    assert layer_offsets([a, b]) == [0, (b.data_ptr() - a.data_ptr()) // 4]
    with pytest.raises(ValueError, match="layer 1"):
        layer_offsets([a, torch.zeros(6, 4).t()])  # same shape, other strides
    with pytest.raises(ValueError, match="layer 1"):
        layer_offsets([a, b.double()])
    raw = bytearray(4 * 24 + 8)
    c = torch.frombuffer(raw, dtype=torch.float32, offset=0, count=24).view(4, 6)
    d = torch.frombuffer(raw, dtype=torch.float32, offset=2, count=24).view(4, 6)  # 2 bytes off: not a float
    with pytest.raises(ValueError, match="whole number"):
        layer_offsets([c, d])
    inp = [make([2], 1, 16, torch.float32, "cpu", seed=s) for s in (1, 2)]
    table = KdaLayerTable.build([tensors(x) for x in inp], strict=True)
    assert table.offsets.shape == (2, 8) and table.offsets.dtype == torch.int64 and not table.offsets[0].any()
    assert table.matches([tensors(x) for x in inp])
    assert not table.matches([tensors(x) for x in reversed(inp)])


# ----------------------------------------------------------------------------- GPU (bf16, Kimi-Linear shapes)
# The replay schedules against the plain split (per-layer `kda_decode` at BV 32), with their tolerance. The chunked
# schedule sums the conv in the split's expression form (1e-7 on the H200); the window loop and the WY replay in
# other forms, so on the GPU a few bf16-rounded conv outputs round the other way: 2.6e-4 at N = 1 for the window
# loop, 2.4e-7 with fp32 inputs (benchmarks/kda_replay_gap_h200.py, 67abd87).
# (config, window bound passed, tolerance): the default without the bound takes the window loop, with it the WY replay.
REPLAYS = {"default-unbounded": (None, False, 1e-3), "default": (None, True, 1e-3),
           "chunked-bv64": (64, False, 1e-5), "chunked-bv32": (32, False, 1e-5), "chunked-bv16": (16, False, 1e-5),
           "wy-bv32": (32, True, 1e-3), "wy-bv64": (64, True, 1e-3)}


@needs_cuda
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.parametrize("schedule", list(REPLAYS))
def test_multi_layer_replay_graph_gpu(N, schedule):
    """kimi-linear-48b-a3b replay shapes (20 KDA layers, 32 heads, head dim 128, k = 4): the multi-layer launch,
    captured in a CUDA graph with its table built before capture, equals 20 per-layer Triton split replays (the
    default launch with and without the window bound, the chunked schedule at a block_v, the WY replay at BV 32
    and 64)."""
    from tokenspeed.ops.triton.kda_decode import KdaConfig, kda_decode, kda_replay_layers

    L, H, D, k, S = 20, 32, 128, 4, 2 * N + 3
    how, bounded, tol = REPLAYS[schedule]
    cfg = (KdaConfig(how, wy=True) if schedule.startswith("wy")
           else KdaConfig(how, chunked=True, num_stages=3) if how else None)
    bound = k if bounded else None
    lens = [k] * N
    slots = list(range(1, N + 1))
    acc = torch.tensor([(n % (k + 1)) for n in range(N)] if N > 1 else [3], device="cuda")
    layers = [make(lens, H, D, torch.bfloat16, "cuda", slots=slots, num_slots=S, seed=l) for l in range(L)]
    want = [dict(x, conv_state=x["conv_state"].clone(), state=x["state"].clone()) for x in layers]
    for x in want:
        kda_decode(**x, lower_bound=LOWER, scale=1.0, update_state=True, seq_lens=acc, config=KdaConfig(32))
    table = KdaLayerTable.build([tensors(x) for x in layers], strict=True)
    si, cu = layers[0]["state_indices"], layers[0]["cu_seqlens"]
    before = pools(layers)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles), then restore the pools
        kda_replay_layers(table, si, cu, acc, lower_bound=LOWER, config=cfg, max_seq_tokens=bound)
    torch.cuda.current_stream().wait_stream(side)
    for x, (cs, st) in zip(layers, zip(before[::2], before[1::2])):
        x["conv_state"].copy_(cs)
        x["state"].copy_(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_replay_layers(table, si, cu, acc, lower_bound=LOWER, config=cfg, max_seq_tokens=bound)
    graph.replay()
    torch.cuda.synchronize()
    for x, w in zip(layers, want):
        assert rel_err(x["state"][slots], w["state"][slots]) < tol
        assert torch.equal(x["conv_state"][slots], w["conv_state"][slots])


@cpu_interp
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_replay_on_v_first_pools(mode, monkeypatch):
    """[V, K] recurrent pools (`state_v_first`, the model's layout): the replay (one Triton launch, or the per-layer
    reference through [K, V] views) leaves the pools the [K, V] replay leaves, transposed; idle slots untouched."""
    slots = [4, -1, 9, 2]
    layers, accepted, want = two_layer_case([3] * 4, slots, [3, 1, 2, 0], 2, 16, 11, monkeypatch)
    used = [s for s in slots if s >= 0]
    for inp in layers:
        inp["state"] = inp["state"].transpose(-1, -2).contiguous()
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    table = KdaLayerTable.build([tensors(inp) for inp in layers])
    ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER,
                          state_v_first=True)
    got = [t.transpose(-1, -2) if i % 2 else t for i, t in enumerate(pools(layers))]
    assert_pools_match(got, want, used)


@cpu_interp
def test_window_replay_equals_per_layer_reference(monkeypatch):
    """The multi-layer replay with the carried conv window (`KdaConfig(window=True)`) vs the per-layer reference."""
    from tokenspeed.ops.triton import kda_decode as mod

    slots = [4, -1, 9, 2]
    layers, accepted, want = two_layer_case([4] * 4, slots, [4, 2, 3, 0], 2, 16, 11, monkeypatch)
    used = [s for s in slots if s >= 0]
    table = KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    mod.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER,
                          config=mod.KdaConfig(8, window=True))
    assert_pools_match(pools(layers), want, used)


@cpu_interp
def test_replay_under_a_forced_wy_label_runs_split(monkeypatch):
    """TOKENSPEED_KDA_VERIFY naming a WY config (verify only) leaves the replay on its split form, same pools;
    an explicit WY config without a window bound is refused."""
    from tokenspeed.ops.triton import kda_config as kc
    from tokenspeed.ops.triton import kda_decode as mod

    layers, accepted, want = two_layer_case([3] * 3, [4, -1, 2], [3, 1, 2], 1, 64, 9, monkeypatch)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setenv(kc.MULTI_ENV, "bv32-split-w4-wy")
    table = KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER)
    assert_pools_match(pools(layers), want, [4, 2])
    with pytest.raises(ValueError, match="max_seq_tokens"):
        mod.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted,
                              lower_bound=LOWER, config=kc.KdaConfig(32, wy=True))


def count_wy(monkeypatch) -> dict[str, int]:
    """Count the two-launch WY replay's calls."""
    from tokenspeed.ops.triton import kda_decode as mod

    calls = {"wy": 0}
    wy = mod.launch_replay_wy
    monkeypatch.setattr(mod, "launch_replay_wy", lambda *a, **k: calls.__setitem__("wy", calls["wy"] + 1) or wy(*a, **k))
    return calls


@cpu_interp
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("lower_bound", [LOWER, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("k", [4, 6])
def test_wy_replay_equals_per_layer_reference(k, lower_bound, v_first, monkeypatch):
    """The two-launch WY replay (`KdaConfig(wy=True)` and a window bound; kda_replay_wy.py) leaves the pools the
    per-layer reference replay leaves: accepted counts 0..k and one past k (clamped), a padding row, a sequence with
    fewer rows than the bound, windows of 4 and 8 rows (k 6), both gates, [K, V] and [V, K] pools; slots outside
    the batch untouched (NaN), the weights' tails intact."""
    from tokenspeed.ops.triton import kda_decode as mod

    H, D, L, S = 2, 16, 2, 11
    lens = [k, k, k - 1, k, 2, k, k]
    slots = [4, 0, 9, -1, 2, 7, 5]
    accepted = torch.tensor([0, k, 2, 3, 1, k + 2, 3])
    used = [s for s in slots if s >= 0]
    layers = make_layers(L, lens, H, D, slots, S)
    want = reference_replay(layers, accepted, monkeypatch, lower_bound)
    if v_first:
        for inp in layers:
            inp["state"] = inp["state"].transpose(-1, -2).contiguous()
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = count_wy(monkeypatch)
    table = KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    mod.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted,
                          lower_bound=lower_bound, config=mod.KdaConfig(8, wy=True), max_seq_tokens=k,
                          state_v_first=v_first)
    assert calls["wy"] == 1
    got = [t.transpose(-1, -2) if v_first and i % 2 else t for i, t in enumerate(pools(layers))]
    assert_pools_match(got, want, used)
    names = ("conv_state", "conv_weight", "dt_bias") + (() if v_first else ("state",))  # (a transposed copy: no tail)
    assert tails_intact(*(inp[name] for inp in layers for name in names))


@cpu_interp
def test_default_replay_takes_wy_from_96_programs_with_a_bound(monkeypatch):
    """`ops.kda_replay_layers` with `max_seq_tokens` takes the WY replay from MULTI_TABLE's WY row (6 sequences x
    2 heads x 8 layers = 96 programs, head dim 64: the tables' region), same pools as the reference; without the
    bound, the split form."""
    H, D, L, S, k = 2, 64, 8, 9, 3
    slots = [4, 0, 6, -1, 2, 7]
    accepted = torch.tensor([0, k, 2, 3, 1, 2])
    layers = make_layers(L, [k] * 6, H, D, slots, S)
    want = reference_replay(layers, accepted, monkeypatch)
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    calls = count_wy(monkeypatch)
    table = KdaLayerTable.build([tensors(inp) for inp in layers], strict=True)
    fresh = pools(layers)
    ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER)
    assert calls["wy"] == 0
    assert_pools_match(pools(layers), want, [s for s in slots if s >= 0])
    for inp, (cs, st) in zip(layers, zip(fresh[::2], fresh[1::2])):
        inp["conv_state"].copy_(cs)
        inp["state"].copy_(st)
    ops.kda_replay_layers(table, layers[0]["state_indices"], layers[0]["cu_seqlens"], accepted, lower_bound=LOWER,
                          max_seq_tokens=k)
    assert calls["wy"] == 1
    assert_pools_match(pools(layers), want, [s for s in slots if s >= 0])

