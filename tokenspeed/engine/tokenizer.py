"""Tokenizers: text <-> token ids for the engine and the server.

`Tokenizer` is the interface the rest of the engine uses. Two implementations:

- `HFTokenizer` wraps a HuggingFace fast tokenizer (`tokenizer.json`, read with the Rust `tokenizers` library) and
  takes its special tokens, bos and eos ids from the usual HF side files of the model directory.
- `ByteTokenizer` is the fallback for models without tokenizer files (the tiny built-in presets): ids 0, 1, 2 are
  `<pad>`, `<s>`, `</s>` and byte `b` is id `3 + b`.

`load_tokenizer` picks one for a model directory. Kimi's official tokenizer (tiktoken through remote code) is not
supported: a directory with `tiktoken.model` but no `tokenizer.json` raises `ConfigError`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from tokenspeed.engine.segment_cache import SegmentCache
from tokenspeed.errors import ConfigError

__all__ = [
    "BYTE_OFFSET",
    "BYTE_VOCAB_MIN",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

# Named special tokens of HF tokenizer configs (`tokenizer_config.json`, `special_tokens_map.json`).
_NAMED_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class Tokenizer(ABC):
    """What the engine needs from a tokenizer.

    Contracts:
    - `encode` never adds special tokens unless `add_special_tokens` is true (then the tokenizer's own template,
      e.g. a leading bos, is applied).
    - `decode` of ids the tokenizer does not know (ids past its vocabulary, up to the model's `vocab_size`) yields
      no text for them; it never raises for an int id. Invalid UTF-8 becomes U+FFFD.
    - `vocab_size` is the number of ids the model may produce (the logits width); every id below it decodes.
    - `eos_token_ids` are the ids that end generation (non-empty in practice, may hold several).
    - `all_special_ids` includes every eos id and the bos id.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    all_special_ids: set[int]
    chat_template: str | None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`."""

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text (user content): special-token strings in it stay ordinary text."""
        return self.encode(text)

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Ids of a rendered chat prompt given as (text, is_control) segments: control text (the template's
        markers) may contain special tokens; the rest is encoded as plain text, so a user cannot inject them.
        Each segment is encoded on its own, so long ones are remembered (`SegmentCache`): the next turn of a
        conversation encodes only its new messages."""
        cache = self.__dict__.get("_segment_cache")
        if cache is None:
            cache = self._segment_cache = SegmentCache()
        ids: list[int] = []
        for text, control in segments:
            pieces = self.split_at_added_tokens(text) if control and len(text) >= cache.min_chars else None
            if pieces is None:
                ids.extend(cache.encode(text, control, self.encode if control else self.encode_plain))
                continue
            for piece, token_id in pieces:  # a whole rendered conversation: cached message by message
                if token_id is not None:
                    ids.append(token_id)
                else:
                    ids.extend(cache.encode(piece, True, self.encode))
        return ids

    def split_at_added_tokens(self, text: str) -> list[tuple[str, int | None]] | None:
        """`text` as (piece, None) runs of ordinary text and (token, id) added tokens, when encoding the runs one by
        one gives exactly `encode(text)`; None when this tokenizer cannot promise that (then `encode_segments`
        encodes control text whole). A Jinja chat template renders a conversation as one control text: split so,
        its messages are cached one by one."""
        return None

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special_tokens`."""

    @abstractmethod
    def id_to_token(self, i: int) -> str | None:
        """The raw token string of id `i` (for logprob display), or None if the id has no token."""


# ---------------------------------------------------------------------------------------------------------------
# Byte tokenizer (tiny presets)
# ---------------------------------------------------------------------------------------------------------------

BYTE_OFFSET = 3
BYTE_VOCAB_MIN = BYTE_OFFSET + 256
_BYTE_SPECIALS = ("<pad>", "<s>", "</s>")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: 0 `<pad>`, 1 `<s>` (bos), 2 `</s>` (eos), byte `b` -> `3 + b`.

    Ids from 259 up to `vocab_size` exist in the model but mean nothing: they decode to "" and have no token
    string. `eos_token_ids` defaults to `(2,)`; a model config may name others (they join `all_special_ids`, but
    `decode` only ever skips ids 0-2). Raises `ConfigError` if `vocab_size < 259`.
    """

    pad_token_id = 0

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        if vocab_size < BYTE_VOCAB_MIN:
            raise ConfigError(
                f"the byte-level fallback tokenizer needs vocab_size >= {BYTE_VOCAB_MIN} (3 special ids + 256 "
                f"bytes), but the model has vocab_size={vocab_size}; use a config with a larger vocab_size or put "
                "a tokenizer.json in the model directory"
            )
        self.vocab_size = vocab_size
        self.bos_token_id = 1
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids)) or (2,)
        self.all_special_ids = {0, 1, 2, *self.eos_token_ids}
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of `text` shifted by 3; with `add_special_tokens`, `<s>` first."""
        ids = [BYTE_OFFSET + b for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Bytes decoded as UTF-8 with replacement chars; specials as `<s>` etc. unless skipped."""
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_VOCAB_MIN:
                buf.append(i - BYTE_OFFSET)
            elif 0 <= i < BYTE_OFFSET and not skip_special_tokens:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                parts.append(_BYTE_SPECIALS[i])
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def id_to_token(self, i: int) -> str | None:
        """`<s>` etc. for specials; the char for printable ASCII bytes, `<0xNN>` for other bytes; else None."""
        if 0 <= i < BYTE_OFFSET:
            return _BYTE_SPECIALS[i]
        if BYTE_OFFSET <= i < BYTE_VOCAB_MIN:
            b = i - BYTE_OFFSET
            return chr(b) if 0x20 <= b < 0x7F else f"<0x{b:02X}>"
        return None


