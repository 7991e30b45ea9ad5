"""OpenAI chat messages -> prompt text: the model's Jinja chat template, or the built-in Kimi K3 renderer.

`render_chat(messages, tools, template)` validates and normalises the messages, then

- with `template` (the model directory's `chat_template`, e.g. Kimi-Linear's K2-style template): renders it in a
  sandboxed Jinja2 environment with HuggingFace's conventions (`trim_blocks`, `lstrip_blocks`, `loopcontrols`,
  a `tojson` filter that keeps non-ASCII, `raise_exception`, `strftime_now`, `{% generation %}` blocks), with
  `messages`, `tools`, `add_generation_prompt`, `thinking`/`enable_thinking` (when given) and every extra kwarg
  (chat_template_kwargs, `bos_token`, ...) in its context;
- without one: the built-in Kimi K3 XTML layout (K3 checkpoints ship no Jinja template), written from
  `shared/docs/k3-chat-format.md` sections 2-4: tool declaration -> thinking-effort directive -> messages ->
  tool-choice directive -> response-format directive -> generation prompt.

`render_chat_segments` gives the same text as (text, is_control) segments: the K3 reference encodes control
markers with special tokens allowed and every name, attribute piece and body as plain text, each segment on its
own so BPE merges never cross a boundary. Encoding segment by segment reproduces the reference ids when the
tokenizer can encode the plain segments with special tokens disallowed.

Errors: an invalid conversation (unknown role, missing content, an image/audio part, a malformed tool call, an
unresolvable tool result, an unsupported `thinking_effort`, `tool_choice` or `response_format`) raises
`RequestError` (HTTP 400), as does a template that calls `raise_exception` or fails on the request's data. A
template that does not compile raises `ConfigError` (the model directory is broken, not the request).

Normalisation (both paths): `developer` becomes `system`; text content parts are joined into one string; the
input messages are never mutated. Tool-call `arguments` are passed to a Jinja template as given.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
from typing import Any

from tokenspeed.core.sampling_params import RequestError
from tokenspeed.errors import ConfigError
from tokenspeed.server.chat import markers as mk

__all__ = ["THINKING_EFFORTS", "render_chat", "render_chat_segments"]

Segment = tuple[str, bool]  # (text, is_control): control markers may encode as special tokens

_ROLES = ("system", "user", "assistant", "tool")
_MEDIA_PARTS = {"image_url": "vision", "image": "vision", "input_image": "vision", "video_url": "video",
                "video": "video", "input_audio": "audio", "audio_url": "audio", "audio": "audio"}
THINKING_EFFORTS = ("low", "high", "max")
_DEFAULT_EFFORT = "max"  # the HF wrapper's default, so prompts match the reference

_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_NEW_TOOLS_HEADER = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                     "You have access to all existing and extended tools.\nHere are the specs for the extended "
                     "tools.\n\n")
_EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_JSON_RULE = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
              "formatting.")


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


def render_chat(messages: list[dict], tools: list[dict] | None = None, template: str | None = None, *,
                add_generation_prompt: bool = True, thinking: bool | None = None, **kwargs: Any) -> str:
    """The prompt text of a chat request.

    messages: OpenAI chat messages. tools: the request's `tools` (None or [] for none). template: the model's
    Jinja chat template, or None for the built-in Kimi K3 renderer. thinking: None means the template's default
    (built-in: on); `enable_thinking` in kwargs is accepted as an alias. kwargs for the built-in renderer:
    `thinking_effort` (chat_template_kwargs; low/high/max, "medium" rounds to high, default max),
    `reasoning_effort` (the OpenAI field, used when thinking_effort is absent), `tool_choice`, `response_format`,
    `response_schema`; others are ignored. With a template, all kwargs go into its context.
    """
    return "".join(text for text, _ in render_chat_segments(
        messages, tools, template, add_generation_prompt=add_generation_prompt, thinking=thinking, **kwargs))


def render_chat_segments(messages: list[dict], tools: list[dict] | None = None, template: str | None = None, *,
                         add_generation_prompt: bool = True, thinking: bool | None = None,
                         **kwargs: Any) -> list[Segment]:
    """`render_chat` as (text, is_control) segments; a Jinja template gives one segment (text, True)."""
    if thinking is None and kwargs.get("enable_thinking") is not None:
        thinking = bool(kwargs["enable_thinking"])
    msgs = _normalize_messages(messages)
    tools = _check_tools(tools)
    if template is not None:
        return [(_render_jinja(template, msgs, tools, add_generation_prompt, thinking, kwargs), True)]
    return _K3Renderer(thinking=True if thinking is None else bool(thinking)).render(
        msgs, tools, add_generation_prompt=add_generation_prompt, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Validation and normalisation
# ---------------------------------------------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    """A message's content as one string: a string, or the text parts of a part list joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts, got "
                           f"{type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _MEDIA_PARTS:
            raise RequestError(f"{where}.content[{j}]: {_MEDIA_PARTS[kind]} inputs are not supported "
                               "(this server accepts text content parts only)")
        else:
            raise RequestError(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}, "
                               f"got {part!r:.200}")
    return "".join(texts)


