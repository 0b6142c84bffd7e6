"""The batch's decode attention goes over each row's own columns (`rankd/generation/row_attention.py`): through the
C kernel (`decode_attention`) where it is built, else row by row where left padding is most of the columns, and
gives what the padded attention gives."""

import pytest
import torch

from shardbook.rankd.generation import decode_attention, row_attention
from shardbook.rankd.generation.growing_layers import grow_in_place
from shardbook.rankd.generation.row_attention import MIN_COLUMNS, by_rows, row_starts
from tests.tiny import make_tiny_llama

LENGTHS = [700, 30, 50, 20]  # one long row among short ones: 71% of the padded columns are padding
STEPS = 3


def left_padded(lengths: list[int], columns: int) -> torch.Tensor:
    """The 4-d boolean decode mask of rows of `lengths` left-padded to `columns`."""
    return (torch.arange(columns) >= columns - torch.tensor(lengths)[:, None])[:, None, None, :]


def tensors(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 4, 1, 8), torch.randn(rows, 2, columns, 8)


def test_row_starts_are_each_rows_first_own_column_when_padding_is_most_of_the_columns():
    query, key = tensors(4, 700)
    assert row_starts(query, key, left_padded(LENGTHS, 700)) == [0, 670, 650, 680]


@pytest.mark.parametrize(
    "lengths, columns, why",
    [
        ([700, 600, 650, 690], 700, "little padding"),
        ([100, 10, 20, 5], 100, "too few columns for a call per row to pay"),
    ],
)
def test_padded_attention_stays_where_row_by_row_would_not_pay(lengths, columns, why):
    query, key = tensors(len(lengths), columns)
    assert row_starts(query, key, left_padded(lengths, columns)) is None, why
    assert columns >= MIN_COLUMNS or why.startswith("too few")


def test_masks_that_are_not_a_decode_steps_left_padding_keep_padded_attention():
    query, key = tensors(4, 700)
    mask = left_padded(LENGTHS, 700)
    holed = mask.clone()
    holed[1, 0, 0, 690] = False  # a row whose own columns have a hole: not left padding
    assert row_starts(query, key, holed) is None
    assert row_starts(query, key, None) is None
    assert row_starts(query, key, torch.where(mask, 0.0, float("-inf"))) is None  # an additive mask
    two_queries = torch.randn(4, 4, 2, 8)
    assert row_starts(two_queries, key, mask.expand(4, 1, 2, 700)) is None  # a prefill, not a decode step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama(tmp_path_factory.mktemp("rows") / "llama", max_position_embeddings=1024)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def decoded(model, lengths: list[int], split: bool) -> torch.Tensor:
    """`STEPS` decode steps' logits of rows of `lengths` random tokens, left-padded into one batch (a growing cache,
    each row at its own positions), with or without `by_rows`."""
    from transformers import DynamicCache

    columns = max(lengths)
    ids = torch.randint(5, 100, (len(lengths), columns), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(columns) >= columns - torch.tensor(lengths)[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        grow_in_place(cache)
        for step in range(STEPS):
            mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.long)], dim=1)
            with by_rows() if split else torch.no_grad():
                out = model(
                    ids[:, -1:],
                    attention_mask=mask,
                    position_ids=torch.tensor(lengths)[:, None] + step,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=torch.tensor([mask.shape[1] - 1]),
                )
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def counted_sdpa(monkeypatch) -> list[torch.Size]:
    """The (rows, heads, columns) of the keys of every call to transformers' own `sdpa`, from now on."""
    row_attention.install()
    calls = []
    sdpa = row_attention._SDPA["sdpa"]
    monkeypatch.setitem(row_attention._SDPA, "sdpa", lambda *a, **k: calls.append(a[2].shape[:3]) or sdpa(*a, **k))
    return calls


