"""The batch's decode attention over each row's own positions, not the left padding of the batch's cache.

The batch's cache is left-padded: every row holds as many columns as the longest row, and transformers' `sdpa`
reads all of them, masked. One long prompt among short ones (a pasted paper beside chat turns) makes every row's
attention cost the long row's. In the batch's decode forward (`by_rows`) on a CPU, attention goes instead:

* through `decode_attention`'s C kernel where it is built and applies: every row and head in one call, each row
  over its own columns (0.5x to 0.9x the padded call's time at equal lengths, and a small fraction of it with
  one long row among short ones; `bench/bench_ragged_attention.py`);
* else row by row, one `sdpa` call per row over its own columns, where at least `PADDED_SHARE` of the columns are
  padding and there are at least `MIN_COLUMNS` of them (31 rows of 256 tokens and one of 8,192: 82 ms padded,
  4.7 ms row by row; at equal lengths 1.06x to 1.13x the padded time, so not there);
* else as transformers' `sdpa` does.

MLA's stand-ins for its expanded keys and values (`latent_attention`) are attended over the cached latents
directly. A paged cache's layers (`paged_layers`) hand attention stand-ins for their keys and values: those are attended
through the kernel's block table, or, where the kernel does not take the call, as the padded rows gathered from
the blocks.

It takes the place of transformers' `sdpa` entry in `AttentionInterface` (`install`), and changes nothing
outside `by_rows` or where the mask is not a decode step's left padding: a row's mask must be False then True
(its padding, then its own positions), which is exactly attention over the True columns without a mask, so the
result is the masked one's up to the summation order. Not on a GPU (a padded kernel call there is cheaper than a
call per row; not measured), nor with a position bias, attention sinks, a soft cap or dropout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from shardbook.rankd.generation import decode_attention, latent_attention, paged_layers

PADDED_SHARE = 0.25
"""Attend row by row only when at least this share of the rows' columns is padding (row by row costs ~1.1x the
padded attention per real column)."""
MIN_KERNEL_POSITIONS = 512
"""Through the kernel only when the rows hold at least this many columns in all: its call costs some 50 us more
than a padded `sdpa` call (1 row of 64 tokens: 85 against 32 us; 8 rows of 128: 234 against 311 us)."""
MIN_COLUMNS = 512
"""... and the rows have at least this many columns: below, the cost of a call per row outweighs the padding."""

_BY_ROWS: ContextVar[dict | None] = ContextVar("shardbook_attention_by_rows", default=None)
"""Inside `by_rows`: each mask's row starts for the kernel, by the mask's id (a forward's layers share one mask),
with the mask itself so that its id is not reused."""
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
    token = _BY_ROWS.set({})
    try:
        with paged_layers.markers_expected():
            yield
    finally:
        _BY_ROWS.reset(token)


@contextlib.contextmanager
def over_latents(model: Any) -> Iterator[None]:
    """The forwards of `model` inside attend over MLA's cached latents where that applies (`latent_attention`),
    through this entry."""
    install()
    with latent_attention.absorbing(model):
        yield


def row_starts(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> list[int] | None:
    """Each row's first own column when attention should go row by row (a CPU decode step whose boolean mask is
    every row's left padding, mostly padding, wide enough); None otherwise."""
    rows, columns = key.shape[0], key.shape[2]
    if columns < MIN_COLUMNS:
        return None
    starts = left_padding_starts(query, key, mask)
    if starts is None or int(starts.sum()) < PADDED_SHARE * rows * columns:
        return None
    return starts.tolist()


def left_padding_starts(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Each row's first own column (rows,) when this is a CPU decode step (one query token per row) whose boolean
    mask is every row's left padding, then its own columns (no mask: none padded); None otherwise."""
    if query.device.type != "cpu" or query.shape[2] != 1:
        return None
    rows, columns = key.shape[0], key.shape[2]
    if mask is None:
        return torch.zeros(rows, dtype=torch.long)
    if mask.dtype != torch.bool or mask.shape[0] != rows or mask.numel() != rows * columns:
        return None
    own = mask.reshape(rows, columns)
    starts = columns - own.sum(dim=1)
    if not torch.equal(own, torch.arange(columns, device=own.device) >= starts[:, None]):
        return None
    return starts


def _sdpa_maybe_by_rows(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kw):
    """transformers' `sdpa` (the same arguments, the mask positional or by name); in the batch's decode step, through
    the C kernel where it applies, else once per row over the row's own columns where `row_starts` says so."""
    sdpa = _SDPA["sdpa"]
    mask, args = (args[0], args[1:]) if args else (kw.pop("attention_mask", None), ())
    latent = latent_attention.take(key, value)
    if latent is not None:
        if not args and _plain(kw) and latent.cheaper(query.shape[2]):
            return latent.attend(query, mask, _scale(query, kw)), None
        key, value = latent.expanded()
    paged = paged_layers.take_markers(key, value)
    if paged is not None:
        out = paged.attend(query, _scale(query, kw)) if not args and _plain(kw) else None
        if out is not None:
            return out.transpose(1, 2), None
        key, value = paged.padded()
    memo = _BY_ROWS.get()
    if memo is None or args or not _plain(kw):
        return sdpa(module, query, key, value, mask, *args, **kw)
    out = _through_kernel(query, key, value, mask, kw.get("scaling"), memo)
    if out is not None:
        return out, None
    starts = row_starts(query, key, mask)
    if starts is None:
        return sdpa(module, query, key, value, mask, **kw)
    outputs = [
        sdpa(module, query[row : row + 1], key[row : row + 1, :, start:], value[row : row + 1, :, start:], None, **kw)
        for row, start in enumerate(starts)
    ]
    return torch.cat([output for output, _ in outputs]), None


def _plain(kw: dict[str, Any]) -> bool:
    """No position bias, attention sinks, soft cap or dropout, which the row-wise paths do not apply."""
    extras = ("position_bias", "s_aux", "sinks", "softcap")
    return all(kw.get(name) is None for name in extras) and not kw.get("dropout")


def _through_kernel(query, key, value, mask, scaling: float | None, memo: dict) -> torch.Tensor | None:
    """The decode step's attention through `decode_attention` ((rows, 1, heads, dim), as transformers' `sdpa`
    returns it), or None where it does not apply. The rows' starts are read from a mask once per forward."""
    if not decode_attention.available() or key.shape[0] * key.shape[2] < MIN_KERNEL_POSITIONS:
        return None
    index = (id(mask), key.shape[0], key.shape[2])
    if index not in memo:
        if len(memo) > 8:  # a by_rows around many forwards (a bench) keeps only the latest masks
            memo.clear()
        memo[index] = (mask, left_padding_starts(query, key, mask))
    starts = memo[index][1]
    if starts is None:
        return None
    out = decode_attention.decode_attention(query, key, value, starts, _scale(query, {"scaling": scaling}))
    return None if out is None else out.transpose(1, 2)


def _scale(query: torch.Tensor, kw: dict[str, Any]) -> float:
    """The attention's scale: the module's `scaling`, else 1 / sqrt(head size) as `sdpa` takes it."""
    scaling = kw.get("scaling")
    return query.shape[-1] ** -0.5 if scaling is None else scaling
