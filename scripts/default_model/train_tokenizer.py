"""Train the default model's tokenizer: byte-level BPE, 7936 ranks + 256 K3-style special ids = vocab 8192.

Pre-tokenization is the cl100k/K3 family regex (letters with one leading non-letter, digits in groups of up to
three, punctuation runs, newline runs, whitespace runs that leave the last space to the next word) followed by
the byte-level mapping; decoding is byte-level. No BOS is added by encode. Trained on the training split only.

    python scripts/default_model/train_tokenizer.py [--out tokenspeed/assets/kimi-k3-mini]

Writes tokenizer.json, tokenizer_config.json, generation_config.json (eos = <|end_of_msg|>), chat_template.jinja.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_format import (
    BOS,
    CHAT_TEMPLATE,
    END_OF_MSG,
    EOS,
    SPECIAL_BASE,
    VOCAB_SIZE,
    special_id,
    special_tokens,
)
from corpus import REPO, split_files

ASSETS = REPO / "tokenspeed" / "assets" / "kimi-k3-mini"
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
MODEL_MAX_LENGTH = 4096


def build_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """Train the BPE on `texts` (an iterable of strings); returns a tokenizers.Tokenizer with the specials."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    num_ranks = vocab_size - len(special_tokens())
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != num_ranks:
        raise RuntimeError(f"BPE trained to {tok.get_vocab_size()} ranks, expected {num_ranks} (corpus too small?)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens()])
    assert tok.token_to_id(BOS) == SPECIAL_BASE and tok.get_vocab_size() == vocab_size
    return tok


def tokenizer_config() -> dict:
    added = {str(SPECIAL_BASE + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True}
             for i, t in enumerate(special_tokens())}
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def generation_config() -> dict:
    return {"bos_token_id": special_id(BOS), "eos_token_id": special_id(END_OF_MSG),
            "pad_token_id": special_id("[PAD]")}


def write_tokenizer_files(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSETS)
    args = ap.parse_args()
    t0 = time.time()
    train = [text for _, text in split_files()["train"]]
    tok = build_tokenizer(train)
    write_tokenizer_files(tok, args.out)
    sample = train[0][:2000]
    n = len(tok.encode(sample).ids)
    print(f"trained {tok.get_vocab_size()} tokens in {time.time() - t0:.1f}s; {len(sample.encode()) / n:.2f} "
          f"bytes/token on a sample; wrote {args.out}")


if __name__ == "__main__":
    main()
