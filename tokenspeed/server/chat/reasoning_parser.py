"""Split model output into thinking (`reasoning_content`) and the rest, whole or streamed.

Stage 1 of parsing a Kimi response (k3-chat-format.md section 7). The rest (`content` side) is returned raw, with
its channel markers intact, for the tool parser (stage 2), which extracts the answer text and the tool calls.

Kimi K3 (`KimiK3ReasoningParser`): the generation prompt ends with `<|open|>think<|sep|>` when thinking is on, so
the output starts inside the think channel (`in_reasoning=True`):

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>...<|close|>message<|sep|>

- A redundant leading `<|open|>think<|sep|>` is skipped (deviation h).
- Reasoning ends at the earliest of: the think close (consumed); `<|close|>think` directly followed by `<|open|>`
  (deviation c; `<|close|>think` is consumed); a sibling opener `<|open|>response<|sep|>` / `<|open|>tools<|sep|>`
  (not consumed, deviation a); and, only if no think opener appeared in the output, a sibling closer
  `<|close|>response<|sep|>` / `<|close|>message<|sep|>`: the model ignored the prefilled think channel and
  answered directly (deviation b), so reasoning is empty and everything is content.
- No terminator (truncation): everything is reasoning, content is empty.
- `in_reasoning=False` (thinking off): no stage 1, everything is content.

Kimi K2 thinking models (`ThinkTagReasoningParser`): `<think>...</think>`; reasoning also ends (unconsumed) where a
tool-call section begins.

Streaming: `push(delta)` returns `(reasoning_delta, content_delta)`; a suffix that may still become a terminator
is held back, so the result does not depend on how the text is split into deltas, with one exception: in case
(b) the answer has already been streamed as reasoning when the closer arrives. It cannot be recalled, so the
stream then sends the whole answer again as content: streamed `content` equals the whole-text `content`, and the
streamed reasoning holds a copy of the answer that the whole-text split does not have. `finish()` flushes what
is held when the output ends. Whole text: `split(text)` (= one `push` + `finish` on a fresh parser).
"""

from __future__ import annotations

from tokenspeed.server.chat import markers as mk

__all__ = ["KimiK3ReasoningParser", "ReasoningParser", "ThinkTagReasoningParser"]

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningParser:
    """A think-channel splitter over a streamed text; subclasses set the markers.

    `think_open`: the channel opener, skipped when it leads the output. `ends`: (marker, consumed length) pairs
    that end reasoning; a consumed length shorter than the marker leaves the rest of it to the content side.
    `answer_closers`: markers that, before any think opener was seen in the output, mean the model answered
    directly (reasoning empty, everything content). `sniff_open`: without a prefilled channel, a leading
    `think_open` still starts reasoning.
    """

    think_open: str = ""
    ends: tuple[tuple[str, int], ...] = ()
    answer_closers: tuple[str, ...] = ()
    sniff_open: bool = False

    def __init__(self, in_reasoning: bool = True) -> None:
        self.in_reasoning = in_reasoning
        self._state = _START if (in_reasoning or self.sniff_open) else _CONTENT
        self._tail = ""  # reasoning-region text not yet returned (a possible marker start, or all of it at first)
        self._sent: list[str] = []  # reasoning returned so far, kept while deviation (b) may still apply
        self._observed = False  # a think opener appeared in the output
        self._end_markers = tuple(m for m, _ in self.ends)
        self._all_markers = self._end_markers + tuple(self.answer_closers)
        self._finished = False

    # -- streaming -------------------------------------------------------------------------------------------

    def push(self, delta: str) -> tuple[str, str]:
        """Feed the next piece of output text; returns (reasoning_delta, content_delta)."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self._state == _CONTENT:
            return "", delta
        self._tail += delta
        if self._state == _START:
            if len(self._tail) < len(self.think_open) and self.think_open.startswith(self._tail):
                return "", ""  # could still be the opener
            if self._tail.startswith(self.think_open):
                self._tail = self._tail[len(self.think_open):]
                self._observed = True
            elif not self.in_reasoning:  # sniffing found no opener: plain content
                self._state = _CONTENT
                text, self._tail = self._tail, ""
                return "", text
            self._state = _REASONING
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: flush held-back text (an unterminated think channel is all reasoning)."""
        if self._finished:
            return "", ""
        self._finished = True
        if self._state == _CONTENT:
            return "", ""
        if self._state == _START and not self.in_reasoning:
            return "", self._tail  # a partial opener that never completed is content
        self._state = _REASONING
        return self._scan(final=True)

    @property
    def reasoning_ended(self) -> bool:
        """True once the output has left the think channel (or never was in it)."""
        return self._state == _CONTENT

    def _markers(self) -> tuple[str, ...]:
        return self._end_markers if self._observed else self._all_markers

    def _scan(self, final: bool) -> tuple[str, str]:
        # Sent text never holds a complete marker or a marker start (those stay in the tail), so only the tail
        # needs searching.
        tail, markers = self._tail, self._markers()
        hit = mk.find_first(tail, markers)
        if hit is None:
            end = len(tail) if final else len(tail) - mk.partial_suffix(tail, markers)
            delta, self._tail = tail[:end], tail[end:]
            if delta and self.answer_closers and not self._observed:
                self._sent.append(delta)
            return delta, ""
        pos, marker = hit
        self._state, self._tail = _CONTENT, ""
        if marker in self.answer_closers:  # (b): the whole region was the answer
            sent, self._sent = "".join(self._sent), []
            return "", sent + tail
        self._sent = []
        consumed = dict(self.ends)[marker]
        return tail[:pos], tail[pos + consumed:]

    # -- whole text ------------------------------------------------------------------------------------------

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None when empty, remainder) of a complete output, on a fresh parser."""
        parser = type(self)(self.in_reasoning)
        r1, c1 = parser.push(text)
        r2, c2 = parser.finish()
        return (r1 + r2) or None, c1 + c2


class KimiK3ReasoningParser(ReasoningParser):
    """Kimi K3 XTML think channel (see the module docstring). `in_reasoning`: the prompt ended with
    `<|open|>think<|sep|>` (thinking on)."""

    think_open = mk.THINK_OPEN
    ends = (
        (mk.THINK_CLOSE, len(mk.THINK_CLOSE)),
        (mk.THINK_CLOSE_NO_SEP, len(mk.CLOSE + "think")),
        (mk.RESPONSE_OPEN, 0),
        (mk.TOOLS_OPEN, 0),
    )
    answer_closers = (mk.RESPONSE_CLOSE, mk.MESSAGE_CLOSE)


class ThinkTagReasoningParser(ReasoningParser):
    """`<think>...</think>` (Kimi K2-Thinking / K2.5). `in_reasoning`: the prompt ended with `<think>`; without
    it, output that starts with `<think>` still opens the channel. A tool-call section ends reasoning too."""

    think_open = mk.K2_THINK_OPEN
    ends = ((mk.K2_THINK_CLOSE, len(mk.K2_THINK_CLOSE)), *((m, 0) for m in mk.K2_SECTION_BEGIN))
    sniff_open = True