def test_a_batch_with_one_long_row_decodes_row_by_row_with_the_padded_logits(model, monkeypatch):
    padded = decoded(model, LENGTHS, split=False)
    monkeypatch.setattr(decode_attention, "available", lambda: False)  # the path where the kernel is not built
    calls = counted_sdpa(monkeypatch)
    split = decoded(model, LENGTHS, split=True)
    layers = model.config.num_hidden_layers
    prefill, steps = calls[:layers], calls[layers:]
    assert all(shape[0] == len(LENGTHS) for shape in prefill)  # a prefill attends as transformers does
    assert len(steps) == STEPS * layers * len(LENGTHS) and all(shape[0] == 1 for shape in steps)  # a call per row
    assert [shape[2] for shape in steps[: len(LENGTHS)]] == [length + 1 for length in LENGTHS]  # its own columns
    # the same sums in another order (the padded kernel blocks over 700 columns): within 5e-5 of logits up to ~5
    assert torch.allclose(split, padded, atol=5e-5), (split - padded).abs().max()


@pytest.mark.parametrize("lengths", [LENGTHS, [130] * 4, [140, 139, 12, 1]], ids=["long", "equal", "short"])
def test_the_decode_kernel_takes_every_decode_step_with_the_padded_logits(model, monkeypatch, lengths):
    if not decode_attention.available():
        pytest.skip("the decode attention kernel is not built here (no C compiler)")
    padded = decoded(model, lengths, split=False)
    calls = counted_sdpa(monkeypatch)
    kernel_calls = []
    kernel = decode_attention.decode_attention
    monkeypatch.setattr(decode_attention, "decode_attention", lambda *a: kernel_calls.append(a[1].shape) or kernel(*a))
    split = decoded(model, lengths, split=True)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers  # the prefill alone goes to transformers' sdpa
    assert len(kernel_calls) == STEPS * layers and all(shape[0] == len(lengths) for shape in kernel_calls)
    assert torch.allclose(split, padded, atol=5e-5), (split - padded).abs().max()


def test_each_row_equals_its_solo_decode(model):
    split = decoded(model, LENGTHS, split=True)
    for row in range(len(LENGTHS)):
        alone = decoded_alone(model, LENGTHS, row)
        assert torch.allclose(split[row], alone, atol=1e-5), (row, (split[row] - alone).abs().max())


def decoded_alone(model, lengths: list[int], row: int) -> torch.Tensor:
    """The same row's `STEPS` decode steps with no other row (no padding, no mask)."""
    from transformers import DynamicCache

    columns = max(lengths)
    ids = torch.randint(5, 100, (len(lengths), columns), generator=torch.Generator().manual_seed(1))[row]
    own = ids[columns - lengths[row] :][None]
    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        model(own, past_key_values=cache, use_cache=True)
        for step in range(STEPS):
            out = model(own[:, -1:], position_ids=torch.tensor([[lengths[row] + step]]), past_key_values=cache)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


def test_a_step_of_few_columns_in_all_stays_with_sdpa(model, monkeypatch):
    calls = counted_sdpa(monkeypatch)
    decoded(model, [40, 39, 12, 1], split=True)  # 4 x 43 columns, fewer than MIN_KERNEL_POSITIONS
    assert len(calls) == (1 + STEPS) * model.config.num_hidden_layers


def test_outside_by_rows_attention_is_transformers_own(model, monkeypatch):
    calls = counted_sdpa(monkeypatch)
    decoded(model, LENGTHS, split=False)
    assert calls and {shape[0] for shape in calls} == {len(LENGTHS)}


def test_the_mask_may_come_by_name_as_some_families_pass_it():
    import types

    row_attention.install()
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query, key = tensors(4, 700)
    value = torch.randn_like(key)
    mask = left_padded(LENGTHS, 700)
    wrapper = row_attention._sdpa_maybe_by_rows
    padded, _ = row_attention._SDPA["sdpa"](module, query, key, value, mask, scaling=0.3)
    for split in (False, True):
        with by_rows() if split else torch.no_grad():
            by_name, _ = wrapper(module, query, key, value, attention_mask=mask, scaling=0.3)
            positional, _ = wrapper(module, query, key, value, mask, scaling=0.3)
        assert torch.allclose(by_name, padded, atol=1e-5) and torch.equal(by_name, positional), split
