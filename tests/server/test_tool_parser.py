"""Tool-call parsing of Kimi output (k3-chat-format.md section 7, stage 2): whole text and streamed deltas."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tokenspeed.server.chat import (
    ChatOutputParser,
    KimiK2ToolParser,
    KimiToolParser,
    detect_syntax,
    merge_deltas,
    new_call_id,
    parse,
    prompt_opens_thinking,
    render_chat,
)


def counter_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(name: str, *args: tuple[str, str, str], index: int = 1) -> str:
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


def tools(*calls: str) -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


RESPONSE = "<|open|>response<|sep|>{}<|close|>response<|sep|>"
END = "<|close|>message<|sep|>"

ONE_CALL = RESPONSE.format("") + tools(call("get_weather", ("city", "string", "Paris"), ("days", "number", "2"))) + END
TWO_CALLS = (RESPONSE.format("Let me check both.") + tools(
    call("get_weather", ("city", "string", 'São "Paulo"\n\\ ok'), ("units", "string", "")),
    call("search", ("q", "string", "a<b & c>d"), ("limit", "number", "3"), ("exact", "boolean", "true"),
         ("filters", "object", '{"lang": ["en", "fr"]}'), ("tags", "array", "[1, 2.5, null]"),
         ("none", "null", "null"), index=2)) + END)
SAMPLES = {
    "plain": "Just text, with < and <| and |> and <|open|>weird and a trailing <|clo",
    "content": RESPONSE.format("Hello **world**") + END,
    "one_call": ONE_CALL,
    "two_calls": TWO_CALLS,
    "typed_and_malformed": RESPONSE.format("") + tools(call("f", ("n", "number", "12abc"), ("o", "object", "{bad"),
                                                            ("nan", "number", "NaN"), ("s", "string", "{bad"))),
    "raw_json_block": tools('<|open|>call tool="raw" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": 1, oops'
                            "<|close|>json<|sep|><|close|>call<|sep|>"),
    "no_args_and_empty_name": tools('<|open|>call tool="" index="1"<|sep|><|close|>call<|sep|>',
                                    '<|open|>call tool="ping" index="2"<|sep|><|close|>call<|sep|>'),
    "truncated_in_string": "<|open|>tools<|sep|>" + call("a", ("x", "string", "1")) + (
        '<|open|>call tool="b"<|sep|><|open|>argument key="s" type="string"<|sep|>partial te'),
    "truncated_in_number": '<|open|>tools<|sep|><|open|>call tool="b"<|sep|><|open|>argument key="n" type="number"'
                           "<|sep|>12",
    "truncated_in_header": "<|open|>tools<|sep|>" + call("a") + '<|open|>call tool="b" ind',
    "after_tools": RESPONSE.format("c") + tools(call("a")) + "junk" + tools(call("never")) + END + "<|end_of_msg|>",
    "stray_markers": "x<|end_of_msg|>y<|open|>message<|sep|>z<|close|>message<|sep|>",
}


def stream(parser, pieces):
    events = []
    for piece in pieces:
        events += parser.push(piece)
    return events + parser.finish()


def splits(text: str, n_random: int = 30, seed: int = 0):
    """Every 2-way split, one char at a time, and random multi-way splits."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# ---------------------------------------------------------------------------------------------------------------
# Whole text
# ---------------------------------------------------------------------------------------------------------------


def test_zero_calls_leaves_plain_text_untouched():
    text = SAMPLES["plain"]
    assert parse(text) == (text, [])
    assert parse("") == (None, [])
    assert parse(SAMPLES["content"]) == ("Hello **world**", [])


def test_one_call():
    content, calls = parse(ONE_CALL, id_factory=counter_ids())
    assert content is None
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]


def test_two_calls_with_typed_arguments_and_content():
    content, calls = parse(TWO_CALLS)
    assert content == "Let me check both."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert calls[0]["id"] != calls[1]["id"] and all(c["id"].startswith("call_") for c in calls)
    assert all(c["type"] == "function" for c in calls)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'São "Paulo"\n\\ ok', "units": ""}
    args = calls[1]["function"]["arguments"]
    assert args == ('{"q": "a<b & c>d", "limit": 3, "exact": true, "filters": {"lang": ["en", "fr"]}, '
                    '"tags": [1, 2.5, null], "none": null}')  # emission order, json.dumps separators
    assert "São" in calls[0]["function"]["arguments"]  # ensure_ascii=False


