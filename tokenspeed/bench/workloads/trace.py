"""The trace data model: sessions of conversations of turns, with block-structured synthetic prompts.

Every token count here is in tokens, every delay in milliseconds.

A turn's *new* input tokens are `input_len` tokens in `ceil(input_len / block_size)` blocks; the block ids
(Mooncake `hash_ids`) are stored as runs of consecutive ids (`range`s) so a trace of 1,000 agentic sessions stays
small. Two requests that share a block id share that block's tokens; only the last block of a turn may be partial.
The first `shared_blocks` ids of a turn are *global* (the same tokens in every session and every run: a system
prompt, a tool list); the others are *private*, their tokens also depend on the session's salt, so a recycled session
(new salt) never hits the cache of its previous run.

A session is a tree: conversation 0 is the root; subagents and sidecars are further conversations that a turn of
another conversation spawns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

BLOCK_SIZE = 64  # tokens per block (B in workloads.md): 128/256/512 boundaries align
KINDS = ("root", "subagent", "sidecar", "compaction")


class Spawn(NamedTuple):
    """A child conversation started by a turn (an immutable record; a NamedTuple because traces hold 10^5 of them)."""

    conv: int  # index of the child in Session.convs
    at_end: bool  # True: starts when the spawning turn's response ends (a tool call); False: when it is sent
    blocking: bool  # the parent's next turn waits for this child to finish (join)
    offset_ms: float = 0.0  # extra delay after the spawn point (siblings are staggered)


class Turn(NamedTuple):
    """One request: append `input_len` new tokens to the history, ask for exactly `output_len` tokens.

    An immutable record (a NamedTuple rather than a frozen dataclass: a 1,000-session agentic trace holds ~3 x 10^5
    turns and a NamedTuple is built several times faster).
    """

    input_len: int  # new tokens (tokens)
    blocks: tuple[range, ...]  # block ids of the new tokens, runs of consecutive ids
    output_len: int  # max_tokens, exact with ignore_eos (tokens)
    delay_ms: float = 0.0  # previous request's end (or the conversation's start) -> this request is sent (ms)
    kind: str = "root"  # root | subagent | sidecar | compaction
    shared_blocks: int = 0  # leading block ids whose tokens are global (no salt)
    reset: bool = False  # the history is dropped: the prompt is this turn's new tokens only (after compaction)
    spawns: tuple[Spawn, ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(len(r) for r in self.blocks)

    def block_ids(self) -> list[int]:
        return [i for r in self.blocks for i in r]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One growing context: each turn's prompt is the previous prompt + its output + the new input."""

    turns: tuple[Turn, ...]
    kind: str = "root"


@dataclass(frozen=True, slots=True)
class Session:
    """A tree of conversations; convs[0] is the root, the others are spawned by turns."""

    session_id: int
    convs: tuple[Conversation, ...]

    @property
    def root(self) -> Conversation:
        return self.convs[0]

    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.convs)


@dataclass(frozen=True)
class Trace:
    """A deterministic workload: a pool of sessions plus how it was made."""

    name: str
    sessions: tuple[Session, ...]
    scale: float = 1.0
    seed: int = 0
    block_size: int = BLOCK_SIZE
    params: dict = field(default_factory=dict, compare=False)  # generator parameters (for the JSON summary)

    def __len__(self) -> int:
        return len(self.sessions)

    def requests(self) -> Iterator[tuple[Session, int, int, Turn]]:
        """(session, conv index, turn index, turn) in session order."""
        for s in self.sessions:
            for ci, c in enumerate(s.convs):
                for ti, t in enumerate(c.turns):
                    yield s, ci, ti, t


def runs(ids: Iterable[int]) -> tuple[range, ...]:
    """Compress block ids into runs of consecutive ids: [3, 4, 5, 9] -> (range(3, 6), range(9, 10))."""
    out: list[range] = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(range(start, prev + 1))
        start = prev = i
    if start is not None:
        out.append(range(start, prev + 1))
    return tuple(out)


def num_blocks(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    """Hands out fresh block ids in order (deterministic for a deterministic generator)."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, tokens: int, block_size: int = BLOCK_SIZE) -> range:
        n = num_blocks(tokens, block_size)
        r = range(self.next, self.next + n)
        self.next += n
        return r


def make_turn(alloc: BlockAllocator, new_tokens: int, output_len: int, *, shared: range = range(0),
              shared_tokens: int = 0, block_size: int = BLOCK_SIZE, **kw) -> Turn:
    """A turn whose new input is `shared_tokens` global tokens (`shared` ids) followed by `new_tokens` private ones.

    Only the global prefix's full blocks stay global; a partial last global block becomes private (it also holds
    the first private tokens), exactly as a block-level cache sees it.
    """
    if not shared_tokens:  # the common case: private tokens only
        start = alloc.next
        alloc.next += -(-new_tokens // block_size)
        return Turn(new_tokens, (range(start, alloc.next),) if new_tokens else (), output_len, **kw)
    full = min(shared_tokens // block_size, len(shared))
    total = shared_tokens + new_tokens
    private = alloc.take(total - full * block_size, block_size) if total > full * block_size else range(0)
    head = shared[:full]
    if head and private and head.stop == private.start:
        blocks: tuple[range, ...] = (range(head.start, private.stop),)
    else:
        blocks = tuple(r for r in (head, private) if r)
    return Turn(input_len=total, blocks=blocks, output_len=output_len, shared_blocks=full, **kw)


def prompt_lengths(conv: Conversation) -> list[int]:
    """The prompt length (tokens) of every turn of a conversation, with the recorded outputs in the history."""
    out, ctx = [], 0
    for t in conv.turns:
        ctx = t.input_len if t.reset else ctx + t.input_len
        out.append(ctx)
        ctx += t.output_len
    return out
