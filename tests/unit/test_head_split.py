"""The tensor-parallel split arithmetic: heads along KV groups, MLP rows evening out the weights, every rank busy."""

from __future__ import annotations

import pytest

from shardbook.rankd.parallel.head_split import HeadShare, balanced_ranges, split_heads, split_mlp_rows


def test_balanced_ranges_cover_everything_in_order():
    assert balanced_ranges(9, 2) == [range(5), range(5, 9)]
    assert balanced_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    assert [len(r) for r in balanced_ranges(10, 3)] == [4, 3, 3]


def test_demo_model_heads_split_unevenly_along_kv_groups():
    """SmolLM2: 9 query heads reading 3 KV heads; 2 ranks keep 2 and 1 whole groups."""
    shares = split_heads(9, 3, 2)
    assert shares == [HeadShare(range(6), (0, 1)), HeadShare(range(6, 9), (2,))]
    assert [s.groups for s in shares] == [3, 3]


def test_fewer_kv_heads_than_ranks_split_the_query_heads():
    # one KV head (multi-query attention): every rank reads it
    assert split_heads(8, 1, 4) == [HeadShare(range(2 * r, 2 * r + 2), (0,)) for r in range(4)]
    # 9 query heads over 3 KV heads on 4 ranks: rank 2 holds queries 5-6, reading KV heads 1 and 2 once each
    shares = split_heads(9, 3, 4)
    assert [s.query_heads for s in shares] == [range(3), range(3, 5), range(5, 7), range(7, 9)]
    assert [s.kv_heads for s in shares] == [(0,), (1,), (1, 2), (2,)]
    assert [s.groups for s in shares] == [3, 2, 1, 2]


def test_query_heads_reading_kv_heads_unequally_keep_one_kv_head_each():
    # queries 3-6 of 9 (groups of 3): query 3-5 read KV head 1, query 6 reads KV head 2
    shares = split_heads(9, 3, 2 + 1)
    assert all(s.groups * len(s.kv_heads) == len(s.query_heads) for s in shares)
    (share,) = [s for s in split_heads(12, 3, 5) if s.query_heads == range(3, 6)]
    assert share.kv_heads == (0, 1, 1) and share.groups == 1


def test_more_ranks_than_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="4 attention heads, fewer than the 8 ranks.*gather or reshard"):
        split_heads(4, 2, 8)


def test_mlp_rows_even_out_the_weights_per_rank():
    hidden, head_dim = 576, 64
    shares = split_heads(9, 3, 2)
    attention = [2 * hidden * head_dim * (len(s.query_heads) + len(s.kv_heads)) for s in shares]
    rows = split_mlp_rows(1536, attention, hidden)
    assert rows[0].start == 0 and rows[-1].stop == 1536 and rows[0].stop == rows[1].start
    totals = [a + 3 * hidden * len(r) for a, r in zip(attention, rows)]
    assert max(totals) - min(totals) <= 3 * hidden  # within one MLP row
    assert len(rows[0]) < len(rows[1])  # the rank with more heads gets fewer rows


def test_mlp_rows_keep_at_least_one_row_per_rank():
    rows = split_mlp_rows(4, [1000, 0], hidden=1)
    assert [len(r) for r in rows] == [1, 3]
