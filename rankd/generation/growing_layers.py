"""The running batch's cache layers grow in place: a decode step writes its token into room kept after the last
position, a join writes its rows into room kept after the last row, and a leave moves only the rows that fill the
gaps; none of them copies the whole cache.

transformers' `DynamicLayer.update` (and `DynamicIndexedLayer.update_indexer`, the sparse-attention indexer's keys)
concatenate: every decode step copies every layer's whole cache to add one position, so a step's cost grows with
the batch's context twice over, once to attend and once to copy. Here each such tensor is a view of a buffer with
room: `ROOM_SHARE` more positions after its last (at least `MIN_ROOM`), `LEFT_ROOM` positions before its first
(a joining prompt longer than the batch's rows widens every row's left padding into it), and `ROOM_SHARE` more
rows (at least `MIN_ROW_ROOM`). A step writes its positions into the room and the layer's tensor becomes the longer
view. 8 rows of the demo model at 2,048 tokens: a decode step 356 ms with concatenation, 248 ms here, one thread
(`bench/bench_growing_cache.py`). A join (`join_rows`) writes its rows after the batch's and zeroes the padding it
adds; a leave (`keep_rows`) moves the last rows into the leaving rows' places (`kept_order`) and narrows the view.
Only when a room is used up is the buffer copied into a larger one.

The buffer is written in place: a view of the batch's cache taken earlier may change at the next step (copy what
you keep). Anything that replaces a layer's tensor by another (transformers' own `crop` or
`batch_select_indices`) leaves a tensor that is not the buffer's view, so the next step copies it into a new buffer
first: the buffer is never written where a tensor it does not own still reads. The views are not contiguous (their
rows are a buffer's length apart), which attention reads as any strided tensor.

Only the batch's own cache grows in place (`BatchState.append`), and only its layers that are not paged
(`paged_layers`: where the CPU decode kernel is built, full attention is paged instead): a prefill is one forward,
a single concatenation.
Sliding-window layers keep their window by their own update, and linear-attention states have no positions: both
are small, and the row operations copy them (`cache_rows`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

ROOM_SHARE = 8
"""A new buffer holds its tensor's positions and rows and 1/ROOM_SHARE more of each: at most that share of memory,
twice over."""
MIN_ROOM = 64
LEFT_ROOM = 64
"""Positions kept before a buffer's first: a joining prompt up to that much longer than the batch's rows fits."""
MIN_ROW_ROOM = 2


def grow_in_place(cache: Any) -> None:
    """Make the full-attention and indexed layers of `cache` (a transformers `DynamicCache`) grow in place."""
    for layer in cache.layers:
        if type(layer).__name__ in _GROWN:
            layer.__class__ = _growing(type(layer))


def layer_kind(layer: Any) -> str:
    """The transformers layer kind `layer` is: its class's name, or the one its growing class extends."""
    return getattr(type(layer), "grows_in_place_of", type(layer).__name__)


def kept_order(rows: int, leave: list[int]) -> list[int]:
    """The batch's rows after the rows `leave` leave, as their indices before: a row stays where it is unless it is
    among the last, which fill the leaving rows' places (in order), so a leave moves at most as many rows as
    leave. Every rank and rank 0's scheduler order the rows by this alone."""
    gone = set(leave)
    survivors = [row for row in range(rows) if row not in gone]
    movers = iter(row for row in survivors if row >= len(survivors))
    return [row if row not in gone else next(movers) for row in range(len(survivors))]


def join_rows(layer: Any, name: str, new: torch.Tensor, columns: int, seq_dim: int) -> bool:
    """Add the rows `new` (left-padded to their own width) after the layer's rows, every row left-padded to
    `columns`, writing only the new rows and the padding it adds; False when `name` is not the layer's buffer's
    view (the caller copies)."""
    left = _placement(layer, name, seq_dim)
    if left is None:
        return False
    current, buffer = getattr(layer, name), layer.__dict__[f"_room_{name}"]
    rows, held, joining = current.shape[0], current.shape[seq_dim], new.shape[0]
    start = left - (columns - held)
    if rows + joining > buffer.shape[0] or start < 0 or start + columns > buffer.shape[seq_dim]:
        buffer, start = _new_buffer(current, rows + joining, columns, seq_dim)
        _right_aligned(buffer.narrow(0, 0, rows).narrow(seq_dim, start, columns), current, seq_dim)
        _remember(layer, name, buffer, start)
    else:
        buffer.narrow(0, 0, rows).narrow(seq_dim, start, columns - held).zero_()
    _right_aligned(buffer.narrow(0, rows, joining).narrow(seq_dim, start, columns), new, seq_dim)
    _set_view(layer, name, rows + joining, start, columns, seq_dim)
    return True


