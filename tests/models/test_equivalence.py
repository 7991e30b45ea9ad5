"""Whole tiny models (tiny-k3, tiny-kimi-linear) through the engine-style forward.

Scenarios: prefill(n) then one-token decodes == prefill(n+m); any random split into chunks == one prefill;
a batch of sequences of different lengths (scattered pages and slots) == each sequence solo; a 4-token verify
window == 4 decodes; fp32 and bf16. The "+yarn" variant uses rotary MLA with YaRN, so positions must be right.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_logits_close
from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM, forward_logits, parse_hf_config
from tokenspeed.models import preset_hf_config
from tokenspeed.models.weights import init_dummy_weights

# "+yarn": tiny-kimi-linear with rotary MLA and YaRN scaling (the shape of an EAGLE3 MLA draft's attention).
PRESETS = ["tiny-k3", "tiny-kimi-linear", "tiny-kimi-linear+yarn"]
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def build(name: str, dtype: torch.dtype) -> KimiForCausalLM:
    raw = preset_hf_config(name.split("+")[0])
    if name.endswith("+yarn"):
        raw.update(mla_use_nope=False, rope_theta=500.0, rope_scaling=YARN)
    model = KimiForCausalLM(parse_hf_config(raw), dtype=dtype).eval()
    init_dummy_weights(model, seed=3)
    return model
PAGE = 4


class Runner:
    """Feeds sequences to the model in arbitrary steps, keeping each sequence's pages and slot."""

    def __init__(self, model, num_pages: int = 256, num_slots: int = 8) -> None:
        self.model = model
        self.cache = CacheBuffers.allocate(model.config, num_pages, PAGE, num_slots, model.dtype)
        free = list(range(num_pages))
        random.Random(1).shuffle(free)  # scattered, non-contiguous pages
        self.free_pages = free
        self.pages: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """One forward: {slot: new tokens} -> {slot: logits [len, vocab]}."""
        slots = list(chunks)
        for s in slots:
            self.pages.setdefault(s, [])
            self.cached.setdefault(s, 0)
            need = -(-(self.cached[s] + len(chunks[s])) // PAGE)
            while len(self.pages[s]) < need:
                self.pages[s].append(self.free_pages.pop())
        batch = ForwardBatch.build([chunks[s] for s in slots], [self.cached[s] for s in slots],
                                   [self.pages[s] for s in slots], slots, PAGE)
        with torch.no_grad():
            logits = self.model(batch, self.cache)
        out, c = {}, batch.cu_seqlens_host
        for i, s in enumerate(slots):
            out[s] = logits[c[i]:c[i + 1]]
            self.cached[s] += len(chunks[s])
        return out


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=[(p, d) for p in PRESETS for d in (torch.float32, torch.bfloat16)],
                ids=lambda x: f"{x[0]}-{str(x[1]).split('.')[-1]}")
def model(request):
    preset, dtype = request.param
    return build(preset, dtype)


def test_prefill_then_decode_equals_longer_prefill(model) -> None:
    ids = _tokens(45, 0)
    full = forward_logits(model, ids)
    runner = Runner(model)
    got = [runner.step({0: ids[:30]})[0]]
    for tok in ids[30:]:
        got.append(runner.step({0: [tok]})[0])
    assert_logits_close(torch.cat(got), full, model.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunking_equals_one_prefill(model, seed: int) -> None:
    ids = _tokens(70, 10 + seed)
    full = forward_logits(model, ids)
    rng = random.Random(seed)
    runner, got, pos = Runner(model), [], 0
    while pos < len(ids):
        n = rng.choice([1, 2, 5, 9, 17, 33])
        got.append(runner.step({3: ids[pos:pos + n]})[3])
        pos += n
    assert_logits_close(torch.cat(got), full, model.dtype)


def test_batch_of_mixed_lengths_equals_solo(model) -> None:
    seqs = {5: _tokens(23, 1), 0: _tokens(1, 2), 2: _tokens(40, 3), 7: _tokens(9, 4)}
    solo = {s: forward_logits(model, ids) for s, ids in seqs.items()}
    runner = Runner(model)
    # Step 1: different-length prefills; step 2: a mix of a chunk continuation, decodes and a new sequence.
    first = runner.step({5: seqs[5][:20], 0: seqs[0], 2: seqs[2][:12]})
    second = runner.step({2: seqs[2][12:], 5: seqs[5][20:21], 7: seqs[7]})
    third = runner.step({5: seqs[5][21:]})
    got = {
        5: torch.cat([first[5], second[5], third[5]]),
        0: first[0],
        2: torch.cat([first[2], second[2]]),
        7: second[7],
    }
    for s in seqs:
        assert_logits_close(got[s], solo[s], model.dtype)


def test_verify_window_equals_decode_steps(model) -> None:
    """A 4-token verification forward == 4 one-token decodes (the speculative-decoding shape)."""
    ids = _tokens(24, 5)
    a, b = Runner(model), Runner(model)
    a.step({1: ids[:20]})
    b.step({1: ids[:20]})
    window = a.step({1: ids[20:24]})[1]
    steps = torch.cat([b.step({1: [t]})[1] for t in ids[20:24]])
    assert_logits_close(window, steps, model.dtype)



def test_fp8_latent_cache_close_to_bf16() -> None:
    """fp8 e4m3 MLA cache vs bf16 cache, same bf16 model: prefill + decodes within 5e-2 per token (relative L2).

    e4m3 rounds each latent value by up to ~6%; as with bf16 noise, a MoE router near a tie can flip on that and
    move one token's logits much more, so (as in assert_logits_close) 80% of tokens must be within tolerance.
    """
    model = build("tiny-k3", torch.bfloat16)
    ids = _tokens(40, 6)
    results = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        runner = Runner(model)
        runner.cache = CacheBuffers.allocate(model.config, 256, PAGE, 8, model.dtype, kv_cache_dtype=kv_dtype)
        got = [runner.step({0: ids[:30]})[0]] + [runner.step({0: [t]})[0] for t in ids[30:]]
        results.append(torch.cat(got).double())
    bf16, fp8 = results
    assert runner.cache.mla_latent[0].dtype == torch.float8_e4m3fn
    per_token = (fp8 - bf16).norm(dim=-1) / bf16.norm(dim=-1)
    assert per_token.max() > 0  # the fp8 cache really changes the numbers
    assert (per_token < 5e-2).double().mean() >= 0.8, per_token.tolist()
    assert per_token.median() < 3e-2, per_token.tolist()