def test_malformed_values_are_kept_as_raw_strings():
    _, calls = parse(SAMPLES["typed_and_malformed"])
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": "12abc", "o": "{bad", "nan": "NaN", "s": "{bad"}
    _, calls = parse(SAMPLES["raw_json_block"])
    assert calls[0]["function"] == {"name": "raw", "arguments": '{"a": 1, oops'}


def test_empty_arguments_and_empty_names():
    _, calls = parse(SAMPLES["no_args_and_empty_name"])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("ping", "{}")]


def test_attribute_values_are_unescaped_and_default_type_is_string():
    text = tools('<|open|>call tool="a&amp;b&quot;c"<|sep|><|open|>argument key="k&quot;"<|sep|>7'
                 "<|close|>argument<|sep|><|close|>call<|sep|>")
    _, calls = parse(text)
    assert calls[0]["function"] == {"name": 'a&b"c', "arguments": '{"k\\"": "7"}'}


def test_only_the_first_tools_section_counts_and_stray_markers_are_removed():
    assert parse(SAMPLES["after_tools"])[0] == "c"
    assert [c["function"]["name"] for c in parse(SAMPLES["after_tools"])[1]] == ["a"]
    assert parse(SAMPLES["stray_markers"]) == ("xyz", [])
    # Answer closed without an opener (thinking-off output, or deviation b after the reasoning split).
    assert parse("Paris.<|close|>response<|sep|><|close|>message<|sep|>") == ("Paris.", [])
    # Text after the response close is not content.
    assert parse(RESPONSE.format("a") + "b" + END) == ("a", [])


def test_truncated_calls_are_closed_with_valid_json():
    _, calls = parse(SAMPLES["truncated_in_string"])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": "1"}, {"s": "partial te"}]
    _, calls = parse(SAMPLES["truncated_in_number"])
    assert calls[0]["function"] == {"name": "b", "arguments": "{}"}  # an unfinished number is dropped
    _, calls = parse(SAMPLES["truncated_in_header"])
    assert [c["function"]["name"] for c in calls] == ["a"]


def test_tools_disabled_drops_the_channel_without_leaking_it():
    assert parse(TWO_CALLS, tools_enabled=False) == ("Let me check both.", [])
    assert parse(ONE_CALL, tools_enabled=False) == (None, [])


def test_default_ids_are_openai_like_and_unique():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") and len(i) == 29 for i in ids)


# ---------------------------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_streaming_equals_whole_for_every_split(name):
    text = SAMPLES[name]
    whole = KimiToolParser(id_factory=counter_ids()).parse(text)
    for pieces in splits(text):
        events = stream(KimiToolParser(id_factory=counter_ids()), pieces)
        assert merge_deltas(events) == whole, pieces


def test_streaming_event_shape():
    events = stream(KimiToolParser(id_factory=counter_ids()), list(TWO_CALLS))
    assert merge_deltas(events)[0] == "Let me check both."
    assert stream(KimiToolParser(), [TWO_CALLS])[0] == {"content": "Let me check both."}  # one delta, coalesced
    headers = [e["tool_calls"][0] for e in events if "id" in e.get("tool_calls", [{}])[0]]
    assert headers == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "search", "arguments": ""}}]
    chunks = [e["tool_calls"][0] for e in events if "tool_calls" in e and "id" not in e["tool_calls"][0]]
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in chunks)
    assert len([c for c in chunks if c["index"] == 0]) > 5  # the string value streamed as it was generated
    first = "".join(c["function"]["arguments"] for c in chunks if c["index"] == 0)
    assert json.loads(first) == {"city": 'São "Paulo"\n\\ ok', "units": ""}


def test_streaming_holds_back_only_possible_markers():
    p = KimiToolParser()
    assert p.push("<|open|>response<|sep|>Hello <|clo") == [{"content": "Hello "}]
    assert p.push("se|>resp") == []
    assert p.push("onse<|sep|> more") == []  # content ends at the response close
    assert p.finish() == []
    p = KimiToolParser()  # no response opener: a response close is stray, the text goes on
    assert p.push("Hi<|close|>response<|sep|> there") == [{"content": "Hi there"}]
    p = KimiToolParser()
    assert p.push("a <") == [{"content": "a "}]
    assert p.push("b") == [{"content": "<b"}]
    assert p.push("<|") == []
    assert p.finish() == [{"content": "<|"}]  # a held-back tail that never became a marker is still content


