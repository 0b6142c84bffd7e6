"""The C decode-attention kernel (`rankd/generation/decode_attention.py`): the same attention as torch's
`scaled_dot_product_attention` over each row's own columns, for the shapes, dtypes and layouts the batch's cache
has; None where it does not apply; built once per machine, and off with a reason where it cannot be built."""

import logging

import pytest
import torch
import torch.nn.functional as F

from shardbook.rankd.generation import decode_attention

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="no C compiler here: the kernel is not built")


def batch(lengths, heads, kv_heads, dim, dtype=torch.float32, room=(2, 5)):
    """A decode step's query and the left-padded keys and values of rows of `lengths`, as views of a buffer with
    `room` more rows and columns (the growing cache's layout: strided, not contiguous); each row's first column."""
    rows, columns = len(lengths), max(lengths)
    generator = torch.Generator().manual_seed(len(lengths) * 31 + heads + dim)
    shape = (rows + room[0], kv_heads, columns + room[1], dim)
    keys, values = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    query = torch.randn(rows, heads, 1, dim, generator=generator).to(dtype)
    starts = torch.tensor([columns - length for length in lengths])
    return query, keys[:rows, :, :columns], values[:rows, :, :columns], starts


def padded_reference(query, key, value, starts, scale):
    """torch's attention over the padded columns, masked, in float32."""
    columns = key.shape[2]
    mask = (torch.arange(columns) >= starts[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )


MIXES = {"equal": [33] * 4, "one long": [300, 7, 20, 1], "single": [1], "odd": [5, 17, 3]}


@pytest.mark.parametrize("mix", MIXES, ids=list(MIXES))
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 8, 16), (16, 1, 128), (4, 2, 8)])
def test_float32_attention_equals_torchs_over_each_rows_own_columns(mix, heads, kv_heads, dim):
    query, key, value, starts = batch(MIXES[mix], heads, kv_heads, dim)
    got = decode_attention.decode_attention(query, key, value, starts, 0.17)
    want = padded_reference(query, key, value, starts, 0.17)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


def test_values_may_have_another_head_size_than_the_keys_as_mlas_do():
    query, key, _, starts = batch(MIXES["one long"], 8, 8, 24)
    value = torch.randn(*key.shape[:3], 16)
    got = decode_attention.decode_attention(query, key, value, starts, 0.2)
    want = padded_reference(query, key, value, starts, 0.2)
    assert got.shape == (4, 8, 1, 16)
    assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


def test_bfloat16_keys_are_read_as_they_are_and_the_output_is_bfloat16():
    query, key, value, starts = batch(MIXES["one long"], 9, 3, 64, dtype=torch.bfloat16)
    got = decode_attention.decode_attention(query, key, value, starts, 0.125)
    want = padded_reference(query, key, value, starts, 0.125)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, atol=1e-2), (got.float() - want).abs().max()  # bf16 rounding of the output