def keep_rows(layer: Any, name: str, order: list[int], columns: int, seq_dim: int) -> bool:
    """Keep the rows `order` (`kept_order`) and the last `columns` positions, moving only the rows that change
    places; False when `name` is not the layer's buffer's view, or `order` moves a row into a place another row
    moves from (the caller copies)."""
    left = _placement(layer, name, seq_dim)
    moved = [(row, source) for row, source in enumerate(order) if row != source]
    if left is None or any(source < len(order) for _, source in moved):  # a source would be overwritten first
        return False
    current = getattr(layer, name)
    for row, source in moved:
        if row != source:
            current.narrow(0, row, 1).copy_(current.narrow(0, source, 1))
    _set_view(layer, name, len(order), left + current.shape[seq_dim] - columns, columns, seq_dim)
    return True


_GROWN = ("DynamicLayer", "DynamicIndexedLayer")
"""The layer kinds whose updates concatenate: keys and values, and the indexer's keys."""


@functools.cache
def _growing(base: type) -> type:
    members: dict[str, Any] = {"grows_in_place_of": base.__name__, "update": _update}
    if base.__name__ == "DynamicIndexedLayer":
        members["update_indexer"] = _update_indexer
    return type(f"Growing{base.__name__}", (base,), members)


def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """`DynamicLayer.update`, writing into the room after the cached positions."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    self.keys = _appended(self, "keys", key_states, 2)
    self.values = _appended(self, "values", value_states, 2)
    return self.keys, self.values


def _update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
    """`DynamicIndexedLayer.update_indexer`, writing into the room after the cached positions."""
    if not self.is_indexer_initialized:
        self.lazy_initialization_indexer(indexer_key_states)
    self.indexer_keys = _appended(self, "indexer_keys", indexer_key_states, 1)
    return self.indexer_keys


def _appended(layer: Any, name: str, new: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """The layer's tensor `name` with `new` after it along `seq_dim`: a view of the layer's buffer for it, written
    in place; a larger buffer when the tensor is not the buffer's view or the room is used up."""
    current = getattr(layer, name)
    held = current.shape[seq_dim] if current.numel() else 0
    left, rows, total = _placement(layer, name, seq_dim), new.shape[0], held + new.shape[seq_dim]
    buffer = layer.__dict__.get(f"_room_{name}")
    if left is None or left + total > buffer.shape[seq_dim]:
        buffer, left = _new_buffer(new, rows, total, seq_dim)
        if held:
            buffer.narrow(0, 0, rows).narrow(seq_dim, left, held).copy_(current)
        _remember(layer, name, buffer, left)
    buffer.narrow(0, 0, rows).narrow(seq_dim, left + held, new.shape[seq_dim]).copy_(new)
    return buffer.narrow(0, 0, rows).narrow(seq_dim, left, total)


def _new_buffer(like: torch.Tensor, rows: int, columns: int, seq_dim: int) -> tuple[torch.Tensor, int]:
    """An empty buffer for `rows` rows of `columns` positions of `like`'s other sizes, with room; where its
    positions start."""
    shape = list(like.shape)
    shape[0] = rows + max(MIN_ROW_ROOM, rows // ROOM_SHARE)
    shape[seq_dim] = LEFT_ROOM + columns + max(MIN_ROOM, columns // ROOM_SHARE)
    return like.new_empty(shape), LEFT_ROOM


def _remember(layer: Any, name: str, buffer: torch.Tensor, left: int) -> None:
    layer.__dict__[f"_room_{name}"], layer.__dict__[f"_left_{name}"] = buffer, left


def _set_view(layer: Any, name: str, rows: int, left: int, columns: int, seq_dim: int) -> None:
    """Make the layer's tensor `name` its buffer's first `rows` rows, `columns` positions from `left`."""
    buffer = layer.__dict__[f"_room_{name}"]
    setattr(layer, name, buffer.narrow(0, 0, rows).narrow(seq_dim, left, columns))
    layer.__dict__[f"_left_{name}"] = left


def _right_aligned(target: torch.Tensor, rows: torch.Tensor, seq_dim: int) -> None:
    """Write `rows` at the end of `target` along `seq_dim` and zeros before them (left padding: finite, as
    attention's masked columns must be)."""
    pad = target.shape[seq_dim] - rows.shape[seq_dim]
    target.narrow(seq_dim, 0, pad).zero_()
    target.narrow(seq_dim, pad, rows.shape[seq_dim]).copy_(rows)


def _placement(layer: Any, name: str, seq_dim: int) -> int | None:
    """Where the layer's tensor `name` starts among its buffer's positions, when it is the view `_set_view` or
    `_appended` made (its first rows); None when something else replaced it, or it is empty (a layer just
    initialised: a new buffer, never one an earlier view may still read)."""
    tensor, buffer = getattr(layer, name, None), layer.__dict__.get(f"_room_{name}")
    if buffer is None or tensor is None or tensor.numel() == 0 or tensor.dim() != buffer.dim():
        return None
    left = layer.__dict__[f"_left_{name}"]
    fits = all(
        size <= room if dim in (0, seq_dim) else size == room
        for dim, (size, room) in enumerate(zip(tensor.shape, buffer.shape))
    )
    placed = (
        fits
        and left + tensor.shape[seq_dim] <= buffer.shape[seq_dim]
        and tensor.stride() == buffer.stride()
        and tensor.data_ptr() == buffer.narrow(seq_dim, left, 1).data_ptr()
    )
    return left if placed else None
