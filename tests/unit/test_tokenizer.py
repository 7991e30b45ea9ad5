"""Tokenizers: the byte fallback and HF fast tokenizers built in the test (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tokenspeed.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tokenspeed.errors import ConfigError

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "你好世界，今天天气很好。日本語のテキストもあります。",
    "emoji: 🎉🚀👍🏽 and accents: café naïve résumé",
    "def f(x):\n    return x * 2  # code\n",
]
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>"]
TEXTS = ["hello world", "你好世界", "🎉 party 👍🏽!", "mixed: café 日本語 🚀\n\ttabs", ""]


def build_byte_bpe(vocab_size: int = 400) -> RustTokenizer:
    """A tiny byte-level BPE (GPT-2 style) trained on CORPUS; specials take ids 0, 1, 2."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def write_model_dir(path: Path, files: dict[str, object] | None = None) -> Path:
    """tokenizer.json from build_byte_bpe plus the given JSON (dict) or text (str) side files."""
    path.mkdir(parents=True, exist_ok=True)
    build_byte_bpe().save(str(path / "tokenizer.json"))
    for name, content in (files or {}).items():
        text = content if isinstance(content, str) else json.dumps(content)
        (path / name).write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------- ByteTokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer(300)
    ids = tok.encode(text)
    assert ids == [3 + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == [1, *ids]


def test_byte_special_tokens() -> None:
    tok = ByteTokenizer(512)
    ids = [1, *tok.encode("hi"), 2, 0]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi</s><pad>"
    assert tok.decode([*tok.encode("a"), 259, 400, 511, *tok.encode("b")]) == "ab"  # ids >= 259 mean nothing
    assert tok.vocab_size == 512 and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.all_special_ids == {0, 1, 2}
    assert tok.chat_template is None


def test_byte_invalid_utf8_uses_replacement_chars() -> None:
    tok = ByteTokenizer(259)
    assert tok.decode([3 + 0xFF, *tok.encode("a")]) == "\ufffda"
    truncated = tok.encode("你")[:2]  # 2 of 3 bytes
    assert tok.decode(truncated) == "\ufffd"
    assert tok.decode([*truncated, *tok.encode("x")]) == "\ufffdx"
    # A special token between the bytes of a char splits it when shown, joins it when skipped.
    ni = tok.encode("你")
    assert tok.decode([ni[0], 1, *ni[1:]]) == "你"
    assert tok.decode([ni[0], 1, *ni[1:]], skip_special_tokens=False).count("\ufffd") >= 1


def test_byte_vocab_too_small() -> None:
    with pytest.raises(ConfigError, match="259"):
        ByteTokenizer(258)
    with pytest.raises(ConfigError):
        load_tokenizer(None, vocab_size=100)


def test_byte_id_to_token_and_eos_override() -> None:
    tok = ByteTokenizer(300, eos_token_ids=(2, 299, 2))
    assert tok.eos_token_ids == (2, 299)
    assert 299 in tok.all_special_ids
    assert [tok.id_to_token(i) for i in (0, 1, 2)] == ["<pad>", "<s>", "</s>"]
    assert tok.id_to_token(3 + ord("a")) == "a"
    assert tok.id_to_token(3 + 0x0A) == "<0x0A>"
    assert tok.id_to_token(3 + 0xE4) == "<0xE4>"
    assert tok.id_to_token(259) is None and tok.id_to_token(-1) is None


def test_load_tokenizer_falls_back_to_bytes(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None, vocab_size=300), ByteTokenizer)
    (tmp_path / "config.json").write_text("{}")
    tok = load_tokenizer(tmp_path, vocab_size=300, eos_token_ids=(7,))
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == (7,)


# ------------------------------------------------------------------------------------------------- HFTokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip(tmp_path: Path, text: str) -> None:
    tok = load_tokenizer(write_model_dir(tmp_path), vocab_size=0)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) <= len(text.encode("utf-8"))


def test_hf_special_tokens(tmp_path: Path) -> None:
    tok = HFTokenizer(write_model_dir(tmp_path))
    ids = tok.encode("hi<|im_end|>there[EOS]")
    assert 2 in ids and 1 in ids  # special strings in text encode to their ids
    assert tok.decode(ids) == "hithere"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>there[EOS]"
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(tok.encode(" world")[0]).startswith("Ġ")  # raw byte-level token string
    assert tok.id_to_token(10**6) is None
    assert tok.chat_template is None and tok.bos_token_id is None


