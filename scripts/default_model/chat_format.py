"""The K3 chat format of the default model: special tokens, a segment-wise renderer, and the Jinja template.

Follows shared/docs/k3-chat-format.md. The K3 vocabulary keeps 256 reserved special ids after its BPE ranks
(163584..163839); the default model does the same at 7936..8191, so the special id of a K3 token is
`SPECIAL_BASE + (K3 id - 163584)`: [BOS] 7936, [EOS] 7937, <|end_of_msg|> 7938 (the generation stop id),
<|open|> 7939, <|close|> 7940, <|sep|> 7941, media tokens 7954..7957, [UNK] 8190, [PAD] 8191. K3 has no think or
tool tokens: reasoning, response and tool calls are XTML elements built from <|open|>/<|close|>/<|sep|>.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

VOCAB_SIZE = 8192
NUM_SPECIAL = 256
SPECIAL_BASE = VOCAB_SIZE - NUM_SPECIAL  # 7936 BPE ranks (256 bytes + merges), then the reserved special ids
K3_SPECIAL_BASE = 163584

# Named K3 special tokens by offset from the first special id (k3-chat-format.md section 1).
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}


def special_tokens() -> list[str]:
    """All 256 special tokens in id order (unnamed offsets are `<|reserved_token_N|>`)."""
    return [NAMED_SPECIALS.get(i, f"<|reserved_token_{i}|>") for i in range(NUM_SPECIAL)]


def special_id(token: str) -> int:
    return SPECIAL_BASE + special_tokens().index(token)


BOS, EOS, END_OF_MSG = "[BOS]", "[EOS]", "<|end_of_msg|>"
OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"

# --------------------------------------------------------------------------------------------------------------
# Segment-wise rendering ([MK] build_chat_segments, the subset the default model is trained on)
# --------------------------------------------------------------------------------------------------------------

Segment = tuple[str, bool]  # (text, is a control marker: encoded with special tokens allowed)


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(name: str, attrs: Sequence[tuple[str, str]] = ()) -> list[Segment]:
    segs: list[Segment] = [(OPEN, True), (name, False)]
    for key, value in attrs:
        segs += [(f" {key}", False), ('="', False), (_escape(value), False), ('"', False)]
    return segs + [(SEP, True)]


def _close(name: str) -> list[Segment]:
    return [(CLOSE, True), (name, False), (SEP, True)]


def render_segments(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    thinking: bool = True) -> list[Segment]:
    """Segments of a conversation of system / user / assistant messages with text content.

    Assistant turns carry a think channel iff `thinking`, and always a response channel; the generation prompt
    ends inside `think` (thinking on) or `response` (off). Tools, effort and media are not used by the default
    model's training data (the Jinja template renders them).
    """
    segs: list[Segment] = []
    for m in messages:
        role = {"developer": "system"}.get(m["role"], m["role"])
        attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
        segs += _open("message", attrs)
        if role == "assistant":
            if thinking:
                reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
                segs += _open("think") + ([(reasoning, False)] if reasoning.strip() else []) + _close("think")
            segs += _open("response") + ([(m["content"], False)] if m.get("content") else []) + _close("response")
        elif role in ("user", "system"):
            if m.get("content"):
                segs.append((m["content"], False))
        else:
            raise ValueError(f"role {role!r} is not used by the default model's chat data")
        segs += _close("message") + [(END_OF_MSG, True)]
    if add_generation_prompt:
        segs += _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")
    return segs


def encode_segments(segs: Sequence[Segment], encode_text: Callable[[str], list[int]]) -> list[int]:
    """Ids of segments: markers are their special ids, each text segment is encoded on its own."""
    ids: list[int] = []
    for text, is_marker in segs:
        ids += [special_id(text)] if is_marker else encode_text(text)
    return ids


def render_text(segs: Sequence[Segment]) -> str:
    return "".join(t for t, _ in segs)


# --------------------------------------------------------------------------------------------------------------
# Jinja chat template (flat string; HF-style environment: trim_blocks, lstrip_blocks, tojson with sort_keys)
# --------------------------------------------------------------------------------------------------------------

EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort={effort}`."
)

CHAT_TEMPLATE = r"""{#- Kimi K3 chat format (shared/docs/k3-chat-format.md), rendered as one flat string.
    Variables: messages, tools, add_generation_prompt (default true), thinking (default true; enable_thinking is
    an alias), thinking_effort (low | high | max; none: no directive), tool_choice, response_format.
    Order: tool-declare, thinking-effort, messages, tool-choice, response-format, generation prompt. -#}
{%- set thinking = thinking if thinking is defined else (enable_thinking if enable_thinking is defined else true) -%}
{%- set add_generation_prompt = add_generation_prompt if add_generation_prompt is defined else true -%}
{%- macro esc(v) -%}{{ (v | string).replace('&', '&amp;').replace('"', '&quot;') }}{%- endmacro -%}
{%- macro system_msg(type, body) -%}
<|open|>message role="system" type="{{ type }}"<|sep|>{{ body }}<|close|>message<|sep|><|end_of_msg|>
{%- endmacro -%}
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}{%- elif part.type in ('image', 'image_url') -%}<|kimi_image_placeholder|>{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- macro argtype(v) -%}
{%- if v is sameas true or v is sameas false -%}boolean{%- elif v is none -%}null{%- elif v is number -%}number
{%- elif v is string -%}string{%- elif v is mapping -%}object{%- else -%}array{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{ system_msg('tool-declare', '# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n' ~ (tools | tojson(separators=(',', ':'), sort_keys=True)) ~ '\n```') }}
{%- endif -%}
{%- if thinking and thinking_effort is defined and thinking_effort -%}
{%- if thinking_effort not in ('low', 'high', 'max') -%}{{ raise_exception('thinking_effort must be low, high or max') }}{%- endif -%}
{{ system_msg('thinking-effort', '`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=' ~ thinking_effort ~ '`.') }}
{%- endif -%}
{%- set ns = namespace(tool_index=0, last_calls=[]) -%}
{%- for m in messages -%}
{%- set role = 'system' if m.role == 'developer' else m.role -%}
{%- set name_attr = (' name="' ~ esc(m.name) ~ '"') if m.name else '' -%}
{%- if role == 'system' and m.tools -%}
{{ system_msg('tool-declare', '## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n' ~ (m.tools | tojson(separators=(',', ':'), sort_keys=True)) ~ '\n```') }}
{%- elif role in ('user', 'system') -%}
<|open|>message role="{{ role }}"{{ name_attr }}<|sep|>{{ text_of(m.content) }}<|close|>message<|sep|><|end_of_msg|>
{%- elif role == 'assistant' -%}
{%- set ns.tool_index = 0 -%}
{%- set ns.last_calls = m.tool_calls or [] -%}
<|open|>message role="assistant"{{ name_attr }}<|sep|>
{%- if thinking -%}
{%- set r = m.reasoning_content or m.reasoning or '' -%}
<|open|>think<|sep|>{{ r if (r | trim) else '' }}<|close|>think<|sep|>
{%- endif -%}
<|open|>response<|sep|>{{ text_of(m.content) }}<|close|>response<|sep|>
{%- if m.tool_calls -%}
<|open|>tools<|sep|>
{%- for call in m.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
<|open|>call tool="{{ esc(fn.name) }}" index="{{ loop.index }}"<|sep|>
{%- set args = fn.arguments -%}
{%- if args is string and args | trim -%}{%- set args = args | fromjson if 'fromjson' in filters else args -%}{%- endif -%}
{%- if args is mapping -%}
{%- for k, v in args.items() -%}
<|open|>argument key="{{ esc(k) }}" type="{{ argtype(v) }}"<|sep|>{{ v if v is string else (v | tojson) }}<|close|>argument<|sep|>
{%- endfor -%}
{%- elif args is string and args | trim -%}
<|open|>json type="object"<|sep|>{{ args }}<|close|>json<|sep|>
{%- endif -%}
<|close|>call<|sep|>
{%- endfor -%}
<|close|>tools<|sep|>
{%- endif -%}
<|close|>message<|sep|><|end_of_msg|>
{%- elif role == 'tool' -%}
{%- set ns.tool_index = ns.tool_index + 1 -%}
{%- set call = ns.last_calls[ns.tool_index - 1] if ns.last_calls | length >= ns.tool_index else none -%}
{%- set tname = m.tool or m.name or (call.function.name if call and call.function is defined else (call.name if call else none)) -%}
{%- if not tname -%}{{ raise_exception('cannot resolve the tool name of a tool message') }}{%- endif -%}
<|open|>message role="tool" tool="{{ esc(tname) }}" index="{{ ns.tool_index }}"<|sep|>{{ text_of(m.content) }}<|close|>message<|sep|><|end_of_msg|>
{%- endif -%}
{%- endfor -%}
{%- if tool_choice is defined and tool_choice in ('required', 'none') -%}
{%- if tool_choice == 'required' -%}
{{ system_msg('tool-choice', 'The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.') }}
{%- else -%}
{{ system_msg('tool-choice', 'The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.') }}
{%- endif -%}
{%- endif -%}
{%- if response_format is defined and response_format and response_format.type in ('json_object', 'json_schema') -%}
{%- if response_format.type == 'json_object' -%}
{{ system_msg('response-format', 'The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.') }}
{%- else -%}
{%- set js = response_format.json_schema -%}
{%- set schema = (js.schema if js.schema is defined else (js.json_schema if js.json_schema is defined else js)) if js else none -%}
{{ system_msg('response-format', 'The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the following schema:\n```json\n' ~ (schema | tojson(separators=(',', ':'), sort_keys=True)) ~ '\n```') }}
{%- endif -%}
{%- endif -%}
{%- if add_generation_prompt -%}
<|open|>message role="assistant"<|sep|>{{ '<|open|>think<|sep|>' if thinking else '<|open|>response<|sep|>' }}
{%- endif -%}
"""


def hf_jinja_env():
    """A Jinja environment like transformers' chat-template one (for tests and rendering here)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def apply_chat_template(messages: Sequence[dict[str, Any]], template: str = CHAT_TEMPLATE, **kwargs: Any) -> str:
    return hf_jinja_env().from_string(template).render(messages=list(messages), **kwargs)
