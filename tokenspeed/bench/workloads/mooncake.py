"""Mooncake-style JSONL traces: one request per line, in session order.

Each line: {"session_id", "input_length" (new tokens), "output_length", "hash_ids" (block ids of the new tokens,
`block_size` tokens each, the last one partial), "delay" (ms from the previous request's end)}. Other tools read
these five fields and ignore the rest. Our extensions, written only when they differ from the default:
"kind" (subagent | sidecar | compaction; default root), "shared_blocks" (leading hash ids that are global, default 0),
"reset" (true: the history is dropped before this request), and on a child conversation's first line
"parent" (the spawning conversation's session_id), "parent_turn" (its turn index), "spawn" ("end" | "start"),
"blocking" and "offset" (ms). A child conversation's session_id is "<root>.<conv>".

Import also takes other tools' traces: lines without session_id are single-request sessions, a missing delay is 0,
missing hash_ids get fresh ids, and `cumulative=True` reads traces whose input_length / hash_ids cover the whole
prompt (each request then restarts its context: `reset`). Without "shared_blocks", the leading hash ids that also
occur in another session are taken as global.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from tokenspeed.bench.workloads.trace import (
    BLOCK_SIZE,
    BlockAllocator,
    Conversation,
    Session,
    Spawn,
    Trace,
    Turn,
    num_blocks,
    runs,
)


def export_jsonl(trace: Trace, path: str | Path) -> int:
    """Write the trace; returns the number of lines (requests)."""
    n = 0
    with open(path, "w") as f:
        for s in trace.sessions:
            parents: dict[int, tuple[int, int, Spawn]] = {}
            for ci, conv in enumerate(s.convs):
                for ti, t in enumerate(conv.turns):
                    for sp in t.spawns:
                        parents[sp.conv] = (ci, ti, sp)
            for ci, conv in enumerate(s.convs):
                sid = str(s.session_id) if ci == 0 else f"{s.session_id}.{ci}"
                for ti, t in enumerate(conv.turns):
                    line: dict = {"session_id": sid, "input_length": t.input_len, "output_length": t.output_len,
                                  "hash_ids": t.block_ids(), "delay": t.delay_ms}
                    if t.kind != "root":
                        line["kind"] = t.kind
                    if t.shared_blocks:
                        line["shared_blocks"] = t.shared_blocks
                    if t.reset:
                        line["reset"] = True
                    if ti == 0 and ci in parents:
                        pc, pt, sp = parents[ci]
                        line.update(parent=str(s.session_id) if pc == 0 else f"{s.session_id}.{pc}", parent_turn=pt,
                                    spawn="end" if sp.at_end else "start", blocking=sp.blocking,
                                    offset=sp.offset_ms)
                    f.write(json.dumps(line) + "\n")
                    n += 1
    return n


def _read(path: str | Path) -> list[dict]:
    lines = []
    with open(path) as f:
        for i, raw in enumerate(f):
            if raw.strip():
                try:
                    lines.append(json.loads(raw))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
    return lines


def import_jsonl(path: str | Path, block_size: int = BLOCK_SIZE, cumulative: bool = False,
                 name: str | None = None) -> Trace:
    """Read a Mooncake-style JSONL trace (ours or another tool's)."""
    lines = _read(path)
    alloc = BlockAllocator(1 + max((max(ln.get("hash_ids") or [-1]) for ln in lines), default=-1))
    convs: dict[str, list[dict]] = defaultdict(list)
    for i, ln in enumerate(lines):
        convs[str(ln.get("session_id", f"req{i}"))].append(ln)

    def root_of(cid: str) -> str:
        while "parent" in convs[cid][0]:
            cid = str(convs[cid][0]["parent"])
        return cid

    trees: dict[str, list[str]] = defaultdict(list)  # root id -> conversation ids, root first
    for cid in convs:
        trees[root_of(cid)].append(cid)
    owners: dict[int, set[str]] = defaultdict(set)  # hash id -> the session trees using it
    for root, cids in trees.items():
        for cid in cids:
            for ln in convs[cid]:
                for h in ln.get("hash_ids") or ():
                    owners[h].add(root)

    sessions = []
    for si, (root, cids) in enumerate(trees.items()):
        index = {cid: k for k, cid in enumerate(cids)}
        spawns: dict[tuple[int, int], list[Spawn]] = defaultdict(list)
        for cid in cids[1:]:
            first = convs[cid][0]
            spawns[(index[str(first["parent"])], int(first.get("parent_turn", 0)))].append(
                Spawn(index[cid], at_end=first.get("spawn", "end") == "end", blocking=bool(first.get("blocking")),
                      offset_ms=float(first.get("offset", 0.0))))
        built = []
        for ci, cid in enumerate(cids):
            turns = []
            for ti, ln in enumerate(convs[cid]):
                n_in = int(ln["input_length"])
                ids = list(ln["hash_ids"]) if ln.get("hash_ids") is not None else list(alloc.take(n_in, block_size))
                if len(ids) != num_blocks(n_in, block_size):
                    raise ValueError(f"{path}: session {cid} request {ti}: {len(ids)} hash_ids for {n_in} tokens "
                                     f"at block size {block_size} (pass the trace's block size)")
                shared = ln.get("shared_blocks")
                if shared is None:
                    shared = next((k for k, h in enumerate(ids) if len(owners[h]) < 2), len(ids))
                turns.append(Turn(n_in, runs(ids), int(ln["output_length"]), float(ln.get("delay", 0.0)),
                                  kind=ln.get("kind", "root" if ci == 0 else "subagent"), shared_blocks=int(shared),
                                  reset=bool(ln.get("reset", cumulative)), spawns=tuple(spawns.get((ci, ti), ()))))
            built.append(Conversation(tuple(turns), turns[0].kind if ci else "root"))
        sessions.append(Session(si, tuple(built)))
    return Trace(name or Path(path).stem, tuple(sessions), block_size=block_size, params={"source": str(path)})
