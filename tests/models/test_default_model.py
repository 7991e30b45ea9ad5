"""The built-in default model (kimi-k3-mini): assets, tokenizer, chat template, and the engine reproducing the
training-time held-out loss.

eval.json (written by scripts/default_model/evaluate.py) holds the held-out snippet texts and the NLL the training
run measured on each (fp32, reference ops, bf16-rounded weights). `forward_logits` and the engine's prompt
logprobs must reproduce them within 1%: a broken cache, gate or batch shows up as a jump in loss.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tokenspeed import LLM, SamplingParams
from tokenspeed.engine.tokenizer import HFTokenizer
from tokenspeed.models import forward_logits, load_hf_config, load_model
from tokenspeed.models.default_model import (
    DEFAULT_MODEL_DIR,
    DEFAULT_MODEL_NAME,
    default_model_path,
)

EVAL = json.loads((DEFAULT_MODEL_DIR / "eval.json").read_text(encoding="utf-8"))
REL_TOL = 0.01
# K3 layout of the special ids: 7936 BPE ranks, then the 256 reserved K3 special ids at the K3 offsets.
SPECIAL = {"[BOS]": 7936, "[EOS]": 7937, "<|end_of_msg|>": 7938, "<|open|>": 7939, "<|close|>": 7940,
           "<|sep|>": 7941, "<|media_pad|>": 7957, "[UNK]": 8190, "[PAD]": 8191}


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), cache_memory_gb=0.05)


def _weighted(losses: list[float]) -> float:
    n = [s["num_tokens"] - 1 for s in EVAL["snippets"]]
    return sum(v * k for v, k in zip(losses, n, strict=True)) / sum(n)


def test_assets() -> None:
    assert default_model_path() == str(DEFAULT_MODEL_DIR) and DEFAULT_MODEL_DIR.name == DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja", "eval.json"):
        assert (DEFAULT_MODEL_DIR / name).is_file(), name
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size < 16 * 2**20


def test_config_has_every_k3_feature() -> None:
    c = load_hf_config(DEFAULT_MODEL_DIR)
    assert c.model_type == "kimi_k3" and c.vocab_size == 8192
    assert c.kda_layers and c.mla_layers and c.gate_lower_bound is not None and c.use_full_rank_gate
    assert c.mla_use_nope and c.mla_use_output_gate and c.q_lora_rank is not None
    assert c.num_experts and c.routed_expert_hidden_size < c.hidden_size and c.latent_moe_use_norm
    assert c.hidden_act == "situ" and c.num_shared_experts > 0 and c.topk_method == "noaux_tc"
    assert c.uses_attn_res and math.ceil(c.num_hidden_layers / c.attn_res_block_size) >= 2


def test_parameter_count(model) -> None:
    assert sum(p.numel() for p in model.parameters()) == EVAL["params"]


def test_tokenizer() -> None:
    tok = HFTokenizer(DEFAULT_MODEL_DIR, vocab_size=8192)
    assert tok.vocab_size == 8192 and tok.bos_token_id == SPECIAL["[BOS]"]
    assert set(tok.eos_token_ids) == {SPECIAL["<|end_of_msg|>"], SPECIAL["[EOS]"]}
    for text, i in SPECIAL.items():
        assert tok.encode(text) == [i] and i in tok.all_special_ids
    code = 'def double(value):\n    """Return twice the value."""\n    return value * 2\n'
    ids = tok.encode(code)
    assert tok.decode(ids) == code and max(ids) < SPECIAL["[BOS]"] and len(ids) < len(code) / 3
    text = "ünïcode 日本 🎉 <|open|> as text"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def _hf_env():
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    return env


def test_chat_template_k3_layout() -> None:
    """The template renders section 3 of k3-chat-format.md; flat encoding equals segment-wise encoding here."""
    tok = HFTokenizer(DEFAULT_MODEL_DIR, vocab_size=8192)
    template = _hf_env().from_string(tok.chat_template)
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "reasoning_content": "Need tool.", "content": "Checking.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "Thanks"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
    text = template.render(messages=messages, tools=tools, thinking_effort="max")
    msg = '<|open|>message role="{}"<|sep|>{}<|close|>message<|sep|><|end_of_msg|>'.format
    expected = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
        'JSONSchema.\n\n```json\n[{"function":{"description":"Get weather","name":"get_weather","parameters":'
        '{"properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"],"type":"object"}},'
        '"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in '
        'your thinking channel (not including the response channel), supported values include `low`, `medium`, '
        '`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|>'
        '<|end_of_msg|>' + msg("system", "You are helpful.") + msg("user", "Weather in Paris?")
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Need tool.<|close|>think<|sep|><|open|>response'
        '<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" '
        'type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message'
        '<|sep|><|end_of_msg|>' + '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>'
        'message<|sep|><|end_of_msg|>' + msg("user", "Thanks") + '<|open|>message role="assistant"<|sep|>'
        '<|open|>think<|sep|>'
    )
    assert text == expected
    no_think = template.render(messages=messages[1:2], thinking=False)
    generation_prompt = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    assert no_think == msg("user", "Weather in Paris?") + generation_prompt
    # Segment-wise ids (markers special, every text piece encoded alone), as the training chat data was encoded.
    o, c, s = SPECIAL["<|open|>"], SPECIAL["<|close|>"], SPECIAL["<|sep|>"]
    e = tok.encode
    segmented = ([o, *e("message"), *e(" role"), *e('="'), *e("user"), *e('"'), s, *e("Weather in Paris?"), c,
                  *e("message"), s, SPECIAL["<|end_of_msg|>"], o, *e("message"), *e(" role"), *e('="'),
                  *e("assistant"), *e('"'), s, o, *e("response"), s])
    assert tok.encode(no_think) == segmented


def test_heldout_snippets_forward_logits(model) -> None:
    tok = HFTokenizer(DEFAULT_MODEL_DIR, vocab_size=8192)
    losses = []
    for snip in EVAL["snippets"]:
        ids = tok.encode(snip["text"])
        assert len(ids) == snip["num_tokens"]
        losses.append(F.cross_entropy(forward_logits(model, ids)[:-1], torch.tensor(ids[1:])).item())
        assert losses[-1] == pytest.approx(snip["train_time_loss"], rel=REL_TOL), snip["source"]
    assert _weighted(losses) == pytest.approx(EVAL["snippet_loss"]["train_time"], rel=REL_TOL)


def test_heldout_snippets_engine_prompt_logprobs(llm) -> None:
    outs = llm.generate([s["text"] for s in EVAL["snippets"]],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    losses = []
    for out, snip in zip(outs, EVAL["snippets"], strict=True):
        ids = out.prompt_token_ids
        assert len(ids) == snip["num_tokens"] and out.prompt_logprobs[0] is None
        nll = [-entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        losses.append(sum(nll) / len(nll))
        assert losses[-1] == pytest.approx(snip["train_time_loss"], rel=REL_TOL), snip["source"]
    assert _weighted(losses) == pytest.approx(EVAL["snippet_loss"]["train_time"], rel=REL_TOL)
    # The model is trained: far below the uniform loss ln(8192) = 9.0 on held-out code.
    assert EVAL["heldout"]["loss"] < 4.5 and _weighted(losses) < 4.5


def test_greedy_completion_is_code(llm) -> None:
    prompt = EVAL["completion"]["prompt"]
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    words = out.text.split()
    assert len(out.token_ids) == 24 and len(set(out.token_ids)) >= 8
    assert len("".join(words)) >= 20 and any(w in words for w in ("if", "return", "raise", "for", "not", "="))
    # Deterministic greedy decoding: the stored completion (fp32, CPU) starts the same way.
    stored = EVAL["completion"]["text"]
    assert stored.split()[:4] == words[:4]