def test_hf_eos_bos_from_config_files(tmp_path: Path) -> None:
    n = build_byte_bpe().get_vocab_size(with_added_tokens=True)  # first id past tokenizer.json
    files = {
        "tokenizer_config.json": {
            "bos_token": "[BOS]",
            "eos_token": {"content": "[EOS]", "special": True},
            "added_tokens_decoder": {
                "2": {"content": "<|im_end|>", "special": True},
                str(n): {"content": "<|end_of_msg|>", "special": True},  # not in tokenizer.json: appended
                str(n + 1): {"content": "<|plain|>", "special": False},
            },
        },
        "generation_config.json": {"eos_token_id": n},
        "config.json": {"eos_token_id": [n, 2], "text_config": {"eos_token_id": 2}, "vocab_size": 512},
    }
    tok = load_tokenizer(write_model_dir(tmp_path, files), vocab_size=512, eos_token_ids=(2,))
    assert tok.eos_token_ids == (2, n, 1)  # argument, generation config, config, tokenizer eos_token
    assert tok.bos_token_id == 0
    assert tok.vocab_size == 512
    assert tok.encode("<|end_of_msg|>") == [n]
    assert tok.encode("a<|plain|>")[-1] == n + 1
    assert tok.decode([n, n + 1]) == "<|plain|>"  # special skipped, plain added token kept
    assert {0, 1, 2, n} <= tok.all_special_ids and n + 1 not in tok.all_special_ids
    assert tok.decode([*tok.encode("ok"), 511]) == "ok"  # model-only id past the tokenizer decodes to nothing


