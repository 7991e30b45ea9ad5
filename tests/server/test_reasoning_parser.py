"""Reasoning split of Kimi output (k3-chat-format.md section 7, stage 1): whole text and streamed deltas."""

from __future__ import annotations

import random

import pytest

from tokenspeed.server.chat import (
    ChatOutputParser,
    KimiK3ReasoningParser,
    ThinkTagReasoningParser,
    prompt_opens_thinking,
    render_chat,
)

THINK_CLOSE = "<|close|>think<|sep|>"
RESP = "<|open|>response<|sep|>"
RESP_CLOSE = "<|close|>response<|sep|>"
TOOLS = "<|open|>tools<|sep|>"
END = "<|close|>message<|sep|>"

# name -> (output after a thinking prompt, expected reasoning_content, expected remainder for the tool parser)
K3_CASES = {
    "canonical": ("Let me think.\nStep 1 <|clo|> 2" + THINK_CLOSE + RESP + "Answer" + RESP_CLOSE + END,
                  "Let me think.\nStep 1 <|clo|> 2", RESP + "Answer" + RESP_CLOSE + END),
    "redundant_leading_opener_h": ("<|open|>think<|sep|>r" + THINK_CLOSE + RESP + "a", "r", RESP + "a"),
    "response_opener_without_close_a": ("thought" + RESP + "a" + RESP_CLOSE, "thought", RESP + "a" + RESP_CLOSE),
    "tools_opener_without_close_a": ("check" + TOOLS + "x", "check", TOOLS + "x"),
    "elided_sep_c": ("r<|close|>think<|open|>response<|sep|>a", "r", RESP + "a"),
    "truncated_g": ("still thinking <|close|>thi", "still thinking <|close|>thi", ""),
    "empty_think": (THINK_CLOSE + RESP + "a", None, RESP + "a"),
    "opener_seen_keeps_stray_closer": ("<|open|>think<|sep|>deliberating" + RESP_CLOSE + "more",
                                       "deliberating" + RESP_CLOSE + "more", ""),
    "think_close_before_sibling_closer": ("r" + THINK_CLOSE + "a" + RESP_CLOSE + END, "r", "a" + RESP_CLOSE + END),
    "empty": ("", None, ""),
}
# Deviation (b): the model ignored the prefilled think channel and answered directly.
ANSWERED_DIRECTLY = "The answer is 42." + RESP_CLOSE + END


