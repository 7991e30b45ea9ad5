"""Tokenize the corpus into the training arrays (uint16 token streams) and build the chat mix.

Streams (build/default_model/data/):
- train.npy: the training documents, each followed by [EOS], in a fixed shuffled order. Documents are the
  training-split files plus synthetic chat conversations in the K3 format (section "chat mix" below).
- heldout.npy: the held-out files, in path order, each followed by [EOS] (plain code only: this is what the
  held-out loss is measured on).
- meta.json: counts, the special ids, and the corpus fingerprints.

Chat mix: for functions of the training split that have a docstring, a conversation is rendered segment-wise
(k3-chat-format.md section 2) either as "write this function" -> a fenced code block, or "what does it do" ->
the docstring's first paragraph; half of them with the think channel (a short templated reasoning), half
without. It teaches the model the chat layout, so `tokenspeed serve` answers in the format its parsers expect.

    python scripts/default_model/tokenize_corpus.py [--chat-fraction 0.12]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_format import EOS, encode_segments, render_segments, special_id
from corpus import BUILD, manifest, split_files
from train_tokenizer import ASSETS

DATA = BUILD / "data"

WRITE_PROMPTS = (
    "Write a Python function `{sig}`.\n{doc}",
    "Implement `{sig}` in Python: {doc}",
    "Can you write `{sig}`? {doc}",
)
EXPLAIN_PROMPTS = (
    "What does `{name}` in the `{module}` module do?",
    "Explain the Python function `{module}.{name}`.",
)
REASONING = (
    "The user wants `{name}`. I will write it in Python.",
    "I need to write the function `{name}` and show the code.",
)
EXPLAIN_REASONING = "The user asks about `{name}` from `{module}`. I will summarise its docstring."


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"{node.name}({args})"


def chat_samples(files: list[tuple[str, str]], seed: int = 0) -> list[list[dict]]:
    """Conversations (message lists) built from the documented functions of `files`."""
    rng = random.Random(seed)
    convs = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = _first_paragraph(doc)
            source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno])).strip("\n")
            if not (20 <= len(para) <= 400) or not source or len(source) > 1600:
                continue
            name = node.name
            if rng.random() < 0.7:
                user = rng.choice(WRITE_PROMPTS).format(sig=_signature(node), doc=para)
                answer = f"```python\n{source}\n```"
                reasoning = rng.choice(REASONING).format(name=name)
            else:
                user = rng.choice(EXPLAIN_PROMPTS).format(name=name, module=module)
                answer = para
                reasoning = EXPLAIN_REASONING.format(name=name, module=module)
            convs.append([{"role": "user", "content": user},
                          {"role": "assistant", "content": answer, "reasoning_content": reasoning}])
    return convs


def encode_documents(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=ASSETS / "tokenizer.json")
    ap.add_argument("--out", type=Path, default=DATA)
    ap.add_argument("--chat-fraction", type=float, default=0.12, help="cap of chat tokens / all training tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    t0 = time.time()
    tok = Tokenizer.from_file(str(args.tokenizer))
    eos = special_id(EOS)
    splits = split_files()
    code_docs = encode_documents(tok, [t for _, t in splits["train"]])
    heldout_docs = encode_documents(tok, [t for _, t in splits["heldout"]])
    code_tokens = sum(len(d) + 1 for d in code_docs)

    rng = random.Random(args.seed)
    convs = chat_samples(splits["train"], args.seed)
    rng.shuffle(convs)
    encode_text = lambda s: tok.encode(s, add_special_tokens=False).ids
    chat_docs, chat_tokens = [], 0
    budget = args.chat_fraction / (1 - args.chat_fraction) * code_tokens
    for i, conv in enumerate(convs):
        ids = encode_segments(render_segments(conv, add_generation_prompt=False, thinking=i % 2 == 0), encode_text)
        if chat_tokens + len(ids) + 1 > budget:
            break
        chat_docs.append(ids)
        chat_tokens += len(ids) + 1

    docs = code_docs + chat_docs
    rng.shuffle(docs)
    train = np.fromiter((t for d in docs for t in (*d, eos)), dtype=np.uint16)
    heldout = np.fromiter((t for d in heldout_docs for t in (*d, eos)), dtype=np.uint16)
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "train.npy", train)
    np.save(args.out / "heldout.npy", heldout)
    info = manifest(splits)
    meta = {
        "train_tokens": int(train.size), "heldout_tokens": int(heldout.size), "code_tokens": code_tokens,
        "chat_conversations": len(chat_docs), "chat_tokens": chat_tokens, "eos_id": eos,
        "heldout_bytes": info["heldout"]["bytes"], "heldout_files": len(heldout_docs),
        "corpus": {k: v for k, v in info.items() if k != "heldout_files"},
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps({k: v for k, v in meta.items() if k != "corpus"}, indent=1))
    print(f"done in {time.time() - t0:.1f}s -> {args.out}")


if __name__ == "__main__":
    main()