def test_hf_special_tokens_map_and_int_ids(tmp_path: Path) -> None:
    files = {
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "additional_special_tokens": ["[BOS]"]},
        "config.json": {"eos_token_id": 1, "bos_token_id": 0},
    }
    tok = HFTokenizer(write_model_dir(tmp_path, files))
    assert tok.eos_token_ids == (1, 2)
    assert tok.bos_token_id == 0


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"tokenizer_config.json": {"added_tokens_decoder": {"1": {"content": "<|im_end|>"}}}}, "id 2"),
        ({"tokenizer_config.json": {"added_tokens_decoder": {"999": {"content": "<|x|>"}}}}, "next free id"),
        ({"generation_config.json": {"eos_token_id": "2"}}, "eos_token_id"),
        ({"config.json": "{not json"}, "config.json"),
    ],
)
def test_hf_inconsistent_side_files(tmp_path: Path, files: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HFTokenizer(write_model_dir(tmp_path, files))


def test_hf_chat_template(tmp_path: Path) -> None:
    tok = HFTokenizer(write_model_dir(tmp_path / "a", {"tokenizer_config.json": {"chat_template": "{{ x }}"}}))
    assert tok.chat_template == "{{ x }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = HFTokenizer(write_model_dir(tmp_path / "b", {"tokenizer_config.json": {"chat_template": named}}))
    assert tok.chat_template == "D"
    files = {"tokenizer_config.json": {"chat_template": "old"}, "chat_template.jinja": "{% for m in messages %}"}
    tok = HFTokenizer(write_model_dir(tmp_path / "c", files))
    assert tok.chat_template == "{% for m in messages %}"  # the .jinja file wins


def test_tiktoken_only_dir_raises(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_text("aGVsbG8= 0\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {}}))
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(tmp_path, vocab_size=163840)
    with pytest.raises(ConfigError, match="tiktoken"):
        HFTokenizer(tmp_path)


def test_hf_missing_tokenizer_json_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot load"):
        HFTokenizer(tmp_path)


def test_encode_segments_remembers_long_segments(tmp_path: Path) -> None:
    """A conversation's next turn: its long segments come from the segment cache (counted as hits), the ids equal
    a fresh tokenizer's for the whole prompt, and the same long text as a control segment (special-token strings
    are tokens) and as user content (they stay text) are kept apart."""
    from tokenspeed.engine.segment_cache import MIN_CHARS

    tok, fresh = (load_tokenizer(write_model_dir(tmp_path / d), 400) for d in ("a", "b"))
    long_text = (" ".join(CORPUS) + "<|im_end|>") * (MIN_CHARS // 40)
    assert len(long_text) >= MIN_CHARS
    turn1 = [("[BOS]", True), (long_text, False), ("<|im_end|>", True)]
    turn2 = turn1 + [(long_text[::-1], False), (long_text, True)]
    first = tok.encode_segments(turn1)
    second = tok.encode_segments([("".join(list(t)), c) for t, c in turn2])  # new str objects, as from a new body
    cache = tok._segment_cache
    # long_text as plain reused, reversed encoded; as control it is split at its added tokens into short runs
    # (under MIN_CHARS: encoded, not kept)
    assert (cache.hits, cache.misses) == (1, 2)
    assert first == fresh.encode_segments(turn1) and second == fresh.encode_segments(turn2)
    assert second[: len(first)] == first
    control = tok.encode(long_text)
    assert tok.encode_plain(long_text) != control and second[-len(control):] == control


def test_segment_cache_bound() -> None:
    from tokenspeed.engine.segment_cache import SegmentCache

    cache = SegmentCache(max_tokens=10, min_chars=2)
    enc = lambda s: [ord(c) for c in s]
    assert list(cache.encode("abcdef", False, enc)) == enc("abcdef")
    assert list(cache.encode("ghij", False, enc)) == enc("ghij") and cache.num_tokens == 10
    cache.encode("klm", False, enc)  # 13 > 10: the oldest entry goes
    assert cache.num_tokens == 7 and len(cache) == 2
    cache.encode("x" * 11, False, enc)  # longer than the bound: returned, not kept
    assert cache.num_tokens == 7 and cache.encode("a", False, enc) == [97]  # under min_chars: not kept


def _conversation_turns(rng, specials: list[str], turns: int = 3) -> list[str]:
    """Rendered turns as a chat template makes them: markers (added tokens) around long runs of text."""
    parts = ["hello", "world", " ", "  ", "\n", "café", "日本語", "x=1", "(", ")", "w"]
    out = []
    for _ in range(turns):
        body = "".join(rng.choice(parts) for _ in range(150))
        out.append(f"{rng.choice(specials)}user{rng.choice(specials)}{body}{rng.choice(specials)}")
    return out


def _metaspace_bpe() -> RustTokenizer:
    """A BPE trained through a Metaspace pre-tokenizer that marks only the input's first run ("first")."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS * 4, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    return tok


@pytest.mark.parametrize("variant", ["byte_bpe", "lstrip", "metaspace_first"])
def test_control_text_split_at_added_tokens_equals_the_whole_encode(tmp_path: Path, variant: str) -> None:
    """A rendered conversation (one control segment) is encoded in runs between added tokens, message by message
    through the segment cache, only where that is exact: the ids always equal encoding the text whole, for a
    byte-level BPE (split, and the next turn reuses the earlier runs), one whose special token strips its left
    neighbour (not split), and a Metaspace pre-tokenizer that marks only the input's first run (the load-time
    samples catch it: not split)."""
    import random

    from tokenizers import AddedToken

    raw = _metaspace_bpe() if variant == "metaspace_first" else build_byte_bpe()
    if variant == "lstrip":
        raw.add_special_tokens([AddedToken("<|lstrip|>", lstrip=True, special=True)])
    path = tmp_path / "m"
    path.mkdir()
    raw.save(str(path / "tokenizer.json"))
    tok = HFTokenizer(path)
    specials = SPECIALS + (["<|lstrip|>"] if variant == "lstrip" else [])
    turns = _conversation_turns(random.Random(variant), specials)
    assert (tok.split_at_added_tokens(turns[0]) is not None) == (variant == "byte_bpe")
    conversation = ""
    for turn in turns:  # each request: the conversation so far plus one more message
        conversation += turn
        assert tok.encode_segments([(conversation, True)]) == tok.encode(conversation)
    if variant == "byte_bpe":
        assert tok._segment_cache.hits >= 3  # turn 2 reused turn 1's message, turn 3 both
