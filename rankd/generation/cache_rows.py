"""The continuous batch's cache row by row: which transformers cache layers it can hold, and their row operations.

A batch cache is one transformers `DynamicCache` whose rows are left-padded to the longest row. Each layer kind
that can batch is listed in `_FIELDS` with the tensors it grows, each with its row dim and its sequence dim (or
in `_STATES`, for states without positions); the batch selects rows (a row leaves), appends rows (a prefill
joins) and pads columns on the left through those tables alone, so a new layer kind is one entry there.

* `DynamicLayer`: full attention's keys and values (MLA's compressed latents are stored the same way).
* `DynamicSlidingWindowLayer` (gpt-oss, Mistral): the last window - 1 positions. Every row ends at the batch's
  last column, so the window's columns are each row's own last positions and a row's padding never takes part
  of its window; the layer's position count is the batch's column count, the width of the mask.
* `LinearAttentionLayer` (Qwen3-Next's Gated DeltaNet): a convolution state and a recurrent state per row, with
  no positions, so a join appends rows and a leave selects them, nothing to pad. A left-padded prefill leaves
  them as the row alone would: the layer zeroes the inputs at padded positions, and from zero inputs its
  convolution sees the zeros a causal convolution pads with and its recurrent state stays zero.
* `DynamicIndexedLayer` (GLM-5's `glm_moe_dsa`, `deepseek_v32`): also the indexer's key cache, one key per
  position like a KV cache. A left-pad position can never be attended through the indexer's top-k: the indexer
  adds the batch's attention mask (padding included) to its scores before its top-k, so a pad ranks below every
  real position, and is picked only when a row has fewer real positions than top-k; the attention after it keeps
  the mask, so a pad that is picked stays masked. Each row's selection is therefore the one it makes alone
  (but for scores that tie exactly, which `topk` orders its own way).
"""

from __future__ import annotations

from typing import Any

import torch

from shardbook.rankd.generation.growing_layers import join_rows, keep_rows, layer_kind
from shardbook.rankd.generation.paged_layers import append_paged_rows, block_table, is_paged
from shardbook.rankd.generation.paged_layers import row_positions as paged_row_positions

_FULL = (("keys", 0, 2), ("values", 0, 2))
_FIELDS: dict[str, tuple[tuple[str, int, int], ...]] = {
    "DynamicLayer": _FULL,
    "DynamicSlidingWindowLayer": _FULL,
    "DynamicIndexedLayer": (*_FULL, ("indexer_keys", 0, 1), ("indexer_position_ids", 1, 2)),
}
"""Per batchable layer kind: (attribute, row dim, sequence dim) of each tensor it grows per position."""
_STATES: dict[str, tuple[str, ...]] = {"LinearAttentionLayer": ("conv_states", "recurrent_states")}
"""Per batchable layer kind whose state has no positions: its attributes, each a dict of (rows, ...) tensors."""


def layer_refusal(cache: Any) -> str | None:
    """Why `cache` cannot be the batch's (a layer kind with no row operations here), or None when it can."""
    kinds = sorted({layer_kind(layer) for layer in cache.layers if layer_kind(layer) not in _FIELDS | _STATES})
    if not kinds:
        return None
    return (
        "continuous batching needs a full-attention cache on every layer (plain, with a sparse-attention indexer, "
        f"or within a sliding window); this model has {', '.join(kinds)} layers"
    )


def config_refusal(config: Any) -> str | None:
    """Why a model of `config` cannot batch though its cache layers can (chunked attention), or None."""
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        return (
            "continuous batching cannot hold chunked attention (Llama 4): its chunks are counted by column, and a "
            "left-padded row's columns are not its positions"
        )
    return None


def check_batchable(cache: Any) -> None:
    """Raise NotImplementedError with `layer_refusal`'s reason when `cache` cannot be the batch's."""
    refusal = layer_refusal(cache)
    if refusal is not None:
        raise NotImplementedError(refusal)


def select_rows(cache: Any, order: list[int], columns: int) -> None:
    """Keep the rows `order` of `cache` (`growing_layers.kept_order`: each new row's index before), and only its
    last `columns` columns (the others are padding in every row). A tensor that grows in place moves only the rows
    that change places; the others are copied. Paged layers (`paged_layers`) give the leaving rows' blocks back."""
    index = torch.tensor(order, device=_device(cache))
    table = block_table(cache)
    if table is not None:
        table.keep(order)
    for layer in cache.layers:
        if is_paged(layer):
            continue
        kept = _kept(layer, columns)
        for name, row_dim, seq_dim in position_fields(layer):
            if row_dim == 0 and keep_rows(layer, name, order, kept, seq_dim):
                continue
            rows = getattr(layer, name).index_select(row_dim, index)
            setattr(layer, name, rows.narrow(seq_dim, rows.shape[seq_dim] - kept, kept))
        for states, _ in _states(layer, layer):
            for i, state in states.items():
                states[i] = None if state is None else state.index_select(0, index)
        set_length(layer, columns)


