"""One object per generated choice that turns Kimi output text into OpenAI response fields, whole or streamed.

    parser = ChatOutputParser.for_prompt(prompt, syntax=detect_syntax(tokenizer.chat_template),
                                         tools_enabled=bool(tools) and tool_choice != "none")
    for text_delta in detokenizer deltas:          # detokenized with special tokens kept
        for delta in parser.push(text_delta):      # {"reasoning_content"} / {"content"} / {"tool_calls": [...]}
            send chunk with choices[0].delta = delta
    for delta in parser.finish(): ...
    finish_reason = parser.finish_reason(engine_finish_reason)

or, non-streaming, `ChatOutputParser.for_prompt(...).parse(text)` -> `ParsedOutput`.

It chains the reasoning parser (stage 1) and the tool parser (stage 2). `in_reasoning` comes from the prompt: the
output starts inside the think channel exactly when the prompt ends with the think opener.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspeed.server.chat import markers as mk
from tokenspeed.server.chat.reasoning_parser import KimiK3ReasoningParser, ThinkTagReasoningParser
from tokenspeed.server.chat.tool_parser import IdFactory, KimiK2ToolParser, KimiToolParser, merge_deltas

__all__ = ["SYNTAXES", "ChatOutputParser", "ParsedOutput", "detect_syntax", "prompt_opens_thinking"]

SYNTAXES = ("kimi_k3", "kimi_k2")
_K2_HINTS = ("<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>")


def detect_syntax(chat_template: str | None) -> str:
    """The output syntax a model's chat template implies: "kimi_k2" for K2-style templates (Kimi-Linear,
    K2, K2.5), else "kimi_k3" (no template: the built-in K3 renderer)."""
    if chat_template and any(hint in chat_template for hint in _K2_HINTS):
        return "kimi_k2"
    return "kimi_k3"


def prompt_opens_thinking(prompt: str, syntax: str = "kimi_k3") -> bool:
    """Whether a rendered prompt ends inside an open think channel (the output then starts with reasoning)."""
    opener = mk.THINK_OPEN if syntax == "kimi_k3" else mk.K2_THINK_OPEN
    return prompt.rstrip().endswith(opener)


@dataclass
class ParsedOutput:
    """The message fields of a complete output. Empty strings are None."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ChatOutputParser:
    """Reasoning split + content/tool-call extraction for one choice.

    syntax: "kimi_k3" or "kimi_k2". in_reasoning: the prompt opened the think channel. tools_enabled: parse tool
    calls into `tool_calls` (False: a tools channel in the output is dropped). id_factory: tool call ids (K3).
    """

    def __init__(self, syntax: str = "kimi_k3", *, in_reasoning: bool = False, tools_enabled: bool = True,
                 id_factory: IdFactory | None = None) -> None:
        if syntax not in SYNTAXES:
            raise ValueError(f"syntax must be one of {SYNTAXES}, got {syntax!r}")
        self.syntax, self.in_reasoning, self.tools_enabled = syntax, in_reasoning, tools_enabled
        self._id_factory = id_factory
        k3 = syntax == "kimi_k3"
        self._reasoning = (KimiK3ReasoningParser if k3 else ThinkTagReasoningParser)(in_reasoning)
        self._tools = (KimiToolParser if k3 else KimiK2ToolParser)(tools_enabled=tools_enabled,
                                                                  id_factory=id_factory)

    @classmethod
    def for_prompt(cls, prompt: str, *, syntax: str = "kimi_k3", tools_enabled: bool = True,
                   id_factory: IdFactory | None = None) -> ChatOutputParser:
        """A parser for the output of `prompt` (in_reasoning when the prompt ends with the think opener)."""
        return cls(syntax, in_reasoning=prompt_opens_thinking(prompt, syntax), tools_enabled=tools_enabled,
                   id_factory=id_factory)

    def push(self, delta: str) -> list[dict[str, Any]]:
        """The OpenAI `delta` dicts that the next text delta makes certain (often none, while a marker may be
        forming). Merge each into `choices[i].delta` of one chunk."""
        reasoning, content = self._reasoning.push(delta)
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if content:
            out += self._tools.push(content)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The output ended (stop token, length, stop string, abort): the remaining deltas."""
        reasoning, content = self._reasoning.finish()
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if content:
            out += self._tools.push(content)
        return out + self._tools.finish()

    @property
    def num_tool_calls(self) -> int:
        """Tool calls started so far."""
        return self._tools.num_tool_calls

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI finish_reason: "tool_calls" when calls were parsed and generation stopped normally."""
        if engine_reason == "stop" and self.num_tool_calls:
            return "tool_calls"
        return engine_reason

    def parse(self, text: str) -> ParsedOutput:
        """Fields of a complete output, on a fresh parser with these settings (this one is left untouched)."""
        fresh = ChatOutputParser(self.syntax, in_reasoning=self.in_reasoning, tools_enabled=self.tools_enabled,
                                 id_factory=self._id_factory)
        events = fresh.push(text) + fresh.finish()
        reasoning = "".join(e["reasoning_content"] for e in events if "reasoning_content" in e)
        content, tool_calls = merge_deltas([e for e in events if "reasoning_content" not in e])
        return ParsedOutput(reasoning or None, content, tool_calls)
