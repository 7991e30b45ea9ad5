"""`agentx-like`: long root histories, subagent bursts with joins, sidecars, compaction, inter-turn delays.

Parameters are workloads.md's table (token counts before --scale, delays in seconds). Per session:
- root turn 1 = the global prefix (16,384, shared by every session) + a session prefix; every later root turn
  appends a tool result; ctx(k+1) = ctx(k) + out(k) + tool(k).
- when the next context would exceed 0.8 x C_max, a compaction request (input = full context, output = a summary)
  is inserted and the next root turn restarts from global prefix + summary + the last 8,192 tokens under new block
  ids (`reset`: a cache miss after the prefix).
- each root turn spawns subagents with probability 0.04 (fan-out 1-5; 80% blocking: the next root turn waits for
  them) at the end of its response, and a one-shot sidecar with probability 0.10 when it is sent (non-blocking).
- subagents start from a shared 8,192-token subagent prefix + a task prompt; siblings are staggered U[0, 2 s].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tokenspeed.bench.workloads.dists import LogNormal, Mixture, scaled, session_rng
from tokenspeed.bench.workloads.trace import (
    BLOCK_SIZE,
    BlockAllocator,
    Conversation,
    Session,
    Spawn,
    Trace,
    Turn,
    make_turn,
)


@dataclass(frozen=True)
class AgentXParams:
    """workloads.md's agentx-like table: tokens (before --scale), seconds, probabilities."""

    num_sessions: int = 256
    seed: int = 0
    global_prefix: int = 16_384  # tools 12,800 + system 3,584
    session_prefix: LogNormal = LogNormal(4_000, 10_000, 512, 50_000)
    root_turns: LogNormal = LogNormal(100, 145, 20, 600)
    tool_append: LogNormal = LogNormal(600, 1_500, 16, 30_000)
    tool_call_frac: float = 0.70
    tool_call_out: LogNormal = LogNormal(150, 250, 8, 2_000)
    text_out: LogNormal = LogNormal(600, 1_000, 16, 8_000)
    c_max: int = 200_000
    compact_at: float = 0.8  # compaction when ctx > compact_at x c_max
    summary_out: LogNormal = LogNormal(2_000, 2_500, 500, 4_000)
    compact_keep: int = 8_192  # last tokens kept after compaction
    human_frac: float = 0.15
    tool_delay_s: LogNormal = LogNormal(1.0, 3.0)
    human_delay_s: LogNormal = LogNormal(15.0, 30.0)
    delay_cap_s: float = 10.0  # AgentX idle-gap lock
    spawn_prob: float = 0.04
    fanout_probs: tuple[float, ...] = (0.50, 0.20, 0.15, 0.10, 0.05)  # P(k = 1..5)
    blocking_frac: float = 0.80
    sub_prefix: int = 8_192
    sub_task: LogNormal = LogNormal(2_000, 3_000, 16, 50_000)
    sub_turns: LogNormal = LogNormal(8, 12, 1, 60)
    sub_append: LogNormal = LogNormal(1_500, 3_000, 16, 20_000)
    sub_out: LogNormal = LogNormal(150, 250, 8, 2_000)
    sub_last_out: LogNormal = LogNormal(800, 1_200, 64, 4_000)
    sub_delay_s: LogNormal = LogNormal(0.5, 1.0)
    sibling_offset_s: float = 2.0
    sidecar_prob: float = 0.10
    sidecar_in: LogNormal = LogNormal(4_000, 5_000, 512, 16_000)
    sidecar_out: LogNormal = LogNormal(100, 150, 8, 500)

    @property
    def root_delay_s(self) -> Mixture:
        return Mixture((1.0 - self.human_frac, self.human_frac), (self.tool_delay_s, self.human_delay_s))

    @property
    def root_out(self) -> Mixture:
        return Mixture((self.tool_call_frac, 1.0 - self.tool_call_frac), (self.tool_call_out, self.text_out))