# ---------------------------------------------------------------------------------------------------------------
# HF fast tokenizer
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}; fix or remove the file") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token named in a tokenizer config: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any, source: str) -> list[int]:
    """`eos_token_id`-style value (absent, an int or a list of ints) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source} must be an int or a list of ints, got {value!r}")
    return list(values)


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` if present, else `chat_template` of tokenizer_config.json (a string, or a list of
    named templates of which "default", else the first, is taken)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` loaded from `model_dir/tokenizer.json`, with the model's side files applied.

    - `added_tokens_decoder` of tokenizer_config.json is applied: each entry must sit at its declared id (tokens
      missing from tokenizer.json are appended when their id is the next free one); entries marked special and the
      named special tokens (`eos_token`, `bos_token`, ..., `additional_special_tokens`) of tokenizer_config.json
      and special_tokens_map.json become special, so `decode(skip_special_tokens=True)` drops them.
    - `eos_token_ids` merges, in this order and without duplicates: the `eos_token_ids` argument,
      generation_config.json `eos_token_id`, config.json `eos_token_id` (also under `text_config`), and the
      tokenizer's `eos_token`. Kimi stops on both `<|end_of_msg|>` (generation config) and `[EOS]` (tokenizer).
    - `bos_token_id`: the tokenizer's `bos_token`, else `bos_token_id` of generation_config.json / config.json.
    - `vocab_size` is the larger of the tokenizer's size (with added tokens) and the model's `vocab_size`.
    - `chat_template`: chat_template.jinja, else tokenizer_config.json `chat_template`.

    Raises `ConfigError` when tokenizer.json is missing or unreadable, or the side files contradict it.
    """

    def __init__(self, model_dir: str | Path, vocab_size: int = 0, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(_missing_tokenizer_message(model_dir))
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise ConfigError(f"cannot load {path} with the `tokenizers` library: {e}") from e
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        st_map = _read_json(model_dir / "special_tokens_map.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self._apply_added_tokens(tok_cfg, path)
        named = self._apply_named_specials(tok_cfg, st_map)
        self.bos_token_id = named.get("bos_token")
        if self.bos_token_id is None:
            bos = _id_list(gen_cfg.get("bos_token_id"), "bos_token_id") or _id_list(
                model_cfg.get("bos_token_id"), "bos_token_id")
            self.bos_token_id = bos[0] if bos else None
        self.eos_token_ids = _merge_eos(eos_token_ids, gen_cfg, model_cfg, named.get("eos_token"))
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), vocab_size)
        specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        bos = set() if self.bos_token_id is None else {self.bos_token_id}
        self.all_special_ids = specials | set(self.eos_token_ids) | bos
        self.chat_template = _chat_template(model_dir, tok_cfg)

    def _apply_added_tokens(self, tok_cfg: dict[str, Any], path: Path) -> None:
        """Apply tokenizer_config.json `added_tokens_decoder` ({"id": {"content", "special", ...}})."""
        decoder = tok_cfg.get("added_tokens_decoder") or {}
        entries = []
        for key, info in decoder.items():
            content = _token_content(info)
            if content is None or not str(key).isdigit():
                raise ConfigError(f"tokenizer_config.json added_tokens_decoder has a malformed entry {key!r}")
            entries.append((int(key), content, bool(info.get("special", False))))
        for token_id, content, special in sorted(entries):
            existing = self._tok.token_to_id(content)
            if existing is None:
                size = self._tok.get_vocab_size(with_added_tokens=True)
                if token_id != size:
                    raise ConfigError(
                        f"tokenizer_config.json declares token {content!r} at id {token_id}, but {path} lacks it "
                        f"and its next free id is {size}; regenerate tokenizer.json from the full tokenizer"
                    )
                self._add_token(content, special)
            elif existing != token_id:
                raise ConfigError(
                    f"tokenizer_config.json declares token {content!r} at id {token_id}, but {path} has it at "
                    f"id {existing}; the two files come from different tokenizers"
                )
            elif special:
                self._mark_special(token_id)

    def _apply_named_specials(self, tok_cfg: dict[str, Any], st_map: dict[str, Any]) -> dict[str, int]:
        """Mark named special tokens special; returns {key: id} of the named ones found in the vocabulary."""
        found: dict[str, int] = {}
        for cfg in (st_map, tok_cfg):  # tokenizer_config.json wins where both name a token
            for key in _NAMED_SPECIAL_KEYS:
                content = _token_content(cfg.get(key))
                token_id = None if content is None else self._tok.token_to_id(content)
                if token_id is not None:
                    found[key] = token_id
                    self._mark_special(token_id)
            for value in cfg.get("additional_special_tokens") or []:
                content = _token_content(value)
                token_id = None if content is None else self._tok.token_to_id(content)
                if token_id is not None:
                    self._mark_special(token_id)
        return found

    def _add_token(self, content: str, special: bool) -> None:
        from tokenizers import AddedToken

        token = AddedToken(content, special=special, normalized=False)
        if special:
            self._tok.add_special_tokens([token])
        else:
            self._tok.add_tokens([token])

    def _mark_special(self, token_id: int) -> None:
        """Make an added token special (kept whole by encode, dropped by decode when skipping specials).

        Ordinary vocabulary tokens are left alone: making them special would change how text encodes."""
        from tokenizers import AddedToken

        t = self._tok.get_added_tokens_decoder().get(token_id)
        if t is not None and not t.special:
            self._tok.add_special_tokens([AddedToken(
                t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip, normalized=t.normalized,
                special=True)])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in `text` become their special ids (HF semantics)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def split_at_added_tokens(self, text: str) -> list[tuple[str, int | None]] | None:
        """HF tokenizers cut the input at added tokens (leftmost, longest) before normalising and pre-tokenising
        each run on its own, so the runs encode independently, unless an added token strips its neighbours
        (lstrip / rstrip / single_word) or is matched on normalised text, or a pre-tokenizer treats the input's
        first run specially (checked once on samples: `_added_token_pattern`)."""
        pattern = self._added_token_pattern()
        if pattern is None:
            return None
        out: list[tuple[str, int | None]] = []
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                out.append((text[pos : m.start()], None))
            out.append((m.group(), self._added_ids[m.group()]))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], None))
        return out

    def _added_token_pattern(self) -> re.Pattern | None:
        """The alternation of every added token (longest first), or None when splitting at them is not exact.
        Built once."""
        if "_added_pattern" in self.__dict__:
            return self._added_pattern
        self._added_pattern = None
        tokens = list(self._tok.get_added_tokens_decoder().values())
        if not tokens or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens):
            return None  # normalised added tokens are matched in a second pass, after the others: not one split
        self._added_ids = {t.content: self._tok.token_to_id(t.content) for t in tokens}
        pattern = re.compile("|".join(re.escape(c) for c in sorted(self._added_ids, key=len, reverse=True)))
        self._added_pattern = pattern
        names = list(self._added_ids)
        samples = [f"{lead}{a} x{b}\n  y {a}\n\nz{b}{a}w  " for a, b in zip(names[:4], names[-4:])
                   for lead in ("", " q\n")]
        for sample in samples:
            pieces = self.split_at_added_tokens(sample)
            got = [i for piece, tid in pieces for i in ([tid] if tid is not None else self.encode(piece))]
            if got != self.encode(sample):
                self._added_pattern = None
                break
        return self._added_pattern

    def encode_plain(self, text: str) -> list[int]:
        self._tok.encode_special_tokens = True  # special-token strings are split like any text
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (unknown ids yield nothing)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The raw token string (e.g. `Ġhello` for byte-level BPE), or None for ids the tokenizer lacks."""
        return self._tok.id_to_token(i) if i >= 0 else None


def _merge_eos(explicit: tuple[int, ...], gen_cfg: dict[str, Any], model_cfg: dict[str, Any],
               tokenizer_eos: int | None) -> tuple[int, ...]:
    """Stop ids from every source, first occurrence order, no duplicates."""
    ids = [int(i) for i in explicit]
    ids += _id_list(gen_cfg.get("eos_token_id"), "generation_config.json eos_token_id")
    ids += _id_list(model_cfg.get("eos_token_id"), "config.json eos_token_id")
    text_cfg = model_cfg.get("text_config")
    if isinstance(text_cfg, dict):
        ids += _id_list(text_cfg.get("eos_token_id"), "config.json text_config.eos_token_id")
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return tuple(dict.fromkeys(ids))


def _missing_tokenizer_message(model_dir: Path) -> str:
    if (model_dir / "tiktoken.model").is_file():
        return (
            f"{model_dir} has a tiktoken tokenizer (tiktoken.model, loaded by remote code), which TokenSpeed does "
            "not support: a HuggingFace fast tokenizer file tokenizer.json is required. Convert the tokenizer "
            "to tokenizer.json (e.g. with transformers' PreTrainedTokenizerFast conversion) and put it in the "
            "model directory."
        )
    return f"{model_dir} has no tokenizer.json (a HuggingFace fast tokenizer file is required)"


def load_tokenizer(model_dir: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The tokenizer of a model: `HFTokenizer` if `model_dir/tokenizer.json` exists, else `ByteTokenizer`.

    `vocab_size` and `eos_token_ids` come from the model config. Raises `ConfigError` for a directory that only
    has a tiktoken tokenizer (`tiktoken.model`), or when the byte fallback does not fit `vocab_size`.
    """
    if model_dir is not None:
        path = Path(model_dir)
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        if (path / "tiktoken.model").is_file():
            raise ConfigError(_missing_tokenizer_message(path))
    return ByteTokenizer(vocab_size, eos_token_ids)
