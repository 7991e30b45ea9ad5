"""The fixed held-out snippet set the engine must reproduce (small enough for CI), and the completion prompt.

From each of four held-out stdlib files, the text from its first top-level `def` on, in whole lines, up to
SNIPPET_TOKENS tokens. The texts are stored in the assets (eval.json), so the test does not depend on the
Python version of the machine that runs it.

    python scripts/default_model/snippets.py     # -> build/default_model/data/snippets.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import is_heldout, stdlib_root
from tokenize_corpus import DATA
from train_tokenizer import ASSETS

SNIPPET_FILES = ("asyncio/futures.py", "gettext.py", "ipaddress.py", "uuid.py")
SNIPPET_TOKENS = 192
# Greedy completion prompt: a held-out function's signature and docstring (ipaddress.ip_network).
COMPLETION_FILE, COMPLETION_FUNCTION = "ipaddress.py", "ip_network"


def make_snippets(tokenizer_path: Path = ASSETS / "tokenizer.json") -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out = []
    for rel in SNIPPET_FILES:
        assert is_heldout(rel), rel
        text = (stdlib_root() / rel).read_text(encoding="utf-8")
        start = re.search(r"^def ", text, flags=re.MULTILINE).start()
        lines = text[start:].splitlines(keepends=True)
        snippet = ""
        for line in lines:
            if len(tok.encode(snippet + line).ids) > SNIPPET_TOKENS:
                break
            snippet += line
        out.append({"source": rel, "text": snippet, "ids": tok.encode(snippet).ids})
    return out


def completion_prompt() -> str:
    """`def ip_network(...):` and its docstring, from the held-out ipaddress.py."""
    text = (stdlib_root() / COMPLETION_FILE).read_text(encoding="utf-8")
    m = re.search(rf'^def {COMPLETION_FUNCTION}\(.*?""".*?"""\n', text, flags=re.MULTILINE | re.DOTALL)
    return m.group(0)


def main() -> None:
    snippets = make_snippets()
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "snippets.json").write_text(json.dumps(snippets, indent=1))
    for s in snippets:
        print(f"{s['source']}: {len(s['ids'])} tokens, {len(s['text'])} chars")
    print(completion_prompt())


if __name__ == "__main__":
    main()
