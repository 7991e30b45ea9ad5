"""The ideal hit against a hand count, the prefix trie, token synthesis, Mooncake JSONL export/import."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenspeed.bench.workloads import build, export_jsonl, ideal_hit, import_jsonl
from tokenspeed.bench.workloads.prefix import PrefixTrie, turn_pieces
from tokenspeed.bench.workloads.synth import TokenSynth
from tokenspeed.bench.workloads.trace import BlockAllocator, Conversation, Session, Trace, make_turn, runs


def _small_trace() -> Trace:
    """Session 0: turn 1 = 128 global + 72 private tokens (200), 60 out; turn 2 = +100 tokens, 10 out.
    Session 1: turn 1 = the same 128 global + 50 private tokens (178), 10 out."""
    alloc = BlockAllocator()
    g = alloc.take(128)
    s0 = (make_turn(alloc, 72, 60, shared=g, shared_tokens=128), make_turn(alloc, 100, 10))
    s1 = (make_turn(alloc, 50, 10, shared=g, shared_tokens=128),)
    return Trace("hand", (Session(0, (Conversation(s0),)), Session(1, (Conversation(s1),))))


def test_ideal_hit_hand_count():
    tr = _small_trace()
    # prompts: 200, 200 + 60 + 100 = 360, 178 -> 738 tokens.
    # replay: turn 2 shares the 200-token prompt 1 -> 192 (3 whole blocks); session 1 shares the 128 global -> 128.
    rep = ideal_hit(tr, "replay")
    assert sum(rep.prompt.values()) == 738 and sum(rep.cached.values()) == 192 + 128
    # live: the server also cached prompt 1 + its 60 output tokens = 260 -> 256 (4 blocks).
    live = ideal_hit(tr, "live")
    assert sum(live.cached.values()) == 256 + 128
    assert live.ratio() == pytest.approx(384 / 738)
    assert ideal_hit(tr, "replay", block_size=128).ratio() == pytest.approx((128 + 128) / 738)


def test_partial_global_block_is_private():
    alloc = BlockAllocator()
    g = alloc.take(100)  # 100 global tokens: only the first block is whole
    t = make_turn(alloc, 28, 1, shared=g, shared_tokens=100)
    assert t.input_len == 128 and t.shared_blocks == 1 and t.num_blocks == 2
    assert t.blocks == (range(0, 1), range(2, 3))


def test_trie_partial_pieces():
    trie = PrefixTrie()
    trie.insert([(("b", 1, 0, 5), 300), (("o", "x"), 7)])
    assert trie.match([(("b", 1, 0, 5), 300), (("o", "x"), 7), (("b", 1, 9, 10), 5)]) == 307
    assert trie.match([(("b", 1, 0, 3), 150)]) == 150  # a prefix of a stored run
    assert trie.match([(("b", 1, 0, 8), 500)]) == 300  # extends past it
    assert trie.match([(("b", 2, 0, 5), 300)]) == 0  # other salt: other tokens


def test_turn_pieces_split_at_shared_boundary():
    alloc = BlockAllocator()
    g = alloc.take(256)
    t = make_turn(alloc, 100, 1, shared=g, shared_tokens=256)
    assert t.blocks == (range(0, 6),)  # one run, but two pieces: global (salt 0) and private
    assert turn_pieces(t, 7, 64) == [(("b", 0, 0, 4), 256), (("b", 7, 4, 6), 100)]


def test_synth_blocks_are_deterministic_prefixes():
    sy = TokenSynth(seed=3, block_size=64, low=16, high=512)
    alloc = BlockAllocator()
    g = alloc.take(128)
    a = make_turn(alloc, 70, 1, shared=g, shared_tokens=128)
    b = make_turn(alloc, 10, 1, shared=g, shared_tokens=128)
    ta, tb = sy.turn(a, salt=11), sy.turn(b, salt=11)
    assert len(ta) == 198 and len(tb) == 138 and ta.min() >= 16 and ta.max() < 512
    assert np.array_equal(ta[:128], tb[:128]) and not np.array_equal(ta[128:138], tb[128:138])
    assert np.array_equal(sy.turn(a, salt=11), ta)
    other = sy.turn(a, salt=12)
    assert np.array_equal(other[:128], ta[:128]) and np.mean(other[128:] == ta[128:]) < 0.05
    full = sy.blocks(11, np.array([2, 3, 4]))
    assert np.array_equal(full[:70], ta[128:])  # the partial last block is a prefix of the full block
    assert np.array_equal(sy.output(5, 1, 0, 2, 10), sy.output(5, 1, 0, 2, 20)[:10])


def test_mooncake_roundtrip(tmp_path):
    tr = build("agentx-like", scale=0.01, num_sessions=15)
    path = tmp_path / "t.jsonl"
    n = export_jsonl(tr, path)
    assert n == sum(s.num_requests() for s in tr.sessions)
    first = json.loads(path.read_text().splitlines()[0])
    assert {"session_id", "input_length", "output_length", "hash_ids", "delay"} <= set(first)
    back = import_jsonl(path)
    assert back.sessions == tr.sessions
    assert ideal_hit(back).as_dict() == ideal_hit(tr).as_dict()


def test_import_foreign_trace(tmp_path):
    path = tmp_path / "mc.jsonl"
    lines = [{"timestamp": 0, "input_length": 150, "output_length": 5, "hash_ids": [0, 1, 2]},
             {"timestamp": 10, "input_length": 140, "output_length": 5, "hash_ids": [0, 1, 3]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tr = import_jsonl(path)
    assert len(tr.sessions) == 2 and [s.root.turns[0].shared_blocks for s in tr.sessions] == [2, 2]
    assert ideal_hit(tr).cached == {"root": 128}
    # cumulative multi-turn traces: each line is the whole prompt
    path.write_text("".join(json.dumps({"session_id": "a", "input_length": n, "output_length": 4, "hash_ids": h})
                            + "\n" for n, h in [(128, [0, 1]), (192, [0, 1, 2])]))
    cum = import_jsonl(path, cumulative=True)
    assert all(t.reset for t in cum.sessions[0].root.turns)
    assert ideal_hit(cum).cached == {"root": 128}
    path.write_text(json.dumps({"input_length": 1000, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="block size"):
        import_jsonl(path)


def test_runs():
    assert runs([3, 4, 5, 9, 10, 2]) == (range(3, 6), range(9, 11), range(2, 3))
    assert runs([]) == ()
