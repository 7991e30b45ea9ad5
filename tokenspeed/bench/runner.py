"""One benchmark run at a fixed concurrency: warmup, a scored window of closed-loop session lanes, drain.

Closed loop: `concurrency` lanes each own one live session tree and start the next session when it ends.
- count-bounded (`duration_s` None): the lanes share the measured sessions; every request of them is scored; the
  run ends when the last session ends (drain = wait for it).
- time-bounded: lanes cycle through the pool (a recycled session restarts at turn 0 with a fresh salt); requests sent
  in [start, start + duration) are scored; then nothing new starts and in-flight requests finish within `grace_s`
  (and are counted); what is still running after the grace is cancelled and recorded as an error.
Warmup (never scored): `sessions` runs whole warmup sessions (own salts) at `warmup_concurrency`; `mid-session` sends,
per lane, the turn before a uniform point t* of its first session (with its full prefix) plus `warmup_requests`
1-token requests, then all lanes start together at turn t* after a `quiesce_s` pause.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenspeed.bench import prom
from tokenspeed.bench.record import RequestRecord
from tokenspeed.bench.session import ClientConfig, Executor, Tree
from tokenspeed.bench.workloads.synth import session_salt
from tokenspeed.bench.workloads.trace import Session


@dataclass(frozen=True)
class RunSpec:
    """What one run does (times in seconds)."""

    concurrency: int
    sessions: tuple[Session, ...]  # the measured sessions (count-bounded) or the pool (time-bounded)
    duration_s: float | None = None  # None: count-bounded
    grace_s: float = 600.0
    warmup: str = "none"  # none | sessions | mid-session
    warmup_sessions: tuple[Session, ...] = ()
    warmup_concurrency: int = 2
    warmup_requests: int = 10
    quiesce_s: float = 0.0
    nonce: int = 0  # run salt: private tokens differ between runs, so every run starts with a cold cache
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True)
class RunResult:
    """Records of every request (warmup included, by phase) and run-level observations."""

    concurrency: int
    records: tuple[RequestRecord, ...]
    window_start_s: float  # scored window start (s from the run's start)
    window_end_s: float | None  # time-bounded: when sending stopped
    peak_inflight: int  # most requests in flight at once during the scored window
    server_hit_metrics: float | None  # prefix-cache hit from /metrics counters over the scored window
    started_unix: float
    # mean engine-side ms per request of each phase (queue, prefill, decode) over the scored window, from /metrics
    server_phase_ms: dict[str, float] = field(default_factory=dict)

    def scored(self) -> list[RequestRecord]:
        return [r for r in self.records if r.phase == "scored"]


async def _progress(ex: Executor, spec: RunSpec, total: int | None, t_start: float) -> None:
    from tqdm import tqdm

    timed = spec.duration_s is not None
    bar = tqdm(total=spec.duration_s if timed else total, unit="s" if timed else "req", mininterval=0.5,
               desc=f"concurrency {spec.concurrency}", leave=False)
    try:
        while True:
            done = ex.scored_done
            bar.n = min(time.perf_counter() - t_start, spec.duration_s) if timed else done
            bar.set_postfix(done=done, inflight=ex.inflight, refresh=False)
            bar.refresh()
            await asyncio.sleep(0.5)
    finally:
        bar.close()


async def _warm_mid_session(ex: Executor, tree: Tree, rng: np.random.Generator, extra: int) -> tuple[int, Any]:
    """Send the root turn before t* (full prefix) and `extra` 1-token requests; returns (t*, history for t*)."""
    turns = tree.session.root.turns
    j = min(max(1, int(rng.random() * len(turns))), len(turns) - 1)
    if j == 0:
        return 0, None
    c = ex.preload(tree, 0, j - 1)
    t = turns[j - 1]
    ex.append_turn(c, tree, t)
    await ex.request(c, tree, 0, j - 1, t.kind, t.output_len)
    for _ in range(extra):
        await ex.request(c, tree, 0, j - 1, t.kind, 1)
    ex.append_recorded(c, tree, 0, j - 1, t.output_len)
    return j, c


async def _warmup(ex: Executor, spec: RunSpec) -> list[tuple[int, Any]]:
    """Run the warmup; for mid-session, the (start turn, history) of each lane's first session."""
    if spec.warmup == "sessions" and spec.warmup_sessions:
        queue = deque(spec.warmup_sessions)

        async def lane(i: int) -> None:
            while queue:
                s = queue.popleft()
                await ex.run_tree(Tree(s, session_salt(spec.nonce, s.session_id, -1), -1, i))

        await asyncio.gather(*(lane(i) for i in range(spec.warmup_concurrency)))
    if spec.warmup != "mid-session":
        return []
    pool = spec.sessions
    trees = [Tree(pool[i % len(pool)], session_salt(spec.nonce, pool[i % len(pool)].session_id, i // len(pool)),
                  i // len(pool), i) for i in range(spec.concurrency)]
    rngs = [np.random.default_rng([spec.seed, spec.nonce, i]) for i in range(spec.concurrency)]
    return await asyncio.gather(*(_warm_mid_session(ex, t, r, spec.warmup_requests) for t, r in zip(trees, rngs)))


async def run(client, cfg: ClientConfig, spec: RunSpec) -> RunResult:
    """Warmup, scored window, drain; returns every record."""
    if not spec.sessions:
        raise ValueError("no sessions to run")
    started, t0 = time.time(), time.perf_counter()
    ex = Executor(client, cfg, t0)
    starts = await _warmup(ex, spec)
    if spec.quiesce_s > 0:
        await asyncio.sleep(spec.quiesce_s)
    before = await prom.scrape(client, cfg.base_url)
    ex.phase = "scored"
    w0 = time.perf_counter()
    pool, counter = spec.sessions, itertools.count(spec.concurrency)
    queue, runs_of = deque(spec.sessions), {}
    timed = spec.duration_s is not None

    async def lane(i: int) -> None:
        if timed:
            k = i
            start, c = starts[i] if starts else (0, None)
            while not ex.stop.is_set():
                s = pool[k % len(pool)]
                await ex.run_tree(Tree(s, session_salt(spec.nonce, s.session_id, k // len(pool)), k // len(pool), i),
                                  start, c)
                k, start, c = next(counter), 0, None
        else:
            while queue:
                s = queue.popleft()
                epoch = runs_of[s.session_id] = runs_of.get(s.session_id, -1) + 1  # a repeated session: new salt
                await ex.run_tree(Tree(s, session_salt(spec.nonce, s.session_id, epoch), epoch, i))

    total = None if timed else sum(s.num_requests() for s in spec.sessions)
    ticker = asyncio.create_task(_progress(ex, spec, total, w0)) if spec.progress else None
    lanes = [ex.spawn(lane(i)) for i in range(spec.concurrency)]
    window_end = None
    try:
        if timed:
            done, _ = await asyncio.wait(lanes, timeout=spec.duration_s, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise a lane's error
            ex.stop.set()
            window_end = time.perf_counter() - t0
            await asyncio.wait(lanes, timeout=spec.grace_s)
            for task in list(ex.tasks):
                task.cancel()
            await asyncio.gather(*list(ex.tasks), return_exceptions=True)
            for task in lanes:
                if task.done() and not task.cancelled() and task.exception():
                    raise task.exception()
        else:
            await asyncio.gather(*lanes)
    finally:
        if ticker:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        for task in list(ex.tasks):
            task.cancel()
    after = await prom.scrape(client, cfg.base_url)
    hit = prom.hit_between(before and before.cache, after and after.cache)
    return RunResult(spec.concurrency, tuple(ex.records), w0 - t0, window_end, ex.peak_inflight, hit, started,
                     prom.phase_ms_between(before, after))


def split_sessions(pool: Sequence[Session], n: int, warmup_offset: int | None,
                   warmup_n: int) -> tuple[tuple[Session, ...], tuple[Session, ...]]:
    """The first `n` sessions of the pool (cycling if the pool is smaller) and `warmup_n` from `warmup_offset`."""
    measured = tuple(pool[i % len(pool)] for i in range(n))
    off = warmup_offset if warmup_offset is not None else n
    warm = tuple(pool[(off + i) % len(pool)] for i in range(warmup_n))
    return measured, warm
