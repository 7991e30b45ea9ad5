"""Prompt rendering: the built-in Kimi K3 renderer (k3-chat-format.md sections 2-4), Jinja templates from a model
directory, and request validation."""

from __future__ import annotations

import copy
import json

import pytest

from tokenspeed.core.sampling_params import RequestError
from tokenspeed.errors import ConfigError
from tokenspeed.server.chat import render_chat, render_chat_segments

EOM = "<|end_of_msg|>"
EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
          "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
          "with `thinking_effort={}`.")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def msg(role: str, body: str, **attrs: str) -> str:
    extra = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f'<|open|>message role="{role}"{extra}<|sep|>{body}<|close|>message<|sep|>{EOM}'


def effort(level: str = "max") -> str:
    return msg("system", EFFORT.format(level), type="thinking-effort")


CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "Need tool.", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "Thanks"},
]


# ---------------------------------------------------------------------------------------------------------------
# Built-in K3 renderer
# ---------------------------------------------------------------------------------------------------------------


def test_builtin_renders_the_spec_example_byte_for_byte():
    expected = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"description":"Get weather","name":"get_weather","parameters":{"properties":{"city":'
        '{"type":"string"},"days":{"type":"integer"}},"required":["city"],"type":"object"}},"type":"function"}]'
        f"\n```<|close|>message<|sep|>{EOM}"
        + effort("max")
        + msg("system", "You are helpful.")
        + msg("user", "Weather in Paris?")
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Need tool.<|close|>think<|sep|>'
        "<|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        f"<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>{EOM}"
        + msg("tool", "sunny", tool="get_weather", index="1")
        + msg("user", "Thanks")
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert render_chat(CONVERSATION, [WEATHER], None) == expected


def test_generation_prompt_thinking_on_off_and_absent():
    user = [{"role": "user", "content": "hi"}]
    assert render_chat(user, None, None) == effort() + msg("user", "hi") + (
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert render_chat(user, None, None, thinking=False) == msg("user", "hi") + (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert render_chat(user, None, None, enable_thinking=False) == render_chat(user, None, None, thinking=False)
    assert render_chat(user, [], None, add_generation_prompt=False, thinking=False) == msg("user", "hi")


def test_thinking_off_history_has_no_think_channel():
    text = render_chat(CONVERSATION, None, None, thinking=False)
    assert "think" not in text
    assert "<|open|>response<|sep|>Checking.<|close|>response<|sep|>" in text


@pytest.mark.parametrize("kwargs, level", [
    ({}, "max"), ({"thinking_effort": "low"}, "low"), ({"thinking_effort": "high"}, "high"),
    ({"thinking_effort": "medium"}, "high"), ({"reasoning_effort": "low"}, "low"),
    ({"thinking_effort": "max", "reasoning_effort": "low"}, "max"), ({"thinking_effort": None}, "max"),
])
def test_thinking_effort_directive(kwargs, level):
    assert render_chat([{"role": "user", "content": "x"}], None, None, **kwargs).startswith(effort(level))


def test_bad_effort_is_rejected_only_when_thinking():
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError, match="thinking_effort"):
        render_chat(user, None, None, thinking_effort="extreme")
    assert render_chat(user, None, None, thinking=False, thinking_effort="extreme") == msg("user", "x") + (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_tool_declaration_sorts_keys_keeps_unicode_and_order():
    tools = [{"type": "function", "function": {"name": "b_tool", "description": "météo ☀",
                                                "parameters": {"type": "object", "properties": {}}}},
             {"function": {"name": "a_tool"}, "type": "function"}]
    text = render_chat([{"role": "user", "content": "x"}], tools, None, thinking=False)
    body = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\n')
    assert f"```json\n{body}\n```" in text and "météo ☀" in text
    assert body.index("b_tool") < body.index("a_tool")  # array order kept


def test_system_message_with_tools_declares_them_in_place():
    messages = [{"role": "user", "content": "a"},
                {"role": "system", "tools": [{"type": "function", "function": {"name": "late"}}]},
                {"role": "user", "content": "b"}]
    text = render_chat(messages, None, None, thinking=False, add_generation_prompt=False)
    declare = ('<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n'
               "The system dynamically extends the toolset via lazy-loading.\nYou have access to all existing "
               "and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
               '[{"function":{"name":"late"},"type":"function"}]\n```<|close|>message<|sep|>' + EOM)
    assert text == msg("user", "a") + declare + msg("user", "b")


def test_user_system_content_parts_names_and_raw_bodies():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "name": 'a"b&c', "content": [{"type": "text", "text": "one "},
                                                      {"type": "text", "text": "<|open|>two\n"}]},
        {"role": "user", "name": "", "content": "  spaced  "},
    ]
    text = render_chat(messages, None, None, thinking=False, add_generation_prompt=False)
    assert text == (msg("system", "be brief") + msg("user", "one <|open|>two\n", name="a&quot;b&amp;c")
                    + msg("user", "  spaced  "))


def test_segments_separate_control_markers_from_text():
    segments = render_chat_segments([{"role": "user", "name": "ann.", "content": "<|open|>hi"}], None, None,
                                    thinking=False)
    assert "".join(t for t, _ in segments) == render_chat(
        [{"role": "user", "name": "ann.", "content": "<|open|>hi"}], None, None, thinking=False)
    assert {t for t, ctl in segments if ctl} == {"<|open|>", "<|sep|>", "<|close|>", EOM}
    plain = [t for t, ctl in segments if not ctl]
    assert plain[:6] == ["message", " role", '="', "user", '"', " name"]  # an attribute is four segments
    assert "<|open|>hi" in plain and "ann." in plain


def test_assistant_history_arguments_typed_reasoning_and_empty_channels():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {
            "s": "raw \"text\"\n", "i": 3, "x": 1.5, "b": True, "n": None, "l": [1, "two"], "o": {"k": [1, 2]}}}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": "{not json"}},
        {"id": "d", "name": "flat", "arguments": '{"q": "v"}'},  # no "function" wrapper
    ]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "reasoning_content": "", "reasoning": "fallback", "content": None,
                 "tool_calls": calls}]
    text = render_chat(messages, None, None, add_generation_prompt=False)
    assert "<|open|>think<|sep|>fallback<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>" in text

    def arg(key, typ, value):
        return f'<|open|>argument key="{key}" type="{typ}"<|sep|>{value}<|close|>argument<|sep|>'

    assert ('<|open|>call tool="f" index="1"<|sep|>' + arg("s", "string", 'raw "text"\n') + arg("i", "number", "3")
            + arg("x", "number", "1.5") + arg("b", "boolean", "true") + arg("n", "null", "null")
            + arg("l", "array", '[1, "two"]') + arg("o", "object", '{"k": [1, 2]}') + "<|close|>call<|sep|>"
            ) in text
    assert '<|open|>call tool="g" index="2"<|sep|><|close|>call<|sep|>' in text
    assert ('<|open|>call tool="h" index="3"<|sep|><|open|>json type="object"<|sep|>{not json<|close|>json<|sep|>'
            "<|close|>call<|sep|>") in text
    assert '<|open|>call tool="flat" index="4"<|sep|>' + arg("q", "string", "v") in text
    whitespace_only = [{"role": "assistant", "reasoning_content": " \n", "content": "ok"}]
    assert render_chat(whitespace_only, None, None, add_generation_prompt=False).endswith(
        '<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>'
        '<|close|>message<|sep|>' + EOM)


