"""OpenAI response bodies: chat and completion, whole and as stream chunks (with logprobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenspeed.engine.outputs import CompletionOutput, RequestOutput
from tokenspeed.server.chat.tool_parser import merge_deltas

if TYPE_CHECKING:
    from tokenspeed.server.handlers import Prepared, ServerState, _Choice


def _token_text(state: ServerState, token_id: int) -> str:
    """The token's text; for a token with no text of its own (a byte fragment, an unused id) its raw name or
    `token_id:N`, so distinct tokens keep distinct keys in `top_logprobs`."""
    text = state.tokenizer.decode([token_id], skip_special_tokens=False)
    if text and "\ufffd" not in text:
        return text
    return state.tokenizer.id_to_token(token_id) or f"token_id:{token_id}"


def _chat_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list | None) -> dict[str, Any]:
    content = []
    for j, (tid, lp) in enumerate(zip(ids, lps)):
        text = _token_text(state, tid)
        top = [{"token": _token_text(state, t), "logprob": v, "bytes": list(_token_text(state, t).encode())}
               for t, v in (tops[j] if tops and j < len(tops) else [])]
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(state: ServerState, ids: list[int], lps: list[float | None], tops: list | None,
                         offset: int) -> dict[str, Any]:
    tokens = [_token_text(state, t) for t in ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top = None
    if tops is not None:
        top = [None if t is None else {_token_text(state, i): v for i, v in t} for t in tops]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def base_chunk(state: ServerState, prep: Prepared) -> dict[str, Any]:
    kind = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"
    prefix = "chatcmpl-" if prep.kind == "chat" else "cmpl-"
    return {"id": prefix + prep.id, "object": kind, "created": prep.created, "model": state.model_name}


# ----- chat -----
def chat_response(state: ServerState, prep: Prepared, finals: list[tuple[_Choice, RequestOutput]],
                  usage: dict[str, Any]) -> dict[str, Any]:
    choices = []
    for choice, out in finals:
        c = out.outputs[0]
        assert choice.parser is not None
        parsed = choice.parser.parse(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        finish = "tool_calls" if parsed.tool_calls and c.finish_reason == "stop" else c.finish_reason
        entry: dict[str, Any] = {"index": choice.index, "message": message, "finish_reason": finish,
                                 "stop_reason": c.stop_reason}
        if c.logprobs is not None:
            entry["logprobs"] = _chat_logprobs(state, c.token_ids, c.logprobs, c.top_logprobs)
        choices.append(entry)
    body = base_chunk(state, prep) | {"object": "chat.completion", "choices": choices, "usage": usage}
    return body


def chat_chunks(state: ServerState, prep: Prepared, choice: _Choice, out: RequestOutput) -> list[dict[str, Any]]:
    c: CompletionOutput = out.outputs[0]
    assert choice.parser is not None
    chunks = []
    if not choice.started:
        choice.started = True
        chunks.append(_chat_chunk(state, prep, choice.index, {"role": "assistant", "content": ""}))
    deltas = choice.parser.push(c.delta_text) if c.delta_text else []
    if out.finished:
        deltas += choice.parser.finish()
    logprobs = None
    if c.logprobs is not None and c.delta_token_ids:
        n = len(c.delta_token_ids)
        logprobs = _chat_logprobs(state, c.delta_token_ids, c.logprobs[-n:], (c.top_logprobs or [])[-n:] or None)
    for i, delta in enumerate(deltas):
        chunk = _chat_chunk(state, prep, choice.index, delta)
        if i == 0 and logprobs is not None:
            chunk["choices"][0]["logprobs"] = logprobs
            logprobs = None
        chunks.append(chunk)
    if logprobs is not None:  # a token whose text is still held back (marker forming): logprobs alone
        chunk = _chat_chunk(state, prep, choice.index, {})
        chunk["choices"][0]["logprobs"] = logprobs
        chunks.append(chunk)
    if out.finished:
        chunk = _chat_chunk(state, prep, choice.index, {})
        chunk["choices"][0]["finish_reason"] = choice.parser.finish_reason(c.finish_reason)
        chunk["choices"][0]["stop_reason"] = c.stop_reason
        chunks.append(chunk)
    return chunks


def _chat_chunk(state: ServerState, prep: Prepared, index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return base_chunk(state, prep) | {"choices": [{"index": index, "delta": delta, "logprobs": None,
                                                   "finish_reason": None}]}


# ----- completions -----
def completion_response(state: ServerState, prep: Prepared, finals: list[tuple[_Choice, RequestOutput]],
                        usage: dict[str, Any]) -> dict[str, Any]:
    choices = []
    for choice, out in finals:
        c = out.outputs[0]
        text, logprobs = c.text, None
        prompt_text = prep.prompts[choice.prompt_index][1] or ""
        if prep.echo:
            text = prompt_text + text
        if c.logprobs is not None:
            ids, lps, tops = c.token_ids, list(c.logprobs), c.top_logprobs
            if prep.echo:
                ids, lps, tops = _with_prompt(prep, choice, out, ids, lps, tops)
            logprobs = _completion_logprobs(state, ids, lps, tops, 0)
        choices.append({"index": choice.index, "text": text, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return base_chunk(state, prep) | {"choices": choices, "usage": usage}


def _with_prompt(prep: Prepared, choice: _Choice, out: RequestOutput, ids: list[int], lps: list, tops: Any):
    prompt_ids = prep.prompts[choice.prompt_index][0]
    plp = out.prompt_logprobs or [None] * len(prompt_ids)
    p_lps = [None if e is None else e.get(t) for e, t in zip(plp, prompt_ids)]
    p_tops = [None if e is None else sorted(e.items(), key=lambda kv: -kv[1]) for e in plp]
    return prompt_ids + ids, p_lps + lps, (p_tops + (tops or [[] for _ in ids])) if tops is not None else None


def completion_chunks(state: ServerState, prep: Prepared, choice: _Choice, out: RequestOutput
                      ) -> list[dict[str, Any]]:
    c = out.outputs[0]
    text = c.delta_text
    if prep.echo and not choice.started:
        text = (prep.prompts[choice.prompt_index][1] or "") + text
    choice.started = True
    if not text and not out.finished and not prep.return_token_ids:
        return []
    entry: dict[str, Any] = {"index": choice.index, "text": text, "logprobs": None, "finish_reason": None}
    if prep.return_token_ids:
        entry["token_ids"] = list(c.delta_token_ids)
    if c.logprobs is not None and c.delta_token_ids:
        n = len(c.delta_token_ids)
        entry["logprobs"] = _completion_logprobs(state, c.delta_token_ids, c.logprobs[-n:],
                                                 (c.top_logprobs or [])[-n:] if c.top_logprobs else None, 0)
    if out.finished:
        entry["finish_reason"] = c.finish_reason
        entry["stop_reason"] = c.stop_reason
    return [base_chunk(state, prep) | {"choices": [entry]}]


__all__ = ["base_chunk", "chat_chunks", "chat_response", "completion_chunks", "completion_response", "merge_deltas"]
