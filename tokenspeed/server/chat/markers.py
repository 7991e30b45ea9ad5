"""Marker strings of the Kimi chat formats, and the two string helpers the streaming parsers share.

Kimi K3 (XTML): three control tokens `<|open|>`, `<|close|>`, `<|sep|>` frame every element; element names and
attributes are plain text, so one marker such as `<|open|>think<|sep|>` spans several tokens. Every message ends
with `<|end_of_msg|>` (id 163586, the generation stop id; `[EOS]` 163585 also stops). Kimi K2 / Kimi-Linear use
role tokens and dedicated tool-call tokens. See `shared/docs/k3-chat-format.md`.

The parsers match marker *text*, so the server must detokenize with special tokens kept
(`skip_special_tokens=False`) and without spaces between them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

# --- Kimi K3 -------------------------------------------------------------------------------------------------
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
K3_STOP_TOKENS = ("<|end_of_msg|>", "[EOS]")
K3_STOP_TOKEN_IDS = (163586, 163585)


def open_tag(name: str) -> str:
    return f"{OPEN}{name}{SEP}"


def close_tag(name: str) -> str:
    return f"{CLOSE}{name}{SEP}"


THINK_OPEN = open_tag("think")
THINK_CLOSE = close_tag("think")
THINK_CLOSE_NO_SEP = f"{CLOSE}think{OPEN}"  # deviation (c): `<|close|>think` directly followed by `<|open|>`
RESPONSE_OPEN = open_tag("response")
RESPONSE_CLOSE = close_tag("response")
TOOLS_OPEN = open_tag("tools")
TOOLS_CLOSE = close_tag("tools")
MESSAGE_OPEN = open_tag("message")
MESSAGE_CLOSE = close_tag("message")
CALL_OPEN_PREFIX = f"{OPEN}call"  # followed by attributes and <|sep|>
CALL_CLOSE = close_tag("call")
ARGUMENT_OPEN_PREFIX = f"{OPEN}argument"
ARGUMENT_CLOSE = close_tag("argument")
JSON_OPEN_PREFIX = f"{OPEN}json"
JSON_CLOSE = close_tag("json")

# --- Kimi K2 / Kimi-Linear ------------------------------------------------------------------------------------
K2_THINK_OPEN = "<think>"
K2_THINK_CLOSE = "</think>"
K2_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
K2_SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
K2_CALL_BEGIN = "<|tool_call_begin|>"
K2_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
K2_CALL_END = "<|tool_call_end|>"


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest complete occurrence of any marker in `text[start:]`: (position, marker), or None.

    On a tie the longer marker wins."""
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(marker) > len(best[1]))):
            best = (i, marker)
    return best


@functools.lru_cache(maxsize=64)
def _window(markers: tuple[str, ...]) -> tuple[int, frozenset[str]]:
    return max(len(m) for m in markers) - 1, frozenset(m[0] for m in markers)


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker (text to hold back while
    streaming, because the next delta may complete the marker)."""
    if not markers or not text:
        return 0
    width, first_chars = _window(tuple(markers))
    start = max(0, len(text) - width)
    if len(first_chars) == 1:  # the usual case: every marker starts with "<"
        (first,) = first_chars
        i = text.find(first, start)
        while i >= 0:
            suffix = text[i:]
            if any(len(m) > len(suffix) and m.startswith(suffix) for m in markers):
                return len(text) - i
            i = text.find(first, i + 1)
        return 0
    for i in range(start, len(text)):
        if text[i] in first_chars:
            suffix = text[i:]
            if any(len(m) > len(suffix) and m.startswith(suffix) for m in markers):
                return len(text) - i
    return 0