def _check_tool_calls(calls: Any, where: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise RequestError(f"{where}.tool_calls[{j}] must be an object")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}.tool_calls[{j}].function.name must be a non-empty string")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON string or an object")
    return calls


def _normalize_messages(messages: Any) -> list[dict]:
    """Validated deep copies: role checked (developer -> system), content a string (None only for an assistant
    turn with tool calls), tool calls well-formed."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object")
        msg = copy.deepcopy(message)
        role = msg.get("role")
        if role == "developer":
            role = msg["role"] = "system"
        if role not in _ROLES:
            raise RequestError(f"{where}.role must be one of system, developer, user, assistant, tool; "
                               f"got {role!r}")
        if role == "assistant":
            msg["tool_calls"] = _check_tool_calls(msg.get("tool_calls"), where)
            if not msg["tool_calls"]:
                del msg["tool_calls"]
        content = msg.get("content")
        if content is None:
            tools_entry = role == "system" and isinstance(msg.get("tools"), list) and msg["tools"]
            if not (tools_entry or msg.get("tool_calls")):
                raise RequestError(f"{where} ({role}) is missing content")
        else:
            msg["content"] = _content_text(content, where)
        out.append(msg)
    return out


def _check_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("tools must be a list of objects")
    for j, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") == "function" and not (
                isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise RequestError(f"tools[{j}].function.name must be a non-empty string")
    return tools


# ---------------------------------------------------------------------------------------------------------------
# Jinja templates from the model directory
# ---------------------------------------------------------------------------------------------------------------


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateRaised(Exception):
    """`raise_exception(msg)` called by a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers of HF templates) renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the model's chat template does not compile: {e.message} (line {e.lineno}); fix "
                          "chat_template.jinja / tokenizer_config.json chat_template") from e


def _render_jinja(template: str, messages: list[dict], tools: list[dict], add_generation_prompt: bool,
                  thinking: bool | None, kwargs: dict[str, Any]) -> str:
    import jinja2

    compiled = _compile(template)
    context = dict(kwargs)
    context.update(messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt)
    if thinking is not None:
        context.update(thinking=thinking, enable_thinking=thinking)
    try:
        return compiled.render(**context)
    except _TemplateRaised as e:
        raise RequestError(f"the chat template rejected the conversation: {e}") from e
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise RequestError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------------------------
# Built-in Kimi K3 renderer
# ---------------------------------------------------------------------------------------------------------------


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _compact_sorted(value: Any) -> str:
    """Keys sorted recursively, compact separators, non-ASCII kept (tool declarations, schemas)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _call_arguments(fn: dict, where: str) -> tuple[dict, str | None]:
    """(arguments object, raw text for a `json` block when the string does not parse)."""
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}, None
    if isinstance(args, dict):
        return args, None
    try:
        parsed = json.loads(args)
    except ValueError:
        return {}, args
    if not isinstance(parsed, dict):
        raise RequestError(f"{where}.function.arguments must encode a JSON object, got {type(parsed).__name__}")
    return parsed, None


def _effort(kwargs: dict[str, Any]) -> str:
    effort = kwargs.get("thinking_effort")
    if effort is None:
        effort = kwargs.get("reasoning_effort")
    if effort is None:
        return _DEFAULT_EFFORT
    if effort == "medium":
        return "high"  # K3 has no medium level; round up as several clients do
    if effort not in THINKING_EFFORTS:
        raise RequestError(f"thinking_effort / reasoning_effort must be one of low, medium (sent as high), high, "
                           f"max; got {effort!r}")
    return effort


def _reorder_tool_results(messages: list[dict]) -> list[dict]:
    """Sort each run of tool messages into the latest assistant's call order when every one matches a call id
    (`tool_call_id`, else `id`); matched messages take the call's name. Other runs stay as they are."""
    out: list[dict] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg["role"] != "tool":
            if msg["role"] == "assistant":
                calls = {}
                for pos, call in enumerate(msg.get("tool_calls") or []):
                    if call.get("id") is not None and str(call["id"]) not in calls:
                        calls[str(call["id"])] = (pos, call.get("function", call)["name"])
            out.append(msg)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i]["role"] == "tool":
            run.append(messages[i])
            i += 1
        keys = [m.get("tool_call_id", m.get("id")) for m in run]
        if all(k is not None and str(k) in calls for k in keys):
            order = sorted(range(len(run)), key=lambda j: (calls[str(keys[j])][0], j))
            for j in order:
                out.append({**run[j], "tool": calls[str(keys[j])][1], "name": calls[str(keys[j])][1]})
        else:
            out.extend(run)
    return out


