"""Single-turn workloads: `random` (independent prompts) and `shared-prefix` (groups sharing a system prompt).

Each prompt is one session of one turn. Token counts are before --scale.
- random: input and output lengths uniform in [len x (1 - range_ratio), len] (range_ratio 0: exact), every prompt
  private (no shared tokens).
- shared-prefix: `num_groups` system prompts of `system_len` tokens; each of the group's `prompts_per_group` prompts is
  the group's system prompt + a private question of `question_len` tokens; sessions are interleaved across groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tokenspeed.bench.workloads.dists import scaled, session_rng
from tokenspeed.bench.workloads.trace import BLOCK_SIZE, BlockAllocator, Conversation, Session, Trace, make_turn


@dataclass(frozen=True)
class RandomParams:
    num_sessions: int = 64
    seed: int = 0
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len x (1 - ratio), len]


@dataclass(frozen=True)
class SharedPrefixParams:
    num_sessions: int = 64  # total prompts (rounded up to whole groups is not done: groups are interleaved)
    seed: int = 0
    num_groups: int = 4
    system_len: int = 2048
    question_len: int = 128
    output_len: int = 128


def _uniform(rng: np.random.Generator, length: int, ratio: float) -> int:
    lo = max(1, int(round(length * (1.0 - ratio))))
    return int(rng.integers(lo, length + 1)) if lo < length else length


def generate_random(p: RandomParams = RandomParams(), scale: float = 1.0) -> Trace:
    alloc = BlockAllocator()
    sessions = []
    for i in range(p.num_sessions):
        rng = session_rng(p.seed, i)
        n_in = scaled(_uniform(rng, p.input_len, p.range_ratio), scale)
        n_out = scaled(_uniform(rng, p.output_len, p.range_ratio), scale)
        sessions.append(Session(i, (Conversation((make_turn(alloc, n_in, n_out),)),)))
    return Trace("random", tuple(sessions), scale=scale, seed=p.seed, block_size=BLOCK_SIZE, params=asdict(p))


def generate_shared_prefix(p: SharedPrefixParams = SharedPrefixParams(), scale: float = 1.0) -> Trace:
    alloc = BlockAllocator()
    system = scaled(p.system_len, scale)
    groups = [alloc.take(system) for _ in range(p.num_groups)]
    question, n_out = scaled(p.question_len, scale), scaled(p.output_len, scale)
    sessions = []
    for i in range(p.num_sessions):
        turn = make_turn(alloc, question, n_out, shared=groups[i % p.num_groups], shared_tokens=system)
        sessions.append(Session(i, (Conversation((turn,)),)))
    return Trace("shared-prefix", tuple(sessions), scale=scale, seed=p.seed, block_size=BLOCK_SIZE,
                 params=asdict(p))
