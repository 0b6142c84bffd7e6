"""The running batch's cache layers grow in place: a decode step writes its token into room kept after the last
position instead of copying the whole cache.

transformers' `DynamicLayer.update` (and `DynamicIndexedLayer.update_indexer`, the sparse-attention indexer's keys)
concatenate: every decode step copies every layer's whole cache to add one position, so a step's cost grows with
the batch's context twice over, once to attend and once to copy. Here each such tensor lives at the start of a
buffer with room for `ROOM_SHARE` more positions (at least `MIN_ROOM`); a step writes its positions into the room and
the layer's tensor becomes the longer view of the buffer. Only when the room is used up is the buffer copied into a
larger one. 8 rows of the demo model at 2,048 tokens: a decode step 356 ms with concatenation, 248 ms here, one
thread (`bench/bench_growing_cache.py`).

Everything that replaces a layer's tensor (the batch's row operations in `cache_rows.py`, transformers' own
`crop` or `batch_select_indices`) leaves a tensor that is not the start of the buffer, so the next step copies it
into a new buffer first: the buffer is never written where another tensor still reads. The views are not
contiguous (their rows are a buffer's length apart), which attention reads as any strided tensor.

Only the batch's own cache grows in place (`BatchState.append`): a prefill is one forward, a single concatenation.
Sliding-window layers keep their window by their own update, and linear-attention states have no positions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

ROOM_SHARE = 8
"""A new buffer holds its tensor's positions and 1/ROOM_SHARE more: the room costs at most that share of memory."""
MIN_ROOM = 64


def grow_in_place(cache: Any) -> None:
    """Make the full-attention and indexed layers of `cache` (a transformers `DynamicCache`) grow in place."""
    for layer in cache.layers:
        if type(layer).__name__ in _GROWN:
            layer.__class__ = _growing(type(layer))


def layer_kind(layer: Any) -> str:
    """The transformers layer kind `layer` is: its class's name, or the one its growing class extends."""
    return getattr(type(layer), "grows_in_place_of", type(layer).__name__)


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
    self.keys = _appended(self, "keys", key_states, -2)
    self.values = _appended(self, "values", value_states, -2)
    return self.keys, self.values


def _update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
    """`DynamicIndexedLayer.update_indexer`, writing into the room after the cached positions."""
    if not self.is_indexer_initialized:
        self.lazy_initialization_indexer(indexer_key_states)
    self.indexer_keys = _appended(self, "indexer_keys", indexer_key_states, 1)
    return self.indexer_keys


def _appended(layer: Any, name: str, new: torch.Tensor, dim: int) -> torch.Tensor:
    """The layer's tensor `name` with `new` after it along `dim`: a view of the layer's buffer for it, written in
    place; a larger buffer when the tensor is not the buffer's start or the room is used up."""
    current, buffer = getattr(layer, name), layer.__dict__.get(f"_room_{name}")
    held = current.shape[dim] if current.numel() else 0
    total = held + new.shape[dim]
    if buffer is None or not _starts(current, buffer, dim) or total > buffer.shape[dim]:
        shape = list(new.shape)
        shape[dim] = total + max(MIN_ROOM, total // ROOM_SHARE)
        buffer = new.new_empty(shape)
        if held:
            buffer.narrow(dim, 0, held).copy_(current)
        layer.__dict__[f"_room_{name}"] = buffer
    buffer.narrow(dim, held, new.shape[dim]).copy_(new)
    return buffer.narrow(dim, 0, total)


def _starts(tensor: torch.Tensor, buffer: torch.Tensor, dim: int) -> bool:
    """Whether `tensor` is the buffer's first positions along `dim` (a view of it, as `_appended` returns)."""
    if tensor.numel() == 0:  # a layer just initialised: a new buffer, never one an earlier view may still read
        return False
    same_shape = all(a == b for i, (a, b) in enumerate(zip(tensor.shape, buffer.shape)) if i != dim % buffer.dim())
    return (
        tensor.dim() == buffer.dim()
        and same_shape
        and tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
    )