class _K3Renderer:
    """Builds the K3 prompt as (text, is_control) segments."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.segs: list[Segment] = []

    def ctl(self, text: str) -> None:
        self.segs.append((text, True))

    def txt(self, text: str) -> None:
        if text:
            self.segs.append((text, False))

    def open(self, name: str, attrs: tuple[tuple[str, str], ...] = ()) -> None:
        self.ctl(mk.OPEN)
        self.txt(name)
        for key, value in attrs:
            self.txt(f" {key}")
            self.txt('="')
            self.txt(_escape_attr(value))
            self.txt('"')
        self.ctl(mk.SEP)

    def close(self, name: str) -> None:
        self.ctl(mk.CLOSE)
        self.txt(name)
        self.ctl(mk.SEP)

    def message(self, attrs: tuple[tuple[str, str], ...], body: str) -> None:
        self.open("message", attrs)
        self.txt(body)
        self.close("message")
        self.ctl(mk.END_OF_MSG)

    def tool_declare(self, tools: list[dict], dynamic: bool) -> None:
        header = _NEW_TOOLS_HEADER if dynamic else _TOOLS_HEADER
        body = f"{header}```json\n{_compact_sorted(tools)}\n```"
        self.message((("role", "system"), ("type", "tool-declare")), body)

    def directive(self, kind: str, body: str) -> None:
        self.message((("role", "system"), ("type", kind)), body.strip())

    def render(self, messages: list[dict], tools: list[dict], *, add_generation_prompt: bool,
               **kwargs: Any) -> list[Segment]:
        if tools:
            self.tool_declare(tools, dynamic=False)
        if self.thinking:
            self.directive("thinking-effort", _EFFORT_BODY.format(_effort(kwargs)))
        last_calls: list[dict] = []
        tool_index = 0
        for i, msg in enumerate(_reorder_tool_results(messages)):
            role = msg["role"]
            named = (("name", msg["name"]),) if isinstance(msg.get("name"), str) and msg["name"] else ()
            if role == "system" and isinstance(msg.get("tools"), list) and msg["tools"]:
                self.tool_declare(msg["tools"], dynamic=True)
            elif role in ("system", "user"):
                self.message((("role", role), *named), msg["content"])
            elif role == "assistant":
                last_calls, tool_index = msg.get("tool_calls") or [], 0
                self.open("message", (("role", "assistant"), *named))
                self.assistant_body(msg, i)
                self.close("message")
                self.ctl(mk.END_OF_MSG)
            else:
                tool_index += 1
                name = msg.get("tool") or msg.get("name")
                if not name and tool_index <= len(last_calls):
                    call = last_calls[tool_index - 1]
                    name = call.get("function", call)["name"]
                if not isinstance(name, str) or not name:
                    raise RequestError(f"messages[{i}] (tool): cannot tell which tool this result belongs to; set "
                                       "tool_call_id to the id of a call of the preceding assistant message")
                self.message((("role", "tool"), ("tool", name), ("index", str(tool_index))), msg["content"])
        self.request_directives(kwargs)
        if add_generation_prompt:
            self.open("message", (("role", "assistant"),))
            self.open("think" if self.thinking else "response")
        return self.segs

    def assistant_body(self, msg: dict, i: int) -> None:
        if self.thinking:
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            self.open("think")
            if isinstance(reasoning, str) and reasoning.strip():
                self.txt(reasoning)
            self.close("think")
        self.open("response")
        self.txt(msg.get("content") or "")
        self.close("response")
        calls = msg.get("tool_calls") or []
        if not calls:
            return
        self.open("tools")
        for j, call in enumerate(calls, start=1):
            fn = call.get("function", call)
            self.open("call", (("tool", fn["name"]), ("index", str(j))))
            args, raw = _call_arguments(fn, f"messages[{i}].tool_calls[{j - 1}]")
            if raw is not None:
                self.open("json", (("type", "object"),))
                self.txt(raw)
                self.close("json")
            for key, value in args.items():
                self.open("argument", (("key", str(key)), ("type", _xtml_type(value))))
                self.txt(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                self.close("argument")
            self.close("call")
        self.close("tools")

    def request_directives(self, kwargs: dict[str, Any]) -> None:
        tool_choice = kwargs.get("tool_choice")
        if isinstance(tool_choice, str):
            if tool_choice in _TOOL_CHOICE_BODY:
                self.directive("tool-choice", _TOOL_CHOICE_BODY[tool_choice])
            elif tool_choice != "auto":
                raise RequestError(f"tool_choice must be auto, required, none or a named function; "
                                   f"got {tool_choice!r}")
        elif tool_choice is not None and not isinstance(tool_choice, dict):
            raise RequestError("tool_choice must be a string or an object naming a function")
        fmt = kwargs.get("response_format")
        if fmt is None:
            return
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if kind in (None, "text"):
            return
        if kind == "json_object":
            self.directive("response-format", f"The system is invoked with `response_format=json_object`.\n"
                                              f"{_JSON_RULE}")
        elif kind == "json_schema":
            schema = kwargs.get("response_schema")
            if schema is None and isinstance(fmt, dict):
                spec = fmt.get("json_schema")
                if isinstance(spec, dict):  # .schema, else .json_schema, else the object itself
                    schema = spec.get("schema", spec.get("json_schema", spec))
            self.directive("response-format", f"The system is invoked with `response_format=json_schema`.\n"
                                              f"{_JSON_RULE}\nThe JSON data must match the following schema:\n"
                                              f"```json\n{_compact_sorted(schema)}\n```")
        else:
            raise RequestError(f"response_format.type must be text, json_object or json_schema; got {kind!r}")