def test_rows_and_heads_split_over_threads_give_the_same_result():
    query, key, value, starts = batch([64, 3, 40, 128, 9, 1], 9, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention.decode_attention(query, key, value, starts, 0.125)
        torch.set_num_threads(2)
        two = decode_attention.decode_attention(query, key, value, starts, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (row, head) is summed by one thread in one order


def paged(key, value, starts, block, spare=3):
    """The rows' own positions of a left-padded `key` and `value` copied into pools of `block`-position blocks, in
    a shuffled order with `spare` unused blocks among them (the paged cache's layout); the block table and lengths."""
    rows, columns = key.shape[0], key.shape[2]
    lengths = columns - starts
    per_row = [-(-int(length) // block) for length in lengths]
    order = torch.randperm(sum(per_row) + spare, generator=torch.Generator().manual_seed(7))
    pools = [t.new_full((len(order), t.shape[1], block, t.shape[3]), float("nan")) for t in (key, value)]
    table = torch.zeros(rows, max(per_row), dtype=torch.int64)
    used = iter(order.tolist())
    for row in range(rows):
        for i in range(per_row[row]):
            table[row, i] = number = next(used)
            own = slice(int(starts[row]) + i * block, min(columns, int(starts[row]) + (i + 1) * block))
            for pool, source in zip(pools, (key, value)):
                part = source[row, :, own]
                pool[number, :, : part.shape[1]] = part
    return *pools, table, lengths


@pytest.mark.parametrize("mix", MIXES, ids=list(MIXES))
@pytest.mark.parametrize("block", [16, 4])
def test_paged_attention_reads_each_rows_blocks_in_order_and_nothing_else(mix, block):
    query, key, value, starts = batch(MIXES[mix], 9, 3, 64)
    key_pool, value_pool, table, lengths = paged(key, value, starts, block)
    got = decode_attention.paged_decode_attention(query, key_pool, value_pool, table, lengths, 0.125)
    want = padded_reference(query, key, value, starts, 0.125)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()  # the unused (NaN) positions never read


def test_paged_attention_takes_bfloat16_pools_and_mla_value_sizes():
    query, key, _, starts = batch(MIXES["one long"], 8, 8, 24, dtype=torch.bfloat16)
    value = torch.randn(*key.shape[:3], 16).to(torch.bfloat16)
    key_pool, value_pool, table, lengths = paged(key, value, starts, 16)
    got = decode_attention.paged_decode_attention(query, key_pool, value_pool, table, lengths, 0.2)
    want = padded_reference(query, key, value, starts, 0.2)
    assert got.dtype == torch.bfloat16 and got.shape == (4, 8, 1, 16)
    assert torch.allclose(got.float(), want, atol=1e-2), (got.float() - want).abs().max()


def test_paged_attention_with_blocks_of_a_size_not_a_multiple_of_4_falls_back():
    query, key, value, starts = batch([16, 8], 6, 3, 16)
    key_pool, value_pool, table, lengths = paged(key, value, starts, 6)
    assert decode_attention.paged_decode_attention(query, key_pool, value_pool, table, lengths, 0.25) is None


def test_a_nan_stays_in_its_own_row():
    query, key, value, starts = batch([20, 20, 20], 4, 2, 16)
    value[1, 0, 5, 3] = float("nan")
    got = decode_attention.decode_attention(query, key, value, starts, 0.25)
    assert got[1, :2].isnan().any() and not got[1, 2:].isnan().any()  # row 1's heads over key head 0 only
    assert not got[0].isnan().any() and not got[2].isnan().any()


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda q, k, v: (q.expand(-1, -1, 2, -1), k, v), "two query tokens: a prefill"),
        (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), "a head size that is not a multiple of 8"),
        (lambda q, k, v: (q.half(), k.half(), v.half()), "float16"),
        (lambda q, k, v: (q.repeat(1, 20, 1, 1)[:, : 17 * 3], k, v), "17 query heads per key head"),
        (lambda q, k, v: (q, k, v.float().double()), "keys and values of different dtypes"),
        (lambda q, k, v: (q, k.transpose(2, 3), v), "a key tensor whose head size is not contiguous"),
    ],
)
def test_what_the_kernel_does_not_take_returns_none_for_the_caller_to_fall_back(change, why):
    query, key, value, starts = batch([16, 8], 6, 3, 16)
    query, key, value = change(query, key, value)
    assert decode_attention.decode_attention(query, key, value, starts, 0.25) is None, why


def test_the_build_is_made_once_per_machine_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_attention, "_cache_dir", lambda: tmp_path)
    first = decode_attention._built()
    made = first.stat().st_mtime_ns
    assert decode_attention._built() == first and first.stat().st_mtime_ns == made
    assert [path.name for path in tmp_path.iterdir()] == [first.name]  # no scratch left beside it


def test_without_a_compiler_the_kernel_is_off_and_the_log_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(decode_attention, "_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    decode_attention._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=decode_attention.__name__):
            assert not decode_attention.available()
        assert decode_attention.decode_attention(*batch([4], 2, 1, 8), 0.5) is None
        assert "no C compiler" in caplog.text and "no-such-cc" in caplog.text and "set CC" in caplog.text
    finally:
        decode_attention._library.cache_clear()


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(decode_attention.SWITCH, "0")
    decode_attention._library.cache_clear()
    try:
        assert not decode_attention.available()
    finally:
        monkeypatch.delenv(decode_attention.SWITCH)
        decode_attention._library.cache_clear()
    assert decode_attention.available()
