"""`swe-smith-like`: the shape of the Part I seed (50K start, +800 per turn, 10-15 turns, <= 500 out).

Session i gets T_i ~ UniformInt[10, 15] turns; turn 1 is exactly 50,000 x scale new tokens, every later turn
800 x scale; every output exactly 500 x scale (canonical). The `var` variant draws outputs from a lognormal
(median 250, sigma 0.8, clamped to [16, 500]) and think times from a lognormal (median 1 s, sigma 1, capped at 10 s).
With live history turn k's prompt is 50,000 + (k - 1) x 1,300 tokens (x scale), at most 68,200.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenspeed.bench.workloads.dists import LogNormal, scaled, session_rng
from tokenspeed.bench.workloads.trace import BLOCK_SIZE, BlockAllocator, Conversation, Session, Trace, make_turn

# (P, N_sessions) of the spec's sweep; other concurrencies measure 2 x P sessions.
SWEEP_SESSIONS = {1: 4, 2: 8, 4: 8, 8: 16, 16: 32, 32: 64, 64: 128}
WARMUP_OFFSET = 68  # warmup sessions are taken from the pool here (2 sessions at P = 2)


@dataclass(frozen=True)
class SweSmithParams:
    """Parameters in tokens (before --scale), seconds and counts."""

    num_sessions: int = 128
    seed: int = 42
    min_turns: int = 10
    max_turns: int = 15
    first_input: int = 50_000
    turn_input: int = 800
    output: int = 500
    shared_prefix: int = 0  # --swl-shared-prefix: leading tokens of turn 1 common to all sessions
    variant: str = "canonical"  # canonical | var
    var_output_median: float = 250.0
    var_output_sigma: float = 0.8
    var_output_min: int = 16
    var_think_median_s: float = 1.0
    var_think_sigma: float = 1.0
    think_cap_s: float = 10.0


def sessions_for(concurrency: int) -> int:
    """Measured sessions at a concurrency (the spec's sweep table)."""
    return SWEEP_SESSIONS.get(concurrency, 2 * concurrency)


def generate(p: SweSmithParams = SweSmithParams(), scale: float = 1.0) -> Trace:
    """The session pool; session i depends only on (seed, i)."""
    if p.variant not in ("canonical", "var"):
        raise ValueError(f"swe-smith-like variant must be canonical or var, not {p.variant!r}")
    alloc = BlockAllocator()
    first = scaled(p.first_input, scale)
    shared_tokens = min(scaled(p.shared_prefix, scale, lo=0), first)
    shared = alloc.take(shared_tokens) if shared_tokens else range(0)
    delta = scaled(p.turn_input, scale)
    out_max = scaled(p.output, scale)
    out_dist = LogNormal.from_sigma(p.var_output_median, p.var_output_sigma, p.var_output_min, p.output)
    think = LogNormal.from_sigma(p.var_think_median_s, p.var_think_sigma, None, p.think_cap_s)
    sessions = []
    for i in range(p.num_sessions):
        rng = session_rng(p.seed, i)
        n = int(rng.integers(p.min_turns, p.max_turns + 1))
        if p.variant == "var":
            outs = scaled(out_dist.sample(rng, n), scale)
            delays = think.sample(rng, n) * 1000.0
            delays[0] = 0.0
        else:
            outs = [out_max] * n
            delays = [0.0] * n
        turns = [make_turn(alloc, first - shared_tokens, int(outs[0]), shared=shared, shared_tokens=shared_tokens)]
        turns += [make_turn(alloc, delta, int(outs[k]), delay_ms=float(delays[k])) for k in range(1, n)]
        sessions.append(Session(i, (Conversation(tuple(turns)),)))
    params = {**asdict(p), "first_input_scaled": first, "turn_input_scaled": delta, "output_scaled": out_max}
    return Trace("swe-smith-like", tuple(sessions), scale=scale, seed=p.seed, block_size=BLOCK_SIZE, params=params)
