"""Answer text and tool calls from Kimi model output, whole or streamed (OpenAI `content` / `tool_calls`).

Stage 2 of parsing a Kimi response (k3-chat-format.md section 7); it runs on what the reasoning parser leaves.

Kimi K3 (`KimiToolParser`), after the think channel:

    <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
      <|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>

- Content: the text of the response channel, plus any text before it (thinking-off output starts inside the
  channel, deviation (b) output has no opener), up to the response close or the tools opener. Stray
  `<|open|>response<|sep|>`, `<|close|>response<|sep|>`, `<|open|>message<|sep|>`, `<|close|>message<|sep|>` and
  `<|end_of_msg|>` are removed. Text after the response close is dropped (well-formed output has only markers
  there); empty content is None.
- Tools: only the first tools section, up to its close (text after it never becomes calls). Each
  `<|open|>call ATTRS<|sep|>...<|close|>call<|sep|>` is one call; the name is the `tool` attribute (`&quot;`
  then `&amp;` unescaped); calls with an empty name are dropped; the XTML `index` is ignored (emission order).
- Arguments: `arguments` is a JSON object string of the argument elements in emission order, built like
  `json.dumps(obj, ensure_ascii=False)` (separators ", " and ": "). A `string` value (the default type) is the
  raw text; other types go through `json.loads`, and a value that does not parse is kept as a JSON string of the
  raw text (no error). A history-style `<|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>` block gives
  `arguments` = RAW verbatim. A call without arguments gives "{}".
- Ids: K3 emits none; each call gets a fresh opaque `call_<24 hex>` (`new_call_id`; inject `id_factory` for
  tests). It only has to round-trip through the client's `tool_call_id`, which the K3 renderer matches.
- `tools_enabled=False` (no tools declared, or tool_choice "none"): the tools channel is parsed and dropped,
  never leaked as content, and no calls are returned.

Kimi K2 / Kimi-Linear (`KimiK2ToolParser`): content is the text before `<|tool_calls_section_begin|>` (also the
singular spelling); each `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>` is a call with
the model's own id (`functions.NAME:N`), the name taken from it (after the last "." before the ":"), and ARGS
passed through verbatim (malformed JSON stays a raw string).

Streaming (`push(delta) -> list[dict]`, then `finish()`): the events are OpenAI `choices[].delta` dicts:
`{"content": str}`; `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}`
once a call's header is complete; then `{"tool_calls": [{"index", "function": {"arguments": chunk}}]}`. String
argument values stream as JSON-escaped fragments while they are generated; other values are sent when complete.
Concatenated, the chunks of a call equal its final `arguments`. Text that may be the start of a marker is held
back until it is decided, and sent text is never revised, so the events do not depend on how the output is split
into deltas: `parse(text)` is exactly the merged events of one `push(text)` + `finish()`. An output truncated
inside a call (max_tokens) still closes it in `finish()`: a string value cut short is kept, an unfinished
non-string value is dropped, and the JSON object is closed, so `arguments` stays valid JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tokenspeed.server.chat import markers as mk

__all__ = ["KimiK2ToolParser", "KimiToolParser", "ToolCallParser", "merge_deltas", "new_call_id", "parse"]

IdFactory = Callable[[], str]

_ATTR = re.compile(r'([A-Za-z_][\w\-]*)="([^"]*)"')


def new_call_id() -> str:
    """An opaque OpenAI-style tool call id: `call_` + 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _attrs(header: str) -> dict[str, str]:
    """`key="value"` attributes of an XTML open header (after the element name), unescaped."""
    return {k: _unescape(v) for k, v in _ATTR.findall(header)}


def _json_fragment(text: str) -> str:
    """`text` JSON-escaped without quotes; per character, so fragments concatenate to the escape of the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(raw: str) -> str:
    """A typed (non-string) argument value as JSON: parsed and re-serialised, else the raw text as a string."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        value = raw
    return json.dumps(value, ensure_ascii=False)


