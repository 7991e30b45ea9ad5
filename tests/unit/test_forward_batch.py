"""ForwardBatch.build (one host buffer, vectorised) against a per-token reference, and the PageList it reads.

Scenarios: random mixes of decode (1 token), verify (k tokens), prefill chunks and empty sequences, small and
large batches (Python and numpy paths), with plain lists and PageLists as page tables, give exactly the reference's values, dtypes and shapes (int32 page table
zero-padded); each device tensor starts 64-byte aligned; too few pages and mismatched lengths raise ValueError;
a PageList's numpy copy follows append / extend / += (earlier snapshots unchanged) and is dropped by any other
mutation, after which build converts the list; copies and pickles get their own copy.
"""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch

from tokenspeed.cache import PageList
from tokenspeed.models import ForwardBatch


def _reference(new_tokens, num_cached, page_tables, kda_slots, page_size) -> dict:
    positions, slots, cu, kv = [], [], [0], []
    for toks, cached, pages in zip(new_tokens, num_cached, page_tables, strict=True):
        positions += range(cached, cached + len(toks))
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(cached, cached + len(toks))]
        cu.append(cu[-1] + len(toks))
        kv.append(cached + len(toks))
    width = max((len(p) for p in page_tables), default=0)
    qlens = {len(t) for t in new_tokens}
    return {
        "input_ids": [t for toks in new_tokens for t in toks], "positions": positions, "cu_seqlens": cu,
        "kv_lens": kv, "slot_mapping": slots, "kda_slots": list(kda_slots),
        "page_table": [list(p) + [0] * (width - len(p)) for p in page_tables], "width": width,
        "uniform": qlens.pop() if len(qlens) == 1 else None,
    }


@pytest.mark.parametrize("kind", ["decode", "verify", "mixed"])
@pytest.mark.parametrize("page_list", [False, True])
def test_build_matches_reference(kind: str, page_list: bool) -> None:
    rng = random.Random(hash((kind, page_list)) & 0xFFFF)
    for _ in range(60):
        n, page_size = rng.choice([rng.randint(1, 9), rng.randint(17, 40)]), rng.choice([1, 4, 16])  # both paths
        toks, cached, tables = [], [], []
        for _ in range(n):
            q = {"decode": 1, "verify": 4, "mixed": rng.randint(0, 11)}[kind]
            c = rng.randint(0, 70)
            pages = rng.sample(range(5000), -(-(c + q) // page_size) + rng.randint(0, 2))
            toks.append([rng.randrange(512) for _ in range(q)])
            cached.append(c)
            tables.append(PageList(pages) if page_list else pages)
        slots = [rng.randrange(-1, 20) for _ in range(n)]
        ref = _reference(toks, cached, tables, slots, page_size)
        b = ForwardBatch.build(toks, cached, tables, slots, page_size, verify=kind == "verify")
        for name in ("input_ids", "positions", "cu_seqlens", "kv_lens", "slot_mapping", "kda_slots"):
            t = getattr(b, name)
            assert t.dtype == torch.int64 and t.dim() == 1 and t.tolist() == ref[name], name
            assert t.numel() == 0 or t.data_ptr() % 64 == 0, name
        assert b.page_table.dtype == torch.int32 and tuple(b.page_table.shape) == (n, ref["width"])
        assert b.page_table.tolist() == ref["page_table"] and b.page_table.is_contiguous()
        assert b.cu_seqlens_host == ref["cu_seqlens"] and b.kv_lens_host == ref["kv_lens"]
        assert b.uniform_query_len == ref["uniform"] and b.verify == (kind == "verify")


def test_build_edge_cases_and_errors() -> None:
    empty = ForwardBatch.build([], [], [], [], 16)
    assert empty.num_seqs == 0 and empty.num_tokens == 0 and tuple(empty.page_table.shape) == (0, 0)
    assert empty.uniform_query_len is None
    b = ForwardBatch.build([[], [7]], [5, 0], [[3], PageList([4])], [0, 1], 16)
    assert b.cu_seqlens_host == [0, 0, 1] and b.uniform_query_len is None and b.slot_mapping.tolist() == [64]
    with pytest.raises(ValueError, match="1 pages of 16 cannot hold 17 tokens"):
        ForwardBatch.build([[1, 2, 3]], [14], [[0]], [0], 16)
    with pytest.raises(ValueError, match="2 pages of 4 cannot hold 9 tokens"):  # a large batch: numpy check
        ForwardBatch.build([[1]] * 30, [0] * 29 + [8], [[0, 1]] * 30, [0] * 30, 4)
    with pytest.raises(ValueError):
        ForwardBatch.build([[1]], [0, 1], [[0]], [0], 16)


def test_page_list_keeps_its_copy() -> None:
    pages = PageList([3, 4])
    snapshot = pages.host_array()
    for p in range(40):
        pages.append(p)
    pages.extend(range(5))
    pages += [9]
    assert pages == [3, 4, *range(40), *range(5), 9] and pages.host_array().tolist() == list(pages)
    assert snapshot.tolist() == [3, 4] and pages[:2] == [3, 4] and isinstance(pages, list)
    for mutate in (lambda p: p.__setitem__(0, 77), lambda p: p.sort(reverse=True), lambda p: p.pop(),
                   lambda p: p.insert(0, 1), lambda p: p.remove(3), lambda p: p.clear(), lambda p: p.reverse()):
        other = PageList(pages)
        mutate(other)
        assert other.host_array() is None  # dropped: build converts the list instead
        other.append(5)
        assert other.host_array() is None
        b = ForwardBatch.build([[1]], [0], [other], [0], 1)
        assert b.page_table.tolist() == [list(other)]
    empty = PageList()
    clone = copy.copy(empty)
    clone.append(1)
    empty.append(2)
    assert clone.host_array().tolist() == [1] and empty.host_array().tolist() == [2]  # no shared buffer
    for clone in (copy.copy(pages), copy.deepcopy(pages), pickle.loads(pickle.dumps(pages))):
        assert clone == pages and type(clone) is PageList
        clone.append(11)
        assert clone.host_array().tolist() == list(clone) and pages.host_array().tolist() == list(pages)
        assert ForwardBatch.build([[1]], [0], [clone], [0], 1).page_table.tolist() == [list(clone)]
