"""Incremental detokenization of a generation stream, with stop strings.

Two layers, one class:

1. Token ids -> text. Tokens are decoded in a small window (prefix/read offsets): the text of the window
   `ids[prefix:]` minus the text of `ids[prefix:read]` is the new text. Decoding a window rather than single tokens
   keeps tokenizers right whose decode of a sequence is not the concatenation of its tokens' decodes (leading-space
   handling of SentencePiece/Metaspace, WordPiece `##` joins). Text is held back while the decoded window ends
   with U+FFFD, so a multi-byte UTF-8 character split across tokens is emitted whole, once complete.
2. Stop strings. Text that contains a stop string is cut before it (or after it, with
   `include_stop_str_in_output`); a tail that could still become a stop string is held back until it is
   disambiguated. So a stream never emits text that is later cut, and the result does not depend on how the
   tokens were grouped into `push` calls: the stop string that is complete earliest in the text wins (on a tie,
   the one that starts earliest).
"""

from __future__ import annotations

from tokenspeed.engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens decoded ahead of the first output token as context for the window.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns the output token ids of one request into text deltas.

    `push(new_ids)` returns the text that became final with these ids; concatenated, the deltas equal `text`.
    After a stop string matched, `stopped` is that string, `text` ends at (or after) it and `push` returns "".
    `finish()` returns the text still held back (an unfinished UTF-8 char as U+FFFD, a partial stop string) when
    the request ends for another reason (eos, length, abort); after it `push` returns "".

    A genuine U+FFFD at the very end of the decoded text is held until the next token or `finish()`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in dict.fromkeys(stop or []) if s]
        self._include_stop = include_stop_str_in_output
        # Token window: ids[:read] are decoded into text already; ids[:prefix] are dropped context.
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._pending = ""  # decoded text not yet emitted (held back for a possible stop string)
        self._text_parts: list[str] = []
        self._stopped: str | None = None
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stopped

    def push(self, new_ids: list[int]) -> str:
        """Add output token ids; returns the new final text (possibly "")."""
        if self._done or self._stopped is not None:
            return ""
        self._ids.extend(new_ids)
        self._pending += self._decode_step(flush=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """End of the request: return everything still held back (a stop string that completes now still cuts)."""
        if self._done or self._stopped is not None:
            self._done = True
            return ""
        self._pending += self._decode_step(flush=True)
        self._done = True
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _decode_step(self, flush: bool) -> str:
        """New text of the window; "" while incomplete (ends in U+FFFD or no growth) unless `flush`."""
        if len(self._ids) == self._read:
            return ""
        full = self._decode(self._ids)
        if not flush and (len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT)):
            return ""
        delta = full[len(self._prefix_text):]
        # Slide the window: the newly read tokens become the context of the next step.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _emit(self, final: bool) -> str:
        """Move the releasable part of `_pending` to the output, applying stop strings."""
        match = self._find_stop()
        if match is not None:
            start, stop = match
            out = self._pending[: start + len(stop) if self._include_stop else start]
            self._stopped = stop
            self._pending = ""
        else:
            keep = 0 if final else self._partial_stop_len()
            out = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(out):]
        if out:
            self._text_parts.append(out)
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """(start, stop string) of the stop string complete earliest in `_pending`, ties to the earliest start."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = self._pending.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `_pending` that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(s[:k]):
                    longest = k
                    break
        return longest
