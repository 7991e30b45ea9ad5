"""Chat layer of the OpenAI server: prompt rendering and parsing of Kimi output (k3-chat-format.md).

- `render_chat` / `render_chat_segments` (template.py): messages + tools -> prompt text, with the model's Jinja
  chat template or the built-in Kimi K3 renderer.
- `ChatOutputParser` (output.py): generated text -> `reasoning_content` / `content` / `tool_calls`, whole or as
  streaming deltas; built from `KimiK3ReasoningParser` / `ThinkTagReasoningParser` (reasoning_parser.py) and
  `KimiToolParser` / `KimiK2ToolParser` (tool_parser.py).
"""

from tokenspeed.server.chat.markers import K3_STOP_TOKEN_IDS, K3_STOP_TOKENS
from tokenspeed.server.chat.output import (
    SYNTAXES,
    ChatOutputParser,
    ParsedOutput,
    detect_syntax,
    prompt_opens_thinking,
)
from tokenspeed.server.chat.reasoning_parser import (
    KimiK3ReasoningParser,
    ReasoningParser,
    ThinkTagReasoningParser,
)
from tokenspeed.server.chat.template import THINKING_EFFORTS, render_chat, render_chat_segments
from tokenspeed.server.chat.tool_parser import (
    KimiK2ToolParser,
    KimiToolParser,
    ToolCallParser,
    merge_deltas,
    new_call_id,
    parse,
)

__all__ = [
    "K3_STOP_TOKENS",
    "K3_STOP_TOKEN_IDS",
    "SYNTAXES",
    "THINKING_EFFORTS",
    "ChatOutputParser",
    "KimiK2ToolParser",
    "KimiK3ReasoningParser",
    "KimiToolParser",
    "ParsedOutput",
    "ReasoningParser",
    "ThinkTagReasoningParser",
    "ToolCallParser",
    "detect_syntax",
    "merge_deltas",
    "new_call_id",
    "parse",
    "prompt_opens_thinking",
    "render_chat",
    "render_chat_segments",
]
