"""Token synthesis: token ids drawn deterministically from hash(seed, salt, block_id) in blocks of B tokens.

A block's tokens depend only on (seed, salt, block id) and the position inside the block, so a shared block id is a
shared prefix and a partial block is a prefix of the full one. Global blocks use salt 0; a session's private blocks use
its salt (`session_salt`), so the same trace replayed with a new salt shares nothing but the global prefix. Recorded
outputs (replay history) are drawn from hash(seed, salt, session, conversation, turn).

Ids are in [low, high): keep `high` at most the model's vocabulary and `low` above the special/byte tokens you want to
avoid (defaults in the CLI: [16, 512) fits the tiny presets).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from tokenspeed.bench.workloads.trace import Turn

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hash64(*parts: object) -> int:
    """A stable 64-bit hash of a tuple of ints/strings (blake2b; Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def session_salt(nonce: int, session_id: int, epoch: int = 0) -> int:
    """The salt of one run of a session (never 0, which is reserved for global blocks)."""
    return hash64("salt", nonce, session_id, epoch) | 1


@dataclass(frozen=True)
class TokenSynth:
    """Makes the token ids of turns and recorded outputs."""

    seed: int = 0
    block_size: int = 64
    low: int = 16
    high: int = 512

    def _stream(self, key: int, positions: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            x = np.uint64(key & _M64) ^ (positions.astype(np.uint64) * _GOLDEN)
            x = _mix(x)
        return (self.low + (x % np.uint64(self.high - self.low))).astype(np.int64)

    def blocks(self, salt: int, ids: np.ndarray) -> np.ndarray:
        """Tokens of full blocks `ids` (len(ids) x block_size)."""
        bs = self.block_size
        pos = (ids.astype(np.uint64)[:, None] * np.uint64(bs) + np.arange(bs, dtype=np.uint64)[None, :]).ravel()
        return self._stream(hash64("block", self.seed, salt), pos)

    def turn(self, turn: Turn, salt: int) -> np.ndarray:
        """The `turn.input_len` new tokens of a turn: its shared blocks unsalted, the rest with `salt`."""
        ids = np.fromiter((i for r in turn.blocks for i in r), dtype=np.int64, count=turn.num_blocks)
        k = turn.shared_blocks
        toks = np.concatenate([self.blocks(0, ids[:k]), self.blocks(salt, ids[k:])])
        return toks[: turn.input_len]

    def output(self, salt: int, session: int, conv: int, turn: int, n: int) -> np.ndarray:
        """The recorded output of a turn (replay history): n tokens."""
        return self._stream(hash64("out", self.seed, salt, session, conv, turn), np.arange(n))