def append_rows(
    cache: Any, other: Any, columns: int, lengths: list[int] | None = None, shared: list[list[int]] | None = None
) -> None:
    """Append the rows of `other` (a prefill of the same model, its rows holding `lengths` positions) to `cache`,
    both left-padded to `columns`. A tensor that grows in place takes the new rows into its room, paged layers
    write them into new blocks (after each row's `shared` ones); the others are copied."""
    if block_table(cache) is not None:
        assert lengths is not None, "a paged cache's new rows need their lengths"
        append_paged_rows(cache, other, lengths, shared)
    for mine, theirs in zip(cache.layers, other.layers):
        if is_paged(mine):
            continue
        kept = _kept(mine, columns)
        for name, row_dim, seq_dim in position_fields(mine):
            new = getattr(theirs, name)
            if row_dim == 0 and join_rows(mine, name, new, kept, seq_dim):
                continue
            ours, new = (_pad_left(tensor, kept, seq_dim) for tensor in (getattr(mine, name), new))
            setattr(mine, name, torch.cat([ours, new], row_dim))
        for states, joining in _states(mine, theirs):
            for i, state in states.items():
                states[i] = None if state is None else torch.cat([state, joining[i]])
        set_length(mine, columns)


def _device(cache: Any) -> torch.device:
    """Where `cache`'s tensors are (its first held field's device)."""
    for layer in cache.layers:
        if is_paged(layer):
            return layer.key_pool.device
        for name, _, _ in position_fields(layer):
            return getattr(layer, name).device
        for states, _ in _states(layer, layer):
            for state in states.values():
                if state is not None:
                    return state.device
    return torch.device("cpu")


def _states(mine: Any, theirs: Any) -> list[tuple[dict, dict]]:
    """Each positionless state dict of `mine` with the same dict of `theirs` (entries not set yet are None)."""
    return [(getattr(mine, name), getattr(theirs, name)) for name in _STATES.get(layer_kind(mine), ())]


def row_states(layer: Any, row: int, copy: bool = True) -> dict[str, dict[int, torch.Tensor]]:
    """The positionless states of the batch's `row` in `layer`, those set (each one row; copies unless `copy` is
    False)."""
    held = {}
    for name in _STATES.get(layer_kind(layer), ()):
        rows = {i: state[row : row + 1] for i, state in getattr(layer, name).items() if state is not None}
        held[name] = {i: state.clone() for i, state in rows.items()} if copy else rows
    return held


def set_states(layer: Any, states: dict[str, dict[int, torch.Tensor]]) -> None:
    """Give an empty linear-attention `layer` the one-row `states` (`row_states`' copies), as a prefill of the row's
    tokens leaves them: the next forward continues from them. They are copied in: forwards update them in place."""
    for i, conv in states.get("conv_states", {}).items():
        layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=conv.shape[-1])
        layer.conv_states[i].copy_(conv)
        layer.has_previous_state[i] = True
    for i, recurrent in states.get("recurrent_states", {}).items():
        layer.lazy_initialization(recurrent_states=recurrent, state_idx=i)
        layer.recurrent_states[i].copy_(recurrent)


def _kept(layer: Any, columns: int) -> int:
    """How many of the batch's last `columns` positions `layer` holds: a sliding window's last window - 1."""
    window = getattr(layer, "sliding_window", None)
    return columns if window is None else min(columns, window - 1)


def set_length(layer: Any, columns: int) -> None:
    """Sliding-window and linear-attention layers count the positions seen, padding included: the mask's width
    (a plain layer counts the positions it holds)."""
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = columns
    if hasattr(layer, "cumulative_length_linear"):
        layer.cumulative_length_linear.fill_(columns)


def position_fields(layer: Any) -> list[tuple[str, int, int]]:
    """The layer's grown tensors that it holds, as (attribute, row dim, sequence dim) (an indexer layer that shares
    another's top-k keeps no keys; a paged layer's are read through `row_positions`)."""
    if is_paged(layer):
        return [field for field in grown_fields(layer) if field[0] in layer.paged_names]
    return [field for field in grown_fields(layer) if getattr(layer, field[0], None) is not None]


def row_positions(layer: Any, name: str, row_dim: int, row: int) -> torch.Tensor:
    """The batch's `row` of the layer's tensor `name` (its row dim taken out), whose last positions are the row's
    own: left-padded to the batch's columns, or (a paged layer) the row's own positions alone, copied."""
    if is_paged(layer):
        return paged_row_positions(layer, name, row)
    return getattr(layer, name).select(row_dim, row)


def grown_fields(layer: Any) -> tuple[tuple[str, int, int], ...]:
    """Every tensor a layer of `layer`'s kind may grow per position, held yet or not."""
    return _FIELDS.get(layer_kind(layer), ())


def _pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`tensor` with zero positions before its sequence (along `dim`), up to `length` positions."""
    if tensor.shape[dim] == length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length - tensor.shape[dim]
    return torch.cat([tensor.new_zeros(shape), tensor], dim)
