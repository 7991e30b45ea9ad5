"""Runs session trees against a server: growing histories, delays, subagent spawns with joins, sidecars.

A conversation sends its turns in order: each waits `delay_ms` after the previous response ended (and for the
blocking subagents the previous turn spawned), appends its new tokens to the history, streams its response, then
appends the output: the recorded one (`replay`, the default) or the server's own token ids (`live`). Children start
when their spawning turn is sent (sidecars) or has ended (subagents), after their offset. Once `stop` is set no new
request starts; requests in flight finish (drain). Every request is checked against an infinite block-level cache
of everything sent so far (the ideal hit of exactly this run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

from tokenspeed.bench.client import Outcome, completion_payload, stream_completion
from tokenspeed.bench.record import RequestRecord
from tokenspeed.bench.workloads.prefix import Cursor, Piece, PrefixTrie, cached_blocks, output_piece, turn_pieces
from tokenspeed.bench.workloads.synth import TokenSynth
from tokenspeed.bench.workloads.trace import Session, Spawn, Turn


class LiveHistoryError(RuntimeError):
    """--history live needs the server to stream token ids (`return_token_ids`)."""


@dataclass(frozen=True)
class ClientConfig:
    """How requests are made (the same for every run of a sweep)."""

    base_url: str
    model: str
    synth: TokenSynth
    history: str = "replay"  # replay | live
    endpoint: str = "/v1/completions"
    request_timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    ideal_block_size: int = 64  # block (page) size of the ideal cache (tokens)


@dataclass
class _Conv:
    """A conversation's history: its token ids pre-encoded as JSON ("1,2,3"), so a 60K-token prompt is not
    re-serialised every turn (json.dumps of 60K ints costs ~10-50 ms; appending the new tokens costs ~0)."""

    cursor: Cursor
    enc: bytearray = field(default_factory=bytearray)
    n: int = 0  # tokens in the history
    pieces: list[Piece] = field(default_factory=list)

    def add(self, ids: list[int]) -> None:
        if ids:
            if self.n:
                self.enc += b","
            self.enc += ",".join(map(str, ids)).encode()
            self.n += len(ids)

    def clear(self) -> None:
        self.enc, self.n, self.pieces = bytearray(), 0, []
        self.cursor.reset()


@dataclass
class Tree:
    """One running session tree (a root conversation and the children it spawned)."""

    session: Session
    salt: int
    epoch: int
    lane: int
    tasks: list[asyncio.Task] = field(default_factory=list)


class Executor:
    """Sends requests and keeps the records, the in-flight count and the ideal cache of one run."""

    def __init__(self, client, cfg: ClientConfig, t0: float) -> None:
        self.client, self.cfg, self.t0 = client, cfg, t0
        self.url = cfg.base_url.rstrip("/") + cfg.endpoint
        self.trie = PrefixTrie()
        self.records: list[RequestRecord] = []
        self.stop = asyncio.Event()
        self.phase = "warmup"
        self.inflight = self.peak_inflight = 0
        self.scored_done = 0  # scored requests finished (for the progress bar)
        self.tasks: set[asyncio.Task] = set()
        self._uid = itertools.count()

    async def sleep_until(self, deadline: float) -> bool:
        """Wait until a perf_counter time; False if `stop` was set first (or is set)."""
        delay = deadline - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(self.stop.wait(), delay)
            except TimeoutError:
                pass
        return not self.stop.is_set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def append_turn(self, c: _Conv, tree: Tree, t: Turn) -> None:
        if t.reset:
            c.clear()
        c.add(self.cfg.synth.turn(t, tree.salt).tolist())
        c.pieces.extend(turn_pieces(t, tree.salt, self.cfg.synth.block_size))

    def append_recorded(self, c: _Conv, tree: Tree, ci: int, ti: int, n: int) -> None:
        sid = tree.session.session_id
        c.add(self.cfg.synth.output(tree.salt, sid, ci, ti, n).tolist())
        c.pieces.append(output_piece(("r", tree.salt, sid, ci, ti), n))

    async def request(self, c: _Conv, tree: Tree, ci: int, ti: int, kind: str, max_tokens: int) -> Outcome:
        """Send the conversation's current history as one request and record it."""
        plen = c.n
        ideal = cached_blocks(c.cursor.match(c.pieces), plen, self.cfg.ideal_block_size)
        c.cursor.store(c.pieces)
        cfg, phase = self.cfg, self.phase
        payload = completion_payload(cfg.model, None, max_tokens, temperature=cfg.temperature,
                                     ignore_eos=cfg.ignore_eos, token_ids=cfg.history == "live", extra=cfg.extra_body)
        body = json.dumps(payload).encode()[:-1] + b', "prompt": [' + c.enc + b"]}"
        meta = dict(phase=phase, lane=tree.lane, session=tree.session.session_id, epoch=tree.epoch, conv=ci, turn=ti,
                    kind=kind, prompt_len=plen, max_tokens=max_tokens, ideal_cached=ideal)
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight) if phase == "scored" else self.peak_inflight
        sent = time.perf_counter()
        try:
            out = await stream_completion(self.client, self.url, body, cfg.request_timeout_s)
        except asyncio.CancelledError:
            self.records.append(RequestRecord(**meta, start_s=sent - self.t0, ok=False, error="cancelled (drain)"))
            raise
        finally:
            self.inflight -= 1
        ms = [(x - out.sent) * 1000.0 for x in out.chunk_times]
        self.scored_done += phase == "scored"
        self.records.append(RequestRecord(
            **meta, start_s=out.sent - self.t0, ok=out.ok, status=out.status, error=out.error, overflow=out.overflow,
            ttft_ms=ms[0] if ms else None, e2el_ms=ms[-1] if ms else None, chunk_ms=tuple(ms),
            chunk_tokens=out.chunk_tokens, prompt_tokens=out.prompt_tokens, output_tokens=out.output_tokens,
            cached_tokens=out.cached_tokens))
        return out

    def preload(self, tree: Tree, ci: int, upto: int) -> _Conv:
        """The history of turns [0, upto) with recorded outputs, without sending anything (mid-session start)."""
        c = _Conv(Cursor(self.trie))
        for ti, t in enumerate(tree.session.convs[ci].turns[:upto]):
            self.append_turn(c, tree, t)
            self.append_recorded(c, tree, ci, ti, t.output_len)
        return c

    async def run_conv(self, tree: Tree, ci: int, start: int = 0, c: _Conv | None = None) -> None:
        conv = tree.session.convs[ci]
        c = c or _Conv(Cursor(self.trie))
        joins: list[asyncio.Task] = []
        prev_end = time.perf_counter()
        for ti in range(start, len(conv.turns)):
            t = conv.turns[ti]
            if not await self.sleep_until(prev_end + t.delay_ms / 1000.0):
                return
            if joins:
                await asyncio.gather(*joins)
                joins = []
                if self.stop.is_set():
                    return
            self.append_turn(c, tree, t)
            for sp in t.spawns:
                if not sp.at_end:
                    self._start_child(tree, sp)
            out = await self.request(c, tree, ci, ti, t.kind, t.output_len)
            if out.overflow:
                return  # the context only grows: the rest of this conversation would overflow too
            if self.cfg.history == "live" and out.ok:
                if out.output_ids is None:
                    raise LiveHistoryError("--history live: the server streamed no token ids (return_token_ids); "
                                           "use --history replay with this server")
                c.add(list(out.output_ids))
                c.pieces.append(output_piece(("live", next(self._uid)), len(out.output_ids)))
                c.cursor.store(c.pieces)
            else:
                self.append_recorded(c, tree, ci, ti, t.output_len)
            for sp in t.spawns:
                if sp.at_end:
                    task = self._start_child(tree, sp)
                    if sp.blocking:
                        joins.append(task)
            prev_end = time.perf_counter()

    def _start_child(self, tree: Tree, sp: Spawn) -> asyncio.Task:
        async def child() -> None:
            if sp.offset_ms and not await self.sleep_until(time.perf_counter() + sp.offset_ms / 1000.0):
                return
            await self.run_conv(tree, sp.conv)

        task = self.spawn(child())
        tree.tasks.append(task)
        return task

    async def run_tree(self, tree: Tree, start: int = 0, c: _Conv | None = None) -> None:
        """The root conversation, then every child it spawned (the tree ends when all have ended)."""
        await self.run_conv(tree, 0, start, c)
        while tree.tasks:
            await tree.tasks.pop()
