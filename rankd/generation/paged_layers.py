"""The running batch's full-attention layers in blocks: each row's keys and values take blocks of `PAGE_TOKENS`
positions from a pool, so a row's memory follows its own length, and joins and leaves move no cache data.

The left-padded layout (`growing_layers`) gives every row the longest row's columns: one 8,000-token prompt among
short chat turns makes every row hold 8,000 positions, and a leave moves rows. Here each layer keeps two pools,
(blocks, kv heads, `PAGE_TOKENS`, head size) for keys and for values (the model's `block_pool.BlockPool`, which
outlives the batch), and one :class:`BlockTable` shared by the cache's layers (a position is in the same block on
every layer) says which blocks hold each row's positions, in order. A decode step takes a new block for a row
whose last block is full (`begin_step`) and every layer writes its new key and value at the row's next position; a
join writes only the new rows' positions into blocks taken for them; a leave gives its blocks back. A prompt that
starts with blocks the prefix store keeps takes those blocks as its row's first ones (held, not copied) and writes
only the positions after them. Only when the pools are used up are they copied into larger ones (1/8 more, as the
growing buffers are).

Attention reads the blocks through the C kernel (`decode_attention.paged_decode_attention`): a layer's `update`
returns stand-ins for the padded keys and values (`Marker`s, empty tensors of the padded shape) that the batch's
`sdpa` entry (`row_attention`) recognises and attends through the block table instead. A call the kernel does not
take (attention sinks, a soft cap, a head size it does not take) gets the padded keys gathered from the blocks for
that call. MLA (DeepSeek-V3, Kimi-K2) caches its compressed latents and expands them into keys and values after
the cache, so its attention never sees the cache's tensors: its layers hand the expansion the rows' latents
gathered, left-padded (a copy of the latents each step, small beside the expansion that follows it), and its memory
still follows each row's length. A sparse-attention indexer's keys (GLM-5, DeepSeek-V3.2) take a third pool of the
same blocks, and `update_indexer` hands the indexer every row's keys gathered alike (zeros where the left-padded
layout has pads: the indexer adds the mask before its top-k, so neither is ever picked over a real position). A
forward that does not pass the stand-ins to attention unchanged fails its step with a clear error rather than
attending to them (`markers_expected`).

The batch pages a model only where this pays and holds (`paged_refusal`): on a CPU with the kernel built, under
transformers' `sdpa`, with full attention (or MLA's latents, stored alike) on every layer that holds positions
(linear-attention states, which hold none, beside them: Qwen3-Next), with or without an indexer. Sliding windows
stay in the growing layout. A paged layer has no `keys` or `values` tensor: rows are read with
`row_positions`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from shardbook.rankd.generation import decode_attention
from shardbook.rankd.generation.block_pool import HEADLESS, PAGE_TOKENS, BlockPool, pool_layout
from shardbook.rankd.generation.growing_layers import layer_kind
from shardbook.rankd.generation.stand_ins import StandIns, stand_in

SWITCH = "SHARDBOOK_PAGED_CACHE"
_POSITIONED = ("DynamicLayer", "DynamicIndexedLayer")
"""Cache layer kinds a paged cache holds in blocks: full attention, with or without a sparse-attention indexer."""
_PAGED_KINDS = {*_POSITIONED, "LinearAttentionLayer"}
"""Cache layer kinds a paged cache may hold: those in blocks and states without positions (kept as they are)."""


class BlockTable:
    """Which pool blocks hold each row's positions: shared by every paged layer of one batch cache."""

    def __init__(self, pool: BlockPool | None = None) -> None:
        self.pool = BlockPool() if pool is None else pool
        self.blocks: list[list[int]] = []
        """Per row, its blocks in order (each held once by the row)."""
        self.lengths = torch.zeros(0, dtype=torch.int64)
        """Per row, the positions it holds."""
        self.width = 0
        """The batch's columns (its longest row) before a step: what its layers report as their length."""
        self.write_at: tuple[torch.Tensor, torch.Tensor] | None = None
        """The step's new position per row, as (block, offset within it), set by `begin_step`."""
        self._table: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.blocks)

    @property
    def table(self) -> torch.Tensor:
        """(rows, most blocks of a row) int64: row b's blocks in order, then 0 (never read: past its length)."""
        if self._table is None:
            widest = max((len(blocks) for blocks in self.blocks), default=0)
            rows = [blocks + [0] * (widest - len(blocks)) for blocks in self.blocks]
            self._table = torch.tensor(rows, dtype=torch.int64).view(self.rows, widest)
        return self._table

    def add_rows(self, lengths: list[int], shared: list[list[int]] | None = None) -> list[list[int]]:
        """Take blocks for new rows of `lengths` positions, after the others; each new row's blocks. A row's
        `shared` blocks (already held for it: kept blocks its prompt starts with) are its first ones."""
        shared = shared or [[] for _ in lengths]
        new = [own + self.pool.take(-(-length // PAGE_TOKENS) - len(own)) for length, own in zip(lengths, shared)]
        self.blocks += new
        self.lengths = torch.cat([self.lengths, torch.tensor(lengths, dtype=torch.int64)])
        self.width = max(self.width, *lengths)
        self._table = None
        return new

    def keep(self, order: list[int]) -> None:
        """Keep the rows `order` (each new row's index before, `growing_layers.kept_order`); the others give their
        blocks back."""
        kept = set(order)
        for row, blocks in enumerate(self.blocks):
            if row not in kept:
                self.pool.release(blocks)
        self.blocks = [self.blocks[row] for row in order]
        self.lengths = self.lengths[torch.tensor(order, dtype=torch.int64)]
        self.width = int(self.lengths.max()) if order else 0
        self._table = None

    def begin_step(self) -> None:
        """Before a decode step: a new block for each row whose blocks are full, and the position each row writes
        (`write_at`); every row then holds one position more."""
        lengths = self.lengths.tolist()
        for row, length in enumerate(lengths):
            if length % PAGE_TOKENS == 0:
                self.blocks[row] += self.pool.take(1)
                self._table = None
        block = torch.tensor([self.blocks[row][length // PAGE_TOKENS] for row, length in enumerate(lengths)])
        self.write_at = block, self.lengths % PAGE_TOKENS
        self.lengths = self.lengths + 1

    def end_step(self) -> None:
        """After a decode step's forward: the batch is one column wider."""
        self.width += 1
        self.write_at = None


def paged_refusal(model: Any, device: torch.device) -> str | None:
    """Why the batch keeps `model`'s cache left-padded rather than in blocks, or None when it pages it."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    if device.type != "cpu":
        return f"the paged cache's attention is a CPU kernel; the model is on {device.type}"
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return "the paged cache attends through the sdpa attention entry; the model uses another"
    kinds = _cache_kinds(model)
    if not kinds & set(_POSITIONED) or not kinds <= _PAGED_KINDS:
        return f"the model's cache has {', '.join(sorted(kinds - _PAGED_KINDS))} layers, which are not paged"
    if not decode_attention.available():
        return "the decode-attention kernel is not built here (no C compiler)"
    return None


def page(
    cache: Any, lengths: list[int], model: Any, pool: BlockPool, shared: list[list[int]] | None = None
) -> BlockTable:
    """Make the full-attention layers of `cache` (a left-padded prefill of `model`, its rows holding `lengths`
    positions) paged in `pool`, their positions written into blocks of one new block table (after each row's
    `shared` blocks, which hold its first positions already)."""
    table, stand_ins = BlockTable(pool), attends_to_cached_tensors(model)
    blocks = table.add_rows(lengths, shared)
    for index, layer in enumerate(cache.layers):
        if layer_kind(layer) in _POSITIONED:
            sources = _positions(layer)
            for name in ("keys", "values", "indexer_keys", "indexer_position_ids"):
                layer.__dict__.pop(name, None)
            layer.__class__ = _paged(type(layer))
            layer.block_table, layer.pool_index, layer.stand_ins = table, index, stand_ins
            layer.paged_names = tuple(sources)
            layer.write_rows(sources, lengths, blocks, shared)
    return table


def _positions(layer: Any) -> dict[str, torch.Tensor]:
    """The tensors a left-padded full-attention `layer` holds per position, by name: keys and values, and an
    indexer's keys where it keeps them (a layer reusing another's top-k keeps none)."""
    held = {"keys": layer.keys, "values": layer.values}
    if getattr(layer, "indexer_position_ids", None) is not None:
        raise NotImplementedError(
            f"the paged cache holds no indexer positions (this model keeps them); set {SWITCH}=0 to batch it "
            "left-padded"
        )
    indexer = getattr(layer, "indexer_keys", None)
    if indexer is not None and indexer.numel():
        held["indexer_keys"] = indexer
    return held


def attends_to_cached_tensors(model: Any) -> bool:
    """Whether `model`'s attention takes the keys and values its cache returns as they are (not MLA, which expands
    its cached latents first)."""
    return getattr(model.config, "kv_lora_rank", None) is None


def block_table(cache: Any) -> BlockTable | None:
    """The block table of `cache` when its layers are paged."""
    for layer in cache.layers:
        if is_paged(layer):
            return layer.block_table
    return None


def is_paged(layer: Any) -> bool:
    return "block_table" in layer.__dict__


def append_paged_rows(cache: Any, other: Any, lengths: list[int], shared: list[list[int]] | None = None) -> None:
    """Add the rows of `other` (a left-padded prefill of the same model, its rows holding `lengths` positions) to
    the paged layers of `cache`, after its rows: blocks taken for them (after each row's `shared` ones), their
    positions written there."""
    table = block_table(cache)
    blocks = table.add_rows(lengths, shared)
    for mine, theirs in zip(cache.layers, other.layers):
        if is_paged(mine):
            mine.write_rows(_positions(theirs), lengths, blocks, shared)


def row_positions(layer: Any, name: str, row: int) -> torch.Tensor:
    """A paged layer's `row`'s own positions of `name` (one of its `paged_names`), as one row of the left-padded
    layout holds them but no padding: (kv heads, its length, head size), an indexer's keys (its length, size). A
    copy."""
    pool = layer.pool(name)
    table = layer.block_table
    length, blocks = int(table.lengths[row]), table.blocks[row]
    held = pool[torch.tensor(blocks, dtype=torch.int64)].transpose(0, 1)  # (kv heads, blocks, block, size)
    held = held.reshape(pool.shape[1], len(blocks) * PAGE_TOKENS, pool.shape[3])[:, :length]
    return held[0] if name in HEADLESS else held


MARKERS = StandIns("shardbook_paged_markers")
"""The stand-ins paged layers hand attention (inside `markers_expected`), taken back by `take_markers`."""
_LATENT_MARKERS: ContextVar[bool] = ContextVar("shardbook_paged_latent_markers", default=False)
"""Inside `latents_as_markers`: MLA's paged layers hand stand-ins too (their reader is `latent_attention`)."""


@contextlib.contextmanager
def latents_as_markers() -> Iterator[None]:
    """The forwards inside read MLA's latents from the blocks themselves (`latent_attention`), so MLA's paged layers
    hand stand-ins like the others rather than their latents gathered."""
    token = _LATENT_MARKERS.set(True)
    try:
        yield
    finally:
        _LATENT_MARKERS.reset(token)


def markers_expected() -> contextlib.AbstractContextManager:
    """The forwards inside hand attention stand-ins for a paged layer's keys and values (`take_markers` reads
    them); raise at the end if one was not taken, which means the model changed its keys on the way (its
    attention read an empty stand-in, so the step's output is not to be used)."""
    return MARKERS.expected(
        "the batch's paged cache handed this model's attention stand-ins for its keys and values, and the model "
        "changed them before attending, so their blocks could not be read: this model cannot decode from the "
        f"paged cache; set {SWITCH}=0 in the kernel's environment to keep its cache left-padded"
    )


def take_markers(key: torch.Tensor, value: torch.Tensor) -> Any:
    """The paged layer whose stand-ins `key` and `value` are (they are taken), or None when they are tensors."""
    return MARKERS.take(key, value)


@functools.cache
def _paged(base: type) -> type:
    kind = getattr(base, "grows_in_place_of", base.__name__)
    members = {
        "grows_in_place_of": kind,
        "pool": lambda self, name: self.block_table.pool.pools[name][self.pool_index],
        "key_pool": property(lambda self: self.pool("keys")),
        "value_pool": property(lambda self: self.pool("values")),
        "keys": property(_no_padded_tensor),
        "values": property(_no_padded_tensor),
        "update": _update,
        "get_seq_length": lambda self: self.block_table.width,
        "write_rows": _write_rows,
        "write_step": _write_step,
        "gathered": _gathered,
        "padded": lambda self: (self.gathered("keys"), self.gathered("values")),
        "own_rows": _own_rows,
        "at_columns": _at_columns,
        "attend": _attend,
    }
    if kind == "DynamicIndexedLayer":
        members |= {
            "indexer_keys": property(_no_padded_tensor),
            "indexer_position_ids": None,
            "update_indexer": _update_indexer,
        }
    return type(f"Paged{base.__name__}", (base,), members)


def _no_padded_tensor(self) -> torch.Tensor:
    raise RuntimeError(
        "the batch's paged cache holds no left-padded keys or values; read a row with paged_layers.row_positions"
    )


def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """A decode step's keys and values (one position per row) written at each row's next position
    (`BlockTable.begin_step`); stand-ins for the padded keys and values inside `markers_expected` where the model
    attends to them as they are, else those, gathered."""
    table = self.block_table
    if key_states.shape[2] != 1:
        raise RuntimeError("a paged batch cache takes only the batch's decode steps (one position per row)")
    self.write_step("keys", key_states)
    self.write_step("values", value_states)
    stand_ins = self.stand_ins or _LATENT_MARKERS.get()
    if not MARKERS.active() or not stand_ins or torch.compiler.is_compiling():  # a traced stand-in is not this one
        return self.padded()
    return MARKERS.hand(*(_marker(pool, table) for pool in (self.key_pool, self.value_pool)), self)


def _write_step(self, name: str, states: torch.Tensor) -> None:
    """Write a decode step's `states` of `name` (one position per row, as the left-padded layout holds it) at each
    row's next position (`BlockTable.begin_step`)."""
    table = self.block_table
    if table.write_at is None or states.shape[0] != table.rows:
        raise RuntimeError("a paged batch cache takes only the batch's decode steps (one position per row)")
    table.pool.fit(self.pool_index, {name: states})
    block, offset = table.write_at
    self.pool(name)[block, :, offset] = pool_layout(name, states)[:, :, 0]


def _update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
    """`DynamicIndexedLayer.update_indexer` for a decode step: its keys (rows, 1, size) written at each row's next
    position; every row's indexer keys returned left-padded (zeros before a row's positions: the indexer adds the
    mask before its top-k, so they rank below every real position, as the left-padded layout's pads do)."""
    self.write_step("indexer_keys", indexer_key_states)
    return self.gathered("indexer_keys")[:, 0]


def _marker(pool: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """An empty tensor of the padded shape (rows, kv heads, columns, head size) that owns no memory."""
    return stand_in(pool, table.rows, pool.shape[1], int(table.lengths.max()), pool.shape[3])


def _attend(self, query: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The decode step's attention over each row's blocks, (rows, heads, 1, value size); None where the kernel
    does not take it."""
    table = self.block_table
    return decode_attention.paged_decode_attention(
        query, self.key_pool, self.value_pool, table.table, table.lengths, scale
    )


def _own_rows(self, name: str) -> list[torch.Tensor]:
    """Each row's own positions of `name`, unpadded: (positions, size) per row (a headless or one-head pool)."""
    table, pool = self.block_table, self.pool(name)
    rows = []
    for blocks, length in zip(table.blocks, table.lengths.tolist()):
        held = pool.index_select(0, torch.tensor(blocks, dtype=torch.int64))  # (blocks, 1, PAGE_TOKENS, size)
        rows.append(held.view(-1, pool.shape[-1])[:length])
    return rows


def _gathered(self, name: str) -> torch.Tensor:
    """The rows' tensors `name` left-padded to the longest row (zeros before a row's positions), gathered: (rows,
    heads, columns, size). Only the rows' own positions are read and written, as vectors of the pool's memory
    (laid out head by head, `empty_pool`): one row of 2,048 among 31 of 128, 0.6 ms where indexing the blocks and
    offsets of every column and zeroing the padding took 17."""
    table, pool = self.block_table, self.pool(name)
    blocks_count, heads, _, size = pool.shape
    columns = int(table.lengths.max())
    own = torch.arange(columns)[None, :] - (columns - table.lengths)[:, None]  # each column's own position
    rows, cols = (own >= 0).nonzero(as_tuple=True)
    per_head = torch.arange(heads)[:, None]
    sources = _column_places(table, rows, cols)[None, :] + per_head * (blocks_count * PAGE_TOKENS)
    places = (rows[None, :] * heads + per_head) * columns + cols[None, :]  # (heads, positions held)
    out = pool.new_zeros(table.rows * heads * columns, size)
    out.index_copy_(0, places.view(-1), _memory(pool).index_select(0, sources.view(-1)))
    return out.view(table.rows, heads, columns, size)


def _at_columns(self, name: str, columns: torch.Tensor) -> torch.Tensor:
    """The tensors `name` of a one-head pool (MLA's latents) at each row's padded `columns` (rows, picks), as the
    left-padded layout numbers them: (rows, picks, size); a pad's column reads its row's first position."""
    pool = self.pool(name)
    assert pool.shape[1] == 1, "columns are read from a one-head pool"
    places = _column_places(self.block_table, torch.arange(self.block_table.rows)[:, None], columns)
    return _memory(pool).index_select(0, places.view(-1)).view(*places.shape, pool.shape[-1])


def _column_places(table: BlockTable, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Where each (row, padded column) is in a pool's memory for its first head, in vectors of the pool's size
    (`_memory`); `rows` and `columns` broadcast, and a column of a row's padding maps to its first position."""
    own = (columns - (int(table.lengths.max()) - table.lengths)[rows]).clamp(min=0)
    return table.table[rows, own // PAGE_TOKENS] * PAGE_TOKENS + own % PAGE_TOKENS


def _memory(pool: torch.Tensor) -> torch.Tensor:
    """A pool's own memory as (heads x blocks x PAGE_TOKENS, size) vectors, head by head (`empty_pool`)."""
    assert pool.transpose(0, 1).is_contiguous(), "a pool not laid out head by head"
    return pool.transpose(0, 1).view(-1, pool.shape[-1])


def _write_rows(
    self,
    sources: dict[str, torch.Tensor],
    lengths: list[int],
    blocks: list[list[int]],
    shared: list[list[int]] | None = None,
):
    """Write the rows of left-padded `sources` (by name, as `_positions` gives them), holding `lengths` positions,
    into their `blocks` (the table's newest rows), but a row's first positions that its `shared` blocks hold."""
    self.block_table.pool.fit(self.pool_index, sources)
    skips = [len(own) for own in shared] if shared else [0] * len(lengths)
    for name, source in sources.items():
        pool, source = self.pool(name), pool_layout(name, source)
        for row, (length, taken, skip) in enumerate(zip(lengths, blocks, skips)):
            own = source[row, :, source.shape[2] - length + skip * PAGE_TOKENS :]
            length, taken = length - skip * PAGE_TOKENS, taken[skip:]
            whole = length // PAGE_TOKENS
            if whole:
                parts = own[:, : whole * PAGE_TOKENS].reshape(own.shape[0], whole, PAGE_TOKENS, own.shape[2])
                pool.index_copy_(0, torch.tensor(taken[:whole]), parts.transpose(0, 1))
            if length % PAGE_TOKENS:
                pool[taken[whole], :, : length % PAGE_TOKENS] = own[:, whole * PAGE_TOKENS :]


def _cache_kinds(model: Any) -> set[str]:
    if model not in _KINDS:
        from transformers import DynamicCache

        _KINDS[model] = {layer_kind(layer) for layer in DynamicCache(config=model.config).layers}
    return _KINDS[model]


_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
