"""The batch's decode attention row by row over each row's own positions, when left padding is most of the columns.

The batch's cache is left-padded: every row holds as many columns as the longest row, and a decode step's
attention reads all of them, masked. One long prompt among short ones (a pasted paper beside chat turns) makes
every row's attention cost the long row's. Attending row by row over each row's own columns costs the rows' own
lengths instead: one layer of the demo model's shape on a CPU, 31 rows of 256 tokens and one of 8,192, took
82 ms padded and 4.7 ms row by row; at equal lengths row by row took 1.06x to 1.13x the padded time (one call
per row; `bench/bench_ragged_attention.py`). So on a CPU the batch's decode forward (`by_rows`) attends row by
row where at least `PADDED_SHARE` of the columns are padding and there are at least `MIN_COLUMNS` of them, and
everywhere else as transformers' `sdpa` does.

It takes the place of transformers' `sdpa` entry in `AttentionInterface` (`install`), and changes nothing
outside `by_rows` or where the mask is not a decode step's left padding: a row's mask must be False then True
(its padding, then its own positions), which is exactly attention over the True columns without a mask, so the
result is the masked one's up to the summation order. Not on a GPU (a padded kernel call there is cheaper than a
call per row; not measured), nor with a position bias.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

PADDED_SHARE = 0.25
"""Attend row by row only when at least this share of the rows' columns is padding (row by row costs ~1.1x the
padded attention per real column)."""
MIN_COLUMNS = 512
"""... and the rows have at least this many columns: below, the cost of a call per row outweighs the padding."""

_BY_ROWS: ContextVar[bool] = ContextVar("shardbook_attention_by_rows", default=False)
_SDPA: dict[str, Any] = {}


def install() -> None:
    """Put `_sdpa_maybe_by_rows` in transformers' `sdpa` entry (once per process)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not _SDPA:
        _SDPA["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
        AttentionInterface.register("sdpa", _sdpa_maybe_by_rows)


@contextlib.contextmanager
def by_rows() -> Iterator[None]:
    """The forwards inside may attend row by row (the batch's decode step)."""
    install()
    token = _BY_ROWS.set(True)
    try:
        yield
    finally:
        _BY_ROWS.reset(token)


def row_starts(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> list[int] | None:
    """Each row's first own column when attention should go row by row (a CPU decode step whose boolean mask is
    every row's left padding, mostly padding, wide enough); None otherwise."""
    if query.device.type != "cpu" or query.shape[2] != 1 or mask is None or mask.dtype != torch.bool:
        return None
    rows, columns = key.shape[0], key.shape[2]
    if columns < MIN_COLUMNS or mask.shape[0] != rows or mask.numel() != rows * columns:
        return None
    own = mask.reshape(rows, columns)
    counts = own.sum(dim=1)
    if int(counts.sum()) > (1 - PADDED_SHARE) * rows * columns:
        return None
    starts = columns - counts
    if not torch.equal(own, torch.arange(columns, device=own.device) >= starts[:, None]):
        return None
    return starts.tolist()


def _sdpa_maybe_by_rows(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kw):
    """transformers' `sdpa` (the same arguments, the mask positional or by name), called once per row over the
    row's own columns where `row_starts` says so."""
    sdpa = _SDPA["sdpa"]
    mask, args = (args[0], args[1:]) if args else (kw.pop("attention_mask", None), ())
    biased = kw.get("position_bias") is not None
    starts = row_starts(query, key, mask) if _BY_ROWS.get() and not biased else None
    if starts is None:
        return sdpa(module, query, key, value, mask, *args, **kw)
    outputs = [
        sdpa(
            module,
            query[row : row + 1],
            key[row : row + 1, :, start:],
            value[row : row + 1, :, start:],
            None,
            *args,
            **kw,
        )
        for row, start in enumerate(starts)
    ]
    return torch.cat([output for output, _ in outputs]), None