def test_tool_results_are_reordered_by_call_id_and_named():
    calls = [{"id": "x1", "type": "function", "function": {"name": "first", "arguments": "{}"}},
             {"id": "x2", "type": "function", "function": {"name": "second", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "x2", "name": "wrong", "content": "R2"},
                {"role": "tool", "tool_call_id": "x1", "content": "R1"}]
    text = render_chat(messages, None, None, thinking=False)
    assert msg("tool", "R1", tool="first", index="1") + msg("tool", "R2", tool="second", index="2") in text
    # Unmatched ids: left in order, names resolved by position.
    messages[2:] = [{"role": "tool", "tool_call_id": "zz", "content": "A"}, {"role": "tool", "content": "B"}]
    text = render_chat(messages, None, None, thinking=False)
    assert msg("tool", "A", tool="first", index="1") + msg("tool", "B", tool="second", index="2") in text


def test_request_directives_order_and_bodies():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "a": 1}}}
    text = render_chat([{"role": "user", "content": "q"}], [WEATHER], None, tool_choice="required",
                       response_format=fmt)
    choice = msg("system", "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next "
                 "message.", type="tool-choice")
    rf = msg("system", "The system is invoked with `response_format=json_schema`.\nYour response must be raw "
             "JSON data without markdown code blocks (```json) or any additional formatting.\nThe JSON data must "
             'match the following schema:\n```json\n{"a":1,"type":"object"}\n```', type="response-format")
    assert text.endswith(msg("user", "q") + choice + rf + '<|open|>message role="assistant"<|sep|><|open|>think'
                         "<|sep|>")
    none = render_chat([{"role": "user", "content": "q"}], None, None, thinking=False, tool_choice="none",
                       response_format={"type": "json_object"})
    assert "You MUST NOT call any tools in the next message." in none
    assert "`response_format=json_object`.\nYour response must be raw JSON data" in none
    for quiet in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        assert "tool-choice" not in render_chat([{"role": "user", "content": "q"}], None, None, tool_choice=quiet)
    assert "response-format" not in render_chat([{"role": "user", "content": "q"}], None, None,
                                                 response_format={"type": "text"})


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ([{"role": "wizard", "content": "x"}], "role must be"),
    ([{"content": "x"}], "role must be"),
    ([{"role": "user"}], "missing content"),
    ([{"role": "user", "content": None}], "missing content"),
    ([{"role": "assistant"}], "missing content"),
    ([{"role": "tool", "tool_call_id": "a"}], "missing content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
     "vision inputs are not supported"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "audio inputs are not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "text part"),
    ([{"role": "user", "content": 5}], "string or a list"),
    (["hello"], "must be an object"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}], "name"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "JSON object"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "arguments"),
    ([{"role": "tool", "content": "orphan"}], "tool_call_id"),
])
def test_invalid_messages_raise_request_error(messages, match):
    with pytest.raises(RequestError, match=match):
        render_chat(messages, None, None)
    assert issubclass(RequestError, ValueError)