def merge_deltas(events: Sequence[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Fold streamed events into (content or None, tool_calls) in the non-streaming OpenAI shape."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if "content" in event:
            content.append(event["content"])
        for tc in event.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            if "id" in tc:
                call["id"] = tc["id"]
            fn = tc.get("function", {})
            if "name" in fn:
                call["function"]["name"] = fn["name"]
            call["function"]["arguments"] += fn.get("arguments", "")
    return "".join(content) or None, [calls[i] for i in sorted(calls)]


class ToolCallParser:
    """Common streaming machinery: a text buffer scanned state by state, and the event list it produces.

    Subclasses implement `_step(final) -> bool` (consume what can be decided now; True if more may be decided
    without new text) and `_finish_state()` (close what is open when the output ends).
    """

    def __init__(self, *, tools_enabled: bool = True, id_factory: IdFactory | None = None) -> None:
        self.tools_enabled = tools_enabled
        self._new_id = id_factory or new_call_id
        self._buf = ""
        self._events: list[dict[str, Any]] = []
        self._num_calls = 0
        self._call_index: int | None = None  # index of the open call, None when no call or a dropped one
        self._finished = False

    @property
    def num_tool_calls(self) -> int:
        """Calls started so far (their headers were emitted)."""
        return self._num_calls

    def push(self, delta: str) -> list[dict[str, Any]]:
        """Feed the next piece of text; returns the delta events that became certain."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        self._buf += delta
        while self._step(False):
            pass
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: flush held-back text and close an unfinished call."""
        if self._finished:
            return []
        while self._step(True):
            pass
        self._finish_state()
        self._finished = True
        return self._take()

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content or None, tool_calls) of a complete output, on a fresh parser with the same settings."""
        parser = type(self)(tools_enabled=self.tools_enabled, id_factory=self._new_id)
        return merge_deltas(parser.push(text) + parser.finish())

    # -- helpers for subclasses ------------------------------------------------------------------------------

    def _take(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._events and set(self._events[-1]) == {"content"}:
            self._events[-1]["content"] += text
        else:
            self._events.append({"content": text})

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        """Open a call (dropped when tools are disabled or the name is empty)."""
        if not self.tools_enabled or not name:
            self._call_index = None
            return
        self._call_index = self._num_calls
        self._num_calls += 1
        self._events.append({"tool_calls": [{
            "index": self._call_index, "id": call_id or self._new_id(), "type": "function",
            "function": {"name": name, "arguments": ""}}]})

    def _args(self, text: str) -> None:
        if self._call_index is None or not text:
            return
        last = self._events[-1] if self._events else None
        if last is not None and "tool_calls" in last:
            tc = last["tool_calls"][0]
            if tc["index"] == self._call_index and set(tc) == {"index", "function"}:
                tc["function"]["arguments"] += text
                return
        self._events.append({"tool_calls": [{"index": self._call_index, "function": {"arguments": text}}]})

    def _scan(self, markers: Sequence[str], final: bool) -> tuple[str, str | None]:
        """Cut the buffer at the first complete marker: (text before it, marker). Without a complete marker:
        (the text that cannot start a marker, None); the rest stays buffered unless `final`."""
        hit = mk.find_first(self._buf, markers)
        if hit is not None:
            pos, marker = hit
            text, self._buf = self._buf[:pos], self._buf[pos + len(marker):]
            return text, marker
        keep = 0 if final else mk.partial_suffix(self._buf, markers)
        cut = len(self._buf) - keep
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return text, None

    def _header(self, ends: Sequence[str]) -> tuple[str, str] | None:
        """Cut the buffer after a header ending in one of `ends`: (header text, end marker), or None if
        incomplete (the buffer is kept)."""
        hit = mk.find_first(self._buf, ends)
        if hit is None:
            return None
        pos, marker = hit
        header, self._buf = self._buf[:pos], self._buf[pos + len(marker):]
        return header, marker

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _finish_state(self) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------------------
# Kimi K3 (XTML)
# ---------------------------------------------------------------------------------------------------------------

# States of the K3 machine.
_PRE = "pre"  # before any response opener: text is content
_RESPONSE = "response"  # inside the response channel: text is content
_AFTER_RESPONSE = "after_response"  # after the response close: text is dropped
_TOOLS = "tools"  # inside the tools section, between calls
_CALL_HEADER = "call_header"  # after `<|open|>call`, waiting for `<|sep|>`
_CALL = "call"  # inside a call, between argument elements
_ARG_HEADER = "arg_header"
_ARG = "arg"  # inside an argument value
_JSON_HEADER = "json_header"
_JSON = "json"  # inside a raw `json` block
_DONE = "done"  # after the tools section: everything is dropped

_STRAY = (mk.RESPONSE_OPEN, mk.RESPONSE_CLOSE, mk.MESSAGE_OPEN, mk.MESSAGE_CLOSE, mk.END_OF_MSG)
_MARKERS = {
    _PRE: (*_STRAY, mk.TOOLS_OPEN),
    _RESPONSE: (*_STRAY, mk.TOOLS_OPEN),
    _AFTER_RESPONSE: (mk.RESPONSE_OPEN, mk.TOOLS_OPEN),
    _TOOLS: (mk.CALL_OPEN_PREFIX, mk.TOOLS_CLOSE, mk.MESSAGE_CLOSE),
    _CALL: (mk.ARGUMENT_OPEN_PREFIX, mk.JSON_OPEN_PREFIX, mk.CALL_CLOSE, mk.TOOLS_CLOSE, mk.MESSAGE_CLOSE),
    _ARG: (mk.ARGUMENT_CLOSE, mk.CALL_CLOSE, mk.TOOLS_CLOSE),
    _JSON: (mk.JSON_CLOSE, mk.CALL_CLOSE, mk.TOOLS_CLOSE),
}
_HEADERS = {_CALL_HEADER, _ARG_HEADER, _JSON_HEADER}


class KimiToolParser(ToolCallParser):
    """Kimi K3 content and tool calls (see the module docstring). Feed it the content side of the reasoning
    parser (or the whole output when thinking is off)."""

    def __init__(self, *, tools_enabled: bool = True, id_factory: IdFactory | None = None) -> None:
        super().__init__(tools_enabled=tools_enabled, id_factory=id_factory)
        self._state = _PRE
        self._mode: str | None = None  # arguments of the open call: None (nothing yet), "object" or "raw"
        self._arg_open = False  # an argument is being emitted (string: its opening quote was sent)
        self._arg_key = ""
        self._arg_string = True
        self._arg_raw = ""  # a non-string value, buffered until complete
        self._arg_prefix = ""  # "{" or ", ": what precedes the buffered non-string argument
        self._sent = False  # the open call has sent arguments text
        self._json_emit = False  # the open json block is the call's arguments

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == _DONE:
            self._buf = ""
            return False
        if state in _HEADERS:
            got = self._header((mk.SEP,))
            if got is None:
                return False
            self._on_header(state, got[0])
            return True
        text, marker = self._scan(_MARKERS[state], final)
        self._on_text(state, text)
        if marker is None:
            return False
        self._on_marker(state, marker)
        return True

    def _on_text(self, state: str, text: str) -> None:
        if state in (_PRE, _RESPONSE):
            self._content(text)
        elif state == _ARG and self._arg_open:
            if self._arg_string:
                self._args(_json_fragment(text))
            else:
                self._arg_raw += text
        elif state == _JSON and self._json_emit:
            self._args(text)
        # other states: text between elements is dropped

    def _on_marker(self, state: str, marker: str) -> None:
        if marker == mk.TOOLS_OPEN:
            self._state = _TOOLS
        elif marker == mk.RESPONSE_OPEN:
            self._state = _RESPONSE
        elif marker == mk.RESPONSE_CLOSE:
            self._state = _AFTER_RESPONSE if state == _RESPONSE else _PRE
        elif state in (_PRE, _RESPONSE):
            pass  # a stray message marker or end_of_msg: removed
        elif marker == mk.CALL_OPEN_PREFIX:
            self._state = _CALL_HEADER
        elif marker == mk.ARGUMENT_OPEN_PREFIX:
            self._state = _ARG_HEADER
        elif marker == mk.JSON_OPEN_PREFIX:
            self._state = _JSON_HEADER
        elif marker in (mk.ARGUMENT_CLOSE, mk.JSON_CLOSE):
            self._end_argument(complete=True)
            self._state = _CALL
        elif marker == mk.CALL_CLOSE:
            self._end_call(complete=True)
            self._state = _TOOLS
        else:  # tools close, or message close inside the tools section
            self._end_call(complete=True)
            self._state = _DONE

    def _on_header(self, state: str, header: str) -> None:
        attrs = _attrs(header)
        if state == _CALL_HEADER:
            self._start_call(attrs.get("tool", ""))
            self._mode = None
            self._state = _CALL
        elif state == _ARG_HEADER:
            self._state = _ARG
            self._arg_key = attrs.get("key", "")
            self._arg_string = attrs.get("type", "string") == "string"
            self._arg_raw = ""
            self._arg_open = self._call_index is not None and self._mode != "raw"
            if self._arg_open:
                sep = "{" if self._mode is None else ", "
                self._mode = "object"
                if self._arg_string:
                    self._args(f"{sep}{json.dumps(self._arg_key, ensure_ascii=False)}: \"")
                else:
                    self._arg_prefix = sep
        else:
            self._state = _JSON
            self._json_emit = self._call_index is not None and self._mode is None
            if self._json_emit:
                self._mode = "raw"

    def _end_argument(self, complete: bool) -> None:
        """Close the open argument element (or json block). An incomplete non-string value is dropped."""
        if self._state == _ARG and self._arg_open:
            if self._arg_string:
                self._args('"')
            elif complete:
                key = json.dumps(self._arg_key, ensure_ascii=False)
                self._args(f"{self._arg_prefix}{key}: {_json_value(self._arg_raw)}")
            elif self._arg_prefix == "{":
                self._mode = None  # nothing of this call's arguments was sent
        self._arg_open = self._json_emit = False

    def _end_call(self, complete: bool) -> None:
        if self._state in (_ARG, _JSON):
            self._end_argument(complete)
        if self._call_index is not None:
            if self._mode == "object":
                self._args("}")
            elif not self._sent:
                self._args("{}")
        self._call_index, self._mode = None, None

    def _args(self, text: str) -> None:
        self._sent = self._sent or bool(text)
        super()._args(text)

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        self._sent = False
        super()._start_call(name, call_id)

    def _finish_state(self) -> None:
        if self._state in (_CALL_HEADER, _ARG_HEADER, _JSON_HEADER, _CALL, _ARG, _JSON):
            if self._state == _CALL_HEADER:
                self._call_index = None  # the header never completed: no call was started
            self._end_call(complete=False)
        self._state = _DONE


# ---------------------------------------------------------------------------------------------------------------
# Kimi K2 / Kimi-Linear
# ---------------------------------------------------------------------------------------------------------------

_K2_CONTENT, _K2_SECTION, _K2_CALL_ID, _K2_ARGS, _K2_DONE = "content", "section", "call_id", "args", "done"
_K2_MARKERS = {
    _K2_CONTENT: (*mk.K2_SECTION_BEGIN, mk.K2_CALL_BEGIN),
    _K2_SECTION: (mk.K2_CALL_BEGIN, *mk.K2_SECTION_END),
    _K2_ARGS: (mk.K2_CALL_END, *mk.K2_SECTION_END),
}


def _k2_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    return call_id.split(":", 1)[0].rsplit(".", 1)[-1].strip()


class KimiK2ToolParser(ToolCallParser):
    """Kimi K2 / Kimi-Linear tool-call tokens (see the module docstring). Ids are the model's own."""

    def __init__(self, *, tools_enabled: bool = True, id_factory: IdFactory | None = None) -> None:
        super().__init__(tools_enabled=tools_enabled, id_factory=id_factory)
        self._state = _K2_CONTENT
        self._sent_args = False

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == _K2_DONE:
            self._buf = ""
            return False
        if state == _K2_CALL_ID:
            got = self._header((mk.K2_ARGUMENT_BEGIN, mk.K2_CALL_END))
            if got is None:
                return False
            call_id = got[0].strip()
            self._start_call(_k2_name(call_id), call_id or None)
            self._sent_args = False
            if got[1] == mk.K2_CALL_END:
                self._end_call()
                self._state = _K2_SECTION
            else:
                self._state = _K2_ARGS
            return True
        text, marker = self._scan(_K2_MARKERS[state], final)
        if state == _K2_CONTENT:
            self._content(text)
        elif state == _K2_ARGS and text:
            self._args(text)
            self._sent_args = True
        if marker is None:
            return False
        if marker == mk.K2_CALL_BEGIN:
            self._state = _K2_CALL_ID
        elif marker in mk.K2_SECTION_BEGIN:
            self._state = _K2_SECTION
        elif marker == mk.K2_CALL_END:
            self._end_call()
            self._state = _K2_SECTION
        else:  # section end
            if state == _K2_ARGS:
                self._end_call()
            self._state = _K2_DONE
        return True

    def _end_call(self) -> None:
        if not self._sent_args:
            self._args("{}")
        self._call_index = None

    def _finish_state(self) -> None:
        if self._state == _K2_ARGS:
            self._end_call()
        self._state = _K2_DONE


def parse(text: str, *, tools_enabled: bool = True,
          id_factory: IdFactory | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, tool_calls) of a complete Kimi K3 output (after the think channel)."""
    return KimiToolParser(tools_enabled=tools_enabled, id_factory=id_factory).parse(text)