class _Builder:
    """Builds one session tree; token counts are scaled here."""

    def __init__(self, p: AgentXParams, scale: float, alloc: BlockAllocator, g: range, sub: range) -> None:
        self.p, self.scale, self.alloc = p, scale, alloc
        self.g, self.g_tokens = g, scaled(p.global_prefix, scale)
        self.sub, self.sub_tokens = sub, scaled(p.sub_prefix, scale)
        self.convs: list[Conversation | None] = []

    def _ms(self, seconds: np.ndarray) -> np.ndarray:
        return np.minimum(seconds, self.p.delay_cap_s) * 1000.0

    def subagent(self, rng: np.random.Generator) -> Conversation:
        p, s = self.p, self.scale
        n = int(np.rint(p.sub_turns.sample(rng)))
        outs = scaled(p.sub_out.sample(rng, n), s)
        outs[-1] = scaled(p.sub_last_out.sample(rng), s)
        appends = scaled(p.sub_append.sample(rng, n), s)
        delays = self._ms(p.sub_delay_s.sample(rng, n))
        task = scaled(p.sub_task.sample(rng), s)
        turns = [make_turn(self.alloc, task, int(outs[0]), shared=self.sub, shared_tokens=self.sub_tokens,
                           kind="subagent")]
        turns += [make_turn(self.alloc, int(appends[k]), int(outs[k]), delay_ms=float(delays[k]), kind="subagent")
                  for k in range(1, n)]
        return Conversation(tuple(turns), "subagent")

    def sidecar(self, rng: np.random.Generator) -> Conversation:
        p, s = self.p, self.scale
        t = make_turn(self.alloc, scaled(p.sidecar_in.sample(rng), s), scaled(p.sidecar_out.sample(rng), s),
                      kind="sidecar")
        return Conversation((t,), "sidecar")

    def _child(self, conv: Conversation) -> int:
        self.convs.append(conv)
        return len(self.convs) - 1

    def spawns(self, rng: np.random.Generator, spawn: bool, sidecar: bool) -> tuple[Spawn, ...]:
        if not (spawn or sidecar):
            return ()
        p, out = self.p, []
        if sidecar:
            out.append(Spawn(self._child(self.sidecar(rng)), at_end=False, blocking=False))
        if spawn:
            k = int(rng.choice(len(p.fanout_probs), p=p.fanout_probs)) + 1
            blocking = bool(rng.random() < p.blocking_frac)
            offsets = rng.uniform(0.0, p.sibling_offset_s, k) * 1000.0
            out += [Spawn(self._child(self.subagent(rng)), at_end=True, blocking=blocking, offset_ms=float(o))
                    for o in offsets]
        return tuple(out)

    def session(self, i: int) -> Session:
        p, s = self.p, self.scale
        rng = session_rng(p.seed, i)
        n = int(np.rint(p.root_turns.sample(rng)))
        outs = scaled(p.root_out.sample(rng, n), s)
        tools = scaled(p.tool_append.sample(rng, n), s)
        delays = self._ms(p.root_delay_s.sample(rng, n))
        spawn = rng.random(n) < p.spawn_prob
        side = rng.random(n) < p.sidecar_prob
        prefix = scaled(p.session_prefix.sample(rng), s)
        c_limit, keep = p.compact_at * scaled(p.c_max, s), scaled(p.compact_keep, s)
        self.convs = [None]  # the root is filled in last
        turns: list[Turn] = [make_turn(self.alloc, prefix, int(outs[0]), shared=self.g, shared_tokens=self.g_tokens,
                                       spawns=self.spawns(rng, spawn[0], side[0]))]
        ctx = self.g_tokens + prefix
        for k in range(1, n):
            hist, tool = ctx + int(outs[k - 1]), int(tools[k])
            sp = self.spawns(rng, spawn[k], side[k])
            if hist + tool > c_limit:
                summary = scaled(p.summary_out.sample(rng), s)
                turns.append(make_turn(self.alloc, tool, summary, delay_ms=float(delays[k]), kind="compaction"))
                turns.append(make_turn(self.alloc, summary + keep, int(outs[k]), shared=self.g,
                                       shared_tokens=self.g_tokens, reset=True, spawns=sp))
                ctx = self.g_tokens + summary + keep
            else:
                turns.append(make_turn(self.alloc, tool, int(outs[k]), delay_ms=float(delays[k]), spawns=sp))
                ctx = hist + tool
        self.convs[0] = Conversation(tuple(turns), "root")
        return Session(i, tuple(self.convs))


def generate(p: AgentXParams = AgentXParams(), scale: float = 1.0) -> Trace:
    """The session pool; session i depends only on (seed, i) (its block ids on the sessions before it)."""
    alloc = BlockAllocator()
    g = alloc.take(scaled(p.global_prefix, scale))
    sub = alloc.take(scaled(p.sub_prefix, scale))
    b = _Builder(p, scale, alloc, g, sub)
    sessions = tuple(b.session(i) for i in range(p.num_sessions))
    params = {k: (asdict(v) if isinstance(v, LogNormal) else v) for k, v in vars(p).items()}
    return Trace("agentx-like", sessions, scale=scale, seed=p.seed, block_size=BLOCK_SIZE, params=params)