def test_many_tokens_per_delta():
    text = SAMPLES["two_calls"]
    events = stream(KimiToolParser(id_factory=counter_ids()), [text[:40], text[40:400], text[400:]])
    assert merge_deltas(events) == KimiToolParser(id_factory=counter_ids()).parse(text)


# ---------------------------------------------------------------------------------------------------------------
# Kimi K2 / Kimi-Linear syntax
# ---------------------------------------------------------------------------------------------------------------

K2_CALL = "<|tool_call_begin|>{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
K2_SAMPLES = {
    "none": "Plain answer <|tool_call",
    "one": "Sure.<|tool_calls_section_begin|>" + K2_CALL.format("functions.get_weather:0", '{"city": "Paris"}')
           + "<|tool_calls_section_end|>",
    "two_malformed": "<|tool_call_section_begin|>" + K2_CALL.format(" functions.a:1 ", '{"x": 1')
                     + K2_CALL.format("functions.ns.b:2", "") + "<|tool_call_section_end|>after",
}


def test_k2_calls_keep_model_ids_and_raw_arguments():
    assert KimiK2ToolParser().parse(K2_SAMPLES["none"]) == (K2_SAMPLES["none"], [])
    content, calls = KimiK2ToolParser().parse(K2_SAMPLES["one"])
    assert content == "Sure."
    assert calls == [{"id": "functions.get_weather:0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    content, calls = KimiK2ToolParser().parse(K2_SAMPLES["two_malformed"])
    assert content is None
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("functions.a:1", "a", '{"x": 1'), ("functions.ns.b:2", "b", "{}")]


@pytest.mark.parametrize("name", sorted(K2_SAMPLES))
def test_k2_streaming_equals_whole_for_every_split(name):
    text = K2_SAMPLES[name]
    whole = KimiK2ToolParser().parse(text)
    for pieces in splits(text):
        assert merge_deltas(stream(KimiK2ToolParser(), pieces)) == whole, pieces


# ---------------------------------------------------------------------------------------------------------------
# The combined per-choice parser
# ---------------------------------------------------------------------------------------------------------------

FULL = "The user wants weather.<|close|>think<|sep|>" + ONE_CALL


def test_chat_output_parser_whole_and_streamed():
    prompt = render_chat([{"role": "user", "content": "Weather in Paris?"}], None, None)
    parser = ChatOutputParser.for_prompt(prompt, id_factory=counter_ids())
    assert parser.in_reasoning and prompt_opens_thinking(prompt)
    parsed = parser.parse(FULL)
    assert parsed.reasoning_content == "The user wants weather."
    assert parsed.content is None
    assert parsed.tool_calls == parse(ONE_CALL, id_factory=counter_ids())[1]
    for pieces in splits(FULL, n_random=10):
        p = ChatOutputParser(in_reasoning=True, id_factory=counter_ids())
        events = stream(p, pieces)
        reasoning = "".join(e["reasoning_content"] for e in events if "reasoning_content" in e)
        assert reasoning == parsed.reasoning_content
        assert merge_deltas([e for e in events if "reasoning_content" not in e]) == (None, parsed.tool_calls)
        assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    plain = ChatOutputParser(in_reasoning=False)
    assert plain.parse("hi").content == "hi" and plain.finish_reason("stop") == "stop"


def test_syntax_detection():
    assert detect_syntax(None) == "kimi_k3"
    assert detect_syntax("{{ '<|im_assistant|>assistant<|im_middle|>' }}") == "kimi_k2"
    p = ChatOutputParser.for_prompt("<|im_assistant|>assistant<|im_middle|><think>", syntax="kimi_k2")
    assert p.in_reasoning
    parsed = p.parse("hmm</think>ok<|tool_calls_section_begin|>" + K2_CALL.format("functions.f:0", "{}"))
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls[0]["id"]) == ("hmm", "ok", "functions.f:0")
    with pytest.raises(ValueError):
        ChatOutputParser("gpt")