def splits(text: str, n_random: int = 30, seed: int = 0):
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n_random):
        if len(text) > 1:
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
            yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(parser, pieces) -> tuple[str, str]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.push(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("name", sorted(K3_CASES))
def test_k3_whole_split(name):
    text, reasoning, rest = K3_CASES[name]
    assert KimiK3ReasoningParser(in_reasoning=True).split(text) == (reasoning, rest)


@pytest.mark.parametrize("name", sorted(K3_CASES))
def test_k3_streaming_equals_whole_at_every_split(name):
    text, reasoning, rest = K3_CASES[name]
    for pieces in splits(text):
        assert stream(KimiK3ReasoningParser(in_reasoning=True), pieces) == (reasoning or "", rest), pieces


def test_k3_answered_directly_b():
    assert KimiK3ReasoningParser(True).split(ANSWERED_DIRECTLY) == (None, ANSWERED_DIRECTLY)
    assert KimiK3ReasoningParser(True).split("Paris." + END) == (None, "Paris." + END)
    # Streamed, the answer went out as reasoning before the closer showed what it was; it cannot be recalled, so
    # the whole answer follows as content: content equals the whole-text result, reasoning holds a copy.
    for pieces in splits(ANSWERED_DIRECTLY):
        reasoning, content = stream(KimiK3ReasoningParser(True), pieces)
        assert content == ANSWERED_DIRECTLY
        assert "The answer is 42.".startswith(reasoning)
    parsed = ChatOutputParser(in_reasoning=True).parse(ANSWERED_DIRECTLY)
    assert (parsed.reasoning_content, parsed.content) == (None, "The answer is 42.")


def test_k3_thinking_off_is_all_content():
    text = K3_CASES["canonical"][0]
    assert KimiK3ReasoningParser(in_reasoning=False).split(text) == (None, text)
    assert stream(KimiK3ReasoningParser(in_reasoning=False), list(text)) == ("", text)


def test_k3_streaming_holds_back_partial_markers():
    p = KimiK3ReasoningParser(True)
    assert p.push("<|open|>th") == ("", "")  # may be a redundant opener
    assert p.push("ink<|sep|>abc<|close|>th") == ("abc", "")
    assert p.push("inking") == ("<|close|>thinking", "")
    assert p.push(" done<|close|>think<|sep|><|open|>resp") == (" done", "<|open|>resp")
    assert p.reasoning_ended
    assert p.push("onse<|sep|>x") == ("", "onse<|sep|>x")  # afterwards everything passes through
    assert p.finish() == ("", "")
    with pytest.raises(RuntimeError):
        p.push("late")


def test_reasoning_follows_the_prompt():
    user = [{"role": "user", "content": "hi"}]
    assert prompt_opens_thinking(render_chat(user, None, None))
    assert not prompt_opens_thinking(render_chat(user, None, None, thinking=False))
    assert not prompt_opens_thinking(render_chat(user, None, None, add_generation_prompt=False))
    text = "plan" + THINK_CLOSE + RESP + "Hello!" + RESP_CLOSE + END
    on = ChatOutputParser.for_prompt(render_chat(user, None, None)).parse(text)
    assert (on.reasoning_content, on.content, on.tool_calls) == ("plan", "Hello!", [])
    off = ChatOutputParser.for_prompt(render_chat(user, None, None, thinking=False)).parse("Hello!" + RESP_CLOSE + END)
    assert (off.reasoning_content, off.content) == (None, "Hello!")
    truncated = ChatOutputParser(in_reasoning=True).parse("half a tho")
    assert (truncated.reasoning_content, truncated.content) == ("half a tho", None)


@pytest.mark.parametrize("text", [K3_CASES["canonical"][0], "r" + THINK_CLOSE + RESP + "a<b" + RESP_CLOSE
                                  + TOOLS + '<|open|>call tool="f"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'])
def test_full_parser_streams_reasoning_and_content_like_whole(text):
    whole = ChatOutputParser(in_reasoning=True, id_factory=lambda: "call_x").parse(text)
    for pieces in splits(text):
        p = ChatOutputParser(in_reasoning=True, id_factory=lambda: "call_x")
        events = [e for piece in pieces for e in p.push(piece)] + p.finish()
        reasoning = "".join(e.get("reasoning_content", "") for e in events)
        content = "".join(e.get("content", "") for e in events)
        assert (reasoning or None, content or None) == (whole.reasoning_content, whole.content), pieces
        first_content = next((i for i, e in enumerate(events) if "content" in e or "tool_calls" in e), len(events))
        assert all("reasoning_content" not in e for e in events[first_content:])  # reasoning comes first


# ---------------------------------------------------------------------------------------------------------------
# <think> tags (Kimi K2-Thinking / K2.5)
# ---------------------------------------------------------------------------------------------------------------

TAG_CASES = {
    # (in_reasoning, output, reasoning, remainder)
    "prefilled": (True, "hmm</think>answer", "hmm", "answer"),
    "prefilled_repeated_opener": (True, "<think>hmm</think>answer", "hmm", "answer"),
    "sniffed": (False, "<think>hmm</think>answer", "hmm", "answer"),
    "no_thinking": (False, "answer <think> later", None, "answer <think> later"),
    "partial_opener_only": (False, "<thi", None, "<thi"),
    "tool_section_ends_reasoning": (True, "hmm<|tool_calls_section_begin|>x", "hmm", "<|tool_calls_section_begin|>x"),
    "truncated": (True, "hmm </thi", "hmm </thi", ""),
}


@pytest.mark.parametrize("name", sorted(TAG_CASES))
def test_think_tags_whole_and_every_split(name):
    in_reasoning, text, reasoning, rest = TAG_CASES[name]
    assert ThinkTagReasoningParser(in_reasoning).split(text) == (reasoning, rest)
    for pieces in splits(text):
        assert stream(ThinkTagReasoningParser(in_reasoning), pieces) == (reasoning or "", rest), pieces