def test_invalid_request_options_raise_request_error():
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError, match="tools"):
        render_chat(user, [{"type": "function", "function": {}}], None)
    with pytest.raises(RequestError, match="tool_choice"):
        render_chat(user, None, None, tool_choice="sometimes")
    with pytest.raises(RequestError, match="response_format"):
        render_chat(user, None, None, response_format={"type": "yaml"})


def test_input_messages_are_not_mutated():
    messages = copy.deepcopy(CONVERSATION) + [{"role": "developer", "content": [{"type": "text", "text": "t"}]}]
    before = copy.deepcopy(messages)
    render_chat(messages, [WEATHER], None)
    render_chat(messages, [WEATHER], "{{ messages | length }}")
    assert messages == before


# ---------------------------------------------------------------------------------------------------------------
# Jinja templates from the model directory
# ---------------------------------------------------------------------------------------------------------------

K2_STYLE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}\n{% endif -%}"
    "{{ message['content'] or '' }}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in message['tool_calls'] -%}<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>"
    "{{ tc['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking -%}<think>{%- endif -%}{%- endif -%}"
)


def _model_dir_with_template(tmp_path, template: str):
    """A model directory with a tiny tokenizer.json and chat_template.jinja, loaded with the repo's loader."""
    from tokenizers import Tokenizer, models

    from tokenspeed.engine.tokenizer import load_tokenizer

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return load_tokenizer(tmp_path, vocab_size=2)


def test_template_from_model_dir_is_used_instead_of_builtin(tmp_path):
    tok = _model_dir_with_template(tmp_path, K2_STYLE)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    text = render_chat(messages, [WEATHER], tok.chat_template)
    assert text == (
        "<|im_system|>tool_declare<|im_middle|>" + json.dumps([WEATHER], separators=(",", ":")) + "<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather ?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")
    assert text != render_chat(messages, [WEATHER], None)
    assert render_chat(messages, None, tok.chat_template, thinking=True).endswith("<|im_middle|><think>")
    assert render_chat(messages, None, tok.chat_template, add_generation_prompt=False).endswith("<|im_end|>")


def test_template_environment_features():
    template = (
        "{{ raise_exception('no system please') if messages[0]['role'] == 'system' else '' }}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "|{{ bos_token }}|{{ enable_thinking }}|{{ custom }}"
    )
    user = [{"role": "user", "content": "héllo"}, {"role": "user", "content": "2"}, {"role": "user", "content": "3"}]
    out = render_chat(user, None, template, thinking=False, bos_token="<s>", custom=7)
    assert out == ('{"role": "user", "content": "héllo"}{"role": "user", "content": "2"}|<s>|False|7')
    with pytest.raises(RequestError, match="no system please"):
        render_chat([{"role": "system", "content": "s"}], None, template)


def test_template_errors():
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(ConfigError, match="does not compile"):
        render_chat(user, None, "{% for %}")
    with pytest.raises(RequestError):  # the sandbox blocks attribute access to internals
        render_chat(user, None, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError, match="template failed"):
        render_chat(user, None, "{{ messages[0]['content'] + 1 }}")
