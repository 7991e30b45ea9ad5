"""The ideal (infinite, block-level) prefix-cache hit of a trace, and the trie that computes it.

A prompt is a list of *pieces*: a run of consecutive block ids under one salt (with its token count), or a whole
output. Every sequence the server has seen is kept (infinite cache); a new prompt hits its longest common prefix with
any of them, in tokens, rounded down to whole blocks (pages) of `block_size` tokens. The same trie runs inside the
client during a benchmark (the ideal of exactly the requests that were sent) and over a trace here.

History semantics: `replay` (the recorded output is appended; the server cached only the prompts, since its own
output differs) or `live` (the server's output is appended; the server also cached prompt + output).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenspeed.bench.workloads.trace import Trace, Turn

Piece = tuple[tuple, int]  # (content key, tokens); block runs: (("b", salt, start, stop), tokens)


def turn_pieces(turn: Turn, salt: int, block_size: int) -> list[Piece]:
    """Pieces of a turn's new tokens: its runs, split where the shared (salt 0) blocks end."""
    out: list[Piece] = []
    left, seen = turn.input_len, 0
    for r in turn.blocks:
        parts = [r]
        k = turn.shared_blocks - seen
        if 0 < k < len(r):
            parts = [r[:k], r[k:]]
        for p in parts:
            s = 0 if seen < turn.shared_blocks else salt
            tokens = min(left, len(p) * block_size)
            out.append((("b", s, p.start, p.stop), tokens))
            left -= tokens
            seen += len(p)
    return out


def output_piece(key: tuple, n: int) -> Piece:
    return (("o", *key), n)


class _Node:
    __slots__ = ("children", "by_start")

    def __init__(self) -> None:
        self.children: dict[Piece, _Node] = {}
        self.by_start: dict[tuple, list[int]] = {}  # (salt, first id) -> token counts of block pieces stored here


class PrefixTrie:
    """Every sequence seen, as a trie of pieces; `match` is the longest common prefix in tokens."""

    def __init__(self) -> None:
        self.root = _Node()

    def match(self, pieces: Sequence[Piece], node: _Node | None = None) -> int:
        """Common prefix (tokens) of `pieces` with the stored sequences, starting at `node` (default: the root)."""
        node, common = node or self.root, 0
        for piece in pieces:
            child = node.children.get(piece)
            if child is not None:
                common += piece[1]
                node = child
                continue
            key, tokens = piece
            if key[0] == "b":  # same first block, other length: a partial match of the shorter one
                stored = node.by_start.get((key[1], key[2]), ())
                common += max((min(tokens, t) for t in stored), default=0)
            break
        return common

    def insert(self, pieces: Sequence[Piece], node: _Node | None = None) -> _Node:
        """Store a sequence (continuing from `node`); returns the node where it ends."""
        node = node or self.root
        for piece in pieces:
            child = node.children.get(piece)
            if child is None:
                child = node.children[piece] = _Node()
                key = piece[0]
                if key[0] == "b":
                    node.by_start.setdefault((key[1], key[2]), []).append(piece[1])
            node = child
        return node


class Cursor:
    """One conversation's view of the trie: it remembers where its last stored sequence ends, so each turn only
    walks its new pieces (the stored sequence is always a prefix of the conversation's next prompt, until a reset)."""

    def __init__(self, trie: PrefixTrie) -> None:
        self.trie = trie
        self.node: _Node | None = None
        self.pieces = 0  # pieces of the history stored up to self.node
        self.tokens = 0

    def reset(self) -> None:
        self.node, self.pieces, self.tokens = None, 0, 0

    def match(self, prompt: Sequence[Piece]) -> int:
        return self.tokens + self.trie.match(prompt[self.pieces:], self.node)

    def store(self, seq: Sequence[Piece]) -> None:
        self.node = self.trie.insert(seq[self.pieces:], self.node)
        self.pieces, self.tokens = len(seq), self.tokens + sum(p[1] for p in seq[self.pieces:])


def cached_blocks(common: int, prompt_len: int, block_size: int) -> int:
    """Tokens a block-level cache serves: the common prefix rounded down to whole blocks (tokens)."""
    return (min(common, prompt_len) // block_size) * block_size


@dataclass
class HitCount:
    """Prompt tokens and ideal cached tokens, overall and by request kind."""

    prompt: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cached: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, prompt: int, cached: int) -> None:
        self.prompt[kind] += prompt
        self.cached[kind] += cached

    def ratio(self, kind: str | None = None) -> float:
        p = sum(self.prompt.values()) if kind is None else self.prompt.get(kind, 0)
        c = sum(self.cached.values()) if kind is None else self.cached.get(kind, 0)
        return c / p if p else 0.0

    def as_dict(self) -> dict:
        return {"overall": self.ratio(), **{k: self.ratio(k) for k in sorted(self.prompt)}}


def ideal_hit(trace: Trace, history: str = "replay", block_size: int | None = None) -> HitCount:
    """The ideal hit of a whole trace: sessions one after another (salt = 1 + session id), each tree root first."""
    if history not in ("replay", "live"):
        raise ValueError(f"history must be replay or live, not {history!r}")
    bs = block_size or trace.block_size
    trie, count = PrefixTrie(), HitCount()
    for s in trace.sessions:
        salt = s.session_id + 1
        for ci, conv in enumerate(s.convs):
            hist: list[Piece] = []
            cur, plen = Cursor(trie), 0
            for ti, t in enumerate(conv.turns):
                new = turn_pieces(t, salt, trace.block_size)
                if t.reset:
                    hist, plen = [], 0
                    cur.reset()
                hist.extend(new)
                plen += t.input_len
                count.add(t.kind, plen, cached_blocks(cur.match(hist), plen, bs))
                out = output_piece((salt, s.session_id, ci, ti), t.output_len)
                if history == "live":
                    hist.append(out)
                    cur.store(hist)
                else:
                    cur.store(hist)
                    hist.append(out)
                plen += t.output_len
    return count
