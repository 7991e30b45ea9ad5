"""Per-request sampling parameters and the error a bad request raises.

`SamplingParams` follows vLLM's defaults and ranges (OpenAI semantics for the penalties). It is frozen: build a
changed copy with `clone(**changes)`, which validates again. Construction normalises `stop` (a single string
becomes a one-element list, None becomes []) and copies `stop` / `stop_token_ids` into fresh lists, then calls
`validate()` without a vocabulary; the engine calls `validate(vocab_size)` once the model is known, which also
checks `stop_token_ids` against the vocabulary.

Every rejection is a `RequestError` (a `ValueError`, mapped to HTTP 400 by the server) whose message starts with
the field name and states the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # most top logprobs a request may ask for (OpenAI's top_logprobs limit, vLLM's default)
MAX_LOGIT_BIAS = 100.0  # |bias| limit of logit_bias values (OpenAI's range)
SEED_MIN, SEED_END = -(2**63), 2**64  # what torch.Generator.manual_seed accepts: [SEED_MIN, SEED_END)


class RequestError(ValueError):
    """A request the engine rejects as invalid (HTTP 400). The message names the field and its allowed range."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, lo: int | None, hi: int | None, rule: str, optional: bool = False) -> None:
    """Raise unless `value` is an int in [lo, hi] (None bounds are open); `optional` also allows None."""
    if value is None and optional:
        return
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer ({rule}), got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{name} must be {rule}, got {value}")


def _check_float(name: str, value: Any) -> float:
    """Raise unless `value` is a finite real number (int or float, not bool); return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate the tokens of one request. Defaults equal vLLM's.

    n: completions per prompt (>= 1). max_tokens: most generated tokens (>= 1; None = up to the context limit).
    min_tokens: EOS and `stop_token_ids` are masked until this many tokens were generated (0..max_tokens).
    temperature: >= 0; 0 means greedy. top_p: nucleus mass in (0, 1]. top_k: keep the k most likely tokens;
    -1 or 0 disables it. min_p: drop tokens with p < min_p * p_max, in [0, 1]. seed: per-request random stream
    (None: the engine's global generator). presence_penalty / frequency_penalty: in [-2, 2], subtracted from the
    logits of tokens already generated (once / per occurrence). repetition_penalty: > 0, 1 disables; divides
    positive (multiplies negative) logits of tokens seen in the prompt or output. stop: strings that end the
    output. stop_token_ids: token ids that end the output. ignore_eos: keep generating past EOS.
    logprobs: top logprobs returned with each generated token (0 = only the chosen token's; None = none; <= 20).
    prompt_logprobs: likewise for every prompt token. skip_special_tokens: detokenise without special tokens.
    include_stop_str_in_output: keep the matched stop string in the text.
    logit_bias: token id -> a value in [-100, 100] added to that token's logit before sampling (after the
    penalties; the reported logprobs stay the model's); None or {} = none.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {stop!r}")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"stop_token_ids must be a list of integers, got {ids!r}")
        object.__setattr__(self, "stop", list(stop))
        object.__setattr__(self, "stop_token_ids", list(ids))
        bias = self.logit_bias
        if bias is not None and not isinstance(bias, dict):
            raise RequestError(f"logit_bias must be a map of token id to bias, got {bias!r}")
        object.__setattr__(self, "logit_bias", dict(bias) if bias else None)
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax: temperature 0 or top_k 1 (top_p / min_p then do not matter)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        """top_k of -1 or 0 means no top-k cut."""
        return self.top_k > 0

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied; the copy is normalised and validated like a new instance."""
        return dataclasses.replace(self, **changes)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError for the first out-of-range field. With `vocab_size`, stop_token_ids must be < it."""
        self._validate_lengths()
        self._validate_sampling()
        self._validate_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            rule = f"between 0 and {MAX_LOGPROBS} (or null)"
            _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, rule, optional=True)
        self._validate_stops(vocab_size)
        self._validate_logit_bias(vocab_size)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    def _validate_lengths(self) -> None:
        _check_int("n", self.n, 1, None, ">= 1")
        _check_int("max_tokens", self.max_tokens, 1, None, ">= 1 (or null)", optional=True)
        hi = self.max_tokens
        _check_int("min_tokens", self.min_tokens, 0, hi, ">= 0" if hi is None else f"between 0 and max_tokens ({hi})")

    def _validate_sampling(self) -> None:
        if _check_float("temperature", self.temperature) < 0:
            raise RequestError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, None, "-1 or 0 (disabled) or >= 1")
        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("seed", self.seed, SEED_MIN, SEED_END - 1, "in [-2**63, 2**64) (or null)", optional=True)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {value}")
        if _check_float("repetition_penalty", self.repetition_penalty) <= 0:
            raise RequestError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")

    def _validate_stops(self, vocab_size: int | None) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop must hold non-empty strings, got {s!r}")
        hi = None if vocab_size is None else vocab_size - 1
        rule = ">= 0" if hi is None else f"in [0, {vocab_size}) (the vocabulary)"
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids", tok, 0, hi, rule)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        hi = None if vocab_size is None else vocab_size - 1
        rule = "token ids >= 0" if hi is None else f"token ids in [0, {vocab_size}) (the vocabulary)"
        for tok, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", tok, 0, hi, rule)
            if abs(_check_float("logit_bias", bias)) > MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
