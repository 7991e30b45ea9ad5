"""Incremental detokenizer: streamed deltas equal the full decode; split UTF-8 chars; stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.unit.test_tokenizer import CORPUS, write_model_dir
from tokenspeed.engine.detokenizer import IncrementalDetokenizer
from tokenspeed.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

PROMPT = "User: say something nice 😊\nAssistant:"


@pytest.fixture
def hf_tok(tmp_path: Path) -> HFTokenizer:
    return HFTokenizer(write_model_dir(tmp_path), vocab_size=420)


@pytest.fixture
def metaspace_tok(tmp_path: Path) -> HFTokenizer:
    """A SentencePiece-style BPE whose decode strips the first token's leading space: not prefix-stable."""
    tok = RustTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 4, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path)


def random_chunks(ids: list[int], rng: random.Random, max_len: int = 4) -> list[list[int]]:
    """`ids` cut into consecutive pieces of 1..max_len tokens."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_len)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]], finish: bool = True) -> list[str]:
    """Deltas of pushing each chunk (plus finish())."""
    deltas = [detok.push(c) for c in chunks]
    if finish:
        deltas.append(detok.finish())
    return deltas


def make_detok(tok: Tokenizer, prompt: str = PROMPT, **kw: object) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(prompt), **kw)


# ----------------------------------------------------------------------------------- deltas == full decode


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(20))
def test_random_stream_equals_full_decode(kind: str, skip_special_tokens: bool, seed: int, hf_tok: HFTokenizer) -> None:
    tok: Tokenizer = ByteTokenizer(300) if kind == "byte" else hf_tok
    rng = random.Random(seed)
    prompt = tok.encode(PROMPT)
    # Random ids over the whole model vocab: specials, unknown ids, invalid and split UTF-8 included.
    out = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
    full = tok.decode(prompt + out, skip_special_tokens=skip_special_tokens)
    head = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert full.startswith(head)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens, stop=[])
    deltas = stream(detok, random_chunks(out, rng))
    assert "".join(deltas) == full[len(head):] == detok.text
    assert detok.stopped is None


@pytest.mark.parametrize("seed", range(10))
def test_real_text_stream_has_no_replacement_chars(seed: int, hf_tok: HFTokenizer) -> None:
    rng = random.Random(seed)
    text = rng.choice(CORPUS) + " 你好 🎉👍🏽"
    for tok in (ByteTokenizer(300), hf_tok):
        detok = make_detok(tok)
        deltas = stream(detok, random_chunks(tok.encode(text), rng), finish=False)
        assert "".join(deltas) == text == detok.text
        assert all("\ufffd" not in d for d in deltas)
        assert detok.finish() == ""


def test_not_prefix_stable_decode(metaspace_tok: HFTokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = metaspace_tok.encode(text)
    naive = "".join(metaspace_tok.decode([i]) for i in ids)
    assert naive != text  # per-token decode drops the spaces: the window is needed
    for prompt in ("", "hello world"):
        detok = make_detok(metaspace_tok, prompt)
        deltas = stream(detok, [[i] for i in ids])
        expected = text if not prompt else " " + text  # after a prompt the first word keeps its space
        assert "".join(deltas) == expected


def test_multibyte_char_split_across_byte_tokens() -> None:
    tok = ByteTokenizer(300)
    text = "é你好🎉👍🏽мир"
    detok = make_detok(tok)
    deltas = [detok.push([i]) for i in tok.encode(text)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == list(text)  # each char appears once, when its last byte arrives
    assert deltas[:3] == ["", "é", ""]


def test_multibyte_char_split_across_bpe_tokens(hf_tok: HFTokenizer) -> None:
    text = "你好世界 🎉🚀"
    ids = hf_tok.encode(text)
    pieces = [hf_tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some token ends inside a character
    detok = make_detok(hf_tok)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_finish_flushes_incomplete_char() -> None:
    tok = ByteTokenizer(300)
    detok = make_detok(tok)
    assert detok.push(tok.encode("x")) == "x"
    assert detok.push(tok.encode("你")[:2]) == ""
    assert detok.finish() == "\ufffd"
    assert detok.text == "x\ufffd"
    assert detok.push(tok.encode("y")) == ""


# ------------------------------------------------------------------------------------------------ stop strings


STOP_TEXT = "The answer is 42.\n\nSTOP here and no more 你好"


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_stop_string_across_tokens(kind: str, include: bool, seed: int, hf_tok: HFTokenizer) -> None:
    tok: Tokenizer = ByteTokenizer(300) if kind == "byte" else hf_tok
    rng = random.Random(seed)
    stop = "\n\nSTOP"
    detok = make_detok(tok, stop=["never", stop], include_stop_str_in_output=include)
    ids = tok.encode(STOP_TEXT)
    cut = STOP_TEXT.index(stop) + (len(stop) if include else 0)
    emitted = ""
    for chunk in random_chunks(ids, rng):
        emitted += detok.push(chunk)
        assert STOP_TEXT[:cut].startswith(emitted)  # nothing emitted is ever cut later
        if detok.stopped is None:  # no part of the stop string was shown before the match
            assert "\n" not in emitted[len("The answer is 42."):]
    assert detok.stopped == stop
    assert emitted == STOP_TEXT[:cut] == detok.text
    assert detok.push(tok.encode("more")) == "" and detok.finish() == ""


def test_stop_string_is_tokenization_independent() -> None:
    tok = ByteTokenizer(300)
    text = "xxabcdyy"
    results = set()
    for seed in range(30):
        detok = make_detok(tok, stop=["abcd", "bc", "cdyy"])
        out = "".join(stream(detok, random_chunks(tok.encode(text), random.Random(seed), 8)))
        results.add((out, detok.stopped))
    assert results == {("xxa", "bc")}  # "bc" is complete first


def test_stop_prefix_held_then_released() -> None:
    tok = ByteTokenizer(300)
    detok = make_detok(tok, stop=["STOP"])
    assert detok.push(tok.encode("go ST")) == "go "
    assert detok.push(tok.encode("O")) == ""
    assert detok.push(tok.encode("MP")) == "STOMP"
    assert detok.push(tok.encode(" S")) == " "
    assert detok.finish() == "S"  # end of the request: held text is flushed
    assert detok.text == "go STOMP S" and detok.stopped is None


def test_include_stop_str_in_output() -> None:
    tok = ByteTokenizer(300)
    detok = make_detok(tok, stop=["</answer>"], include_stop_str_in_output=True)
    assert detok.push(tok.encode("<answer>42</ans")) == "<answer>42"
    assert detok.push(tok.encode("wer> trailing")) == "</answer>"
    assert detok.stopped == "</answer>" and detok.text == "<answer>42</answer>"


def test_stop_string_in_prompt_is_ignored() -> None:
    tok = ByteTokenizer(300)
    detok = make_detok(tok, prompt="say STOP", stop=["STOP"])
    assert detok.push(tok.encode("ok")) == "ok"
    assert detok.stopped is None


def test_stop_at_first_token_and_special_tokens(hf_tok: HFTokenizer) -> None:
    detok = make_detok(hf_tok, stop=["hello"], skip_special_tokens=False)
    assert detok.push(hf_tok.encode("<|im_end|>hello world")) == "<|im_end|>"
    assert detok.stopped == "hello"
    detok = make_detok(hf_tok, stop=["hello"])
    assert detok.push(hf_tok.encode("hello")) == ""
    assert detok.stopped == "hello" and detok.text == ""
