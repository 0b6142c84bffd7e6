"""Prefix reuse: the keys and values of token blocks the batch computed before, kept on every rank for the next
prompt that starts with them (a conversation's next turn, a shared system prompt or document).

A prompt is cut into blocks of `BLOCK_TOKENS` tokens; block i's key hashes block i's tokens with block i-1's key
(a chain, as vLLM's prefix caching keys its blocks), so one key names a whole prefix. Each rank's
:class:`PrefixStore` (one per model) maps a key to every layer's per-position tensors for that block (keys and
values; a sparse-attention indexer's keys too), one row and no padding (under `tp`, this rank's own heads: nothing
crosses ranks). Where the batch's cache is paged (`paged_layers`), a kept block is not a copy but the pool block
itself (`block_pool`: the store owns the model's pool and holds the blocks it keeps): a leaving row's blocks are
held, not copied, and a prompt that starts with them takes them as its row's first blocks. Only layers that hold
every position of a prompt can be kept: full attention, MLA's latents and GLM-5's and DeepSeek-V3.2's indexed
layers. Each position's entries there depend on it and the tokens before it alone, so kept blocks equal what a cold
prefill computes.

A sliding window (gpt-oss) or a linear-attention state (Qwen3-Next) cannot be cut into blocks: the window holds only
a sequence's last positions and the state none, so neither can be rebuilt at an earlier length. A model with such
layers keeps *end states* instead (`reuse_kind`): when a sequence leaves, a copy of its whole cache row as it is
(every layer's positions it holds, its states), named by its exact tokens. A prompt that continues those tokens (a
conversation's next turn: the history the row holds, then the new message) starts from that copy; prompts that
share only a beginning (a system prompt) share nothing. An end state costs the blocks its bytes would fill.

The ranks never decide anything on their own: rank 0 looks a joining prompt up in its own store when it plans a
step and the plan carries what every rank does (the blocks a chunk's one-row cache is seeded from, the leaving
rows' blocks to keep, the store's size in blocks). Every rank applies the same plans in the same order, so every
store holds the same keys in the same least-recently-used order. A block is touched when it seeds a prompt or is
kept again, a chain from its end to its start, so a prefix's first blocks outlive its last ones; blocks beyond the
size are evicted least recently used first, at the end of the step (after this step's seeds).
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from shardbook.rankd.generation.block_pool import PAGE_TOKENS, BlockPool
from shardbook.rankd.generation.cache_rows import (
    grown_fields,
    layer_refusal,
    position_fields,
    row_positions,
    row_states,
    set_length,
    set_states,
)
from shardbook.rankd.generation.growing_layers import layer_kind
from shardbook.rankd.generation.paged_layers import block_table

logger = logging.getLogger(__name__)

BLOCK_TOKENS = PAGE_TOKENS
"""Tokens per block: a prompt reuses the longest run of whole blocks it shares with a kept one (a kept block is a
pool block, shared by the paged rows that start with it)."""


def block_keys(tokens: list[int]) -> list[int]:
    """The chain key of each whole block of `tokens` (a trailing partial block has none)."""
    keys, previous = [], b""
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        previous = _hash(previous, tokens[start : start + BLOCK_TOKENS])
        keys.append(int.from_bytes(previous, "little"))
    return keys


def end_key(tokens: list[int], keys: list[int] | None = None) -> int:
    """The key of an end state holding exactly `tokens`: the chain key of their whole blocks (`keys`, when known)
    hashed with the tokens after them, so a lookup at any length costs one block's hashing."""
    keys = block_keys(tokens) if keys is None else keys
    whole = len(tokens) // BLOCK_TOKENS
    chain = keys[whole - 1].to_bytes(8, "little") if whole else b""
    return int.from_bytes(_hash(b"end" + chain, tokens[whole * BLOCK_TOKENS :]), "little")


def _hash(previous: bytes, tokens: list[int]) -> bytes:
    block = torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(previous + block, digest_size=8).digest()


@dataclass
class EndState:
    """A sequence's whole cache row as it left the batch: per layer its positions' tensors (the last `tokens` a
    layer holds, a sliding window's last window - 1) and its positionless states (one row each)."""

    tokens: int
    positions: list[dict[str, torch.Tensor]]
    states: list[dict[str, dict[int, torch.Tensor]]]
    cost: int
    """Blocks it counts for in the store's size (rank 0 measured it: the same on every rank)."""


class PrefixStore:
    """One rank's kept blocks: key -> per layer {attribute: that block's tensor of one row} (keys and values are
    (heads, BLOCK_TOKENS, head_dim), an indexer's keys (BLOCK_TOKENS, index_head_dim)), or key -> the number of the
    pool block that holds it (kept from a paged batch)."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, int | list[dict[str, torch.Tensor]]] = OrderedDict()
        self.pool = BlockPool()
        """The model's paged layers' blocks on this rank (the batch's paged cache takes them from here)."""
        self.ends: OrderedDict[int, EndState] = OrderedDict()
        """End states, for a model whose cache cannot be cut into blocks (a model keeps one kind or the other)."""
        self._end_cost = 0
        self.stats = {"stored_blocks": 0, "evictions": 0, "shared_blocks": 0}

    @property
    def size(self) -> int:
        """Blocks held, an end state counting its cost."""
        return len(self.blocks) + self._end_cost

    def cached_blocks(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, are kept (rank 0, as it plans; touches nothing)."""
        count = 0
        while count < len(keys) and keys[count] in self.blocks:
            count += 1
        return count

    def seed(self, cache: Any, keys: list[int], share: bool = False) -> list[int]:
        """Fill the empty one-row `cache` with the blocks of `keys`, in order, through the layers' own updates (the
        prompt's prefill attends to them). With `share` (the batch is paged), the pool blocks that hold them, now
        held for the prompt's row too, when the pool holds every one of them (else none: the row copies them)."""
        self._touch(keys)
        for i, layer in enumerate(cache.layers):
            parts = [self.block_parts(key, i) for key in keys]
            _fill_positions(
                layer,
                {
                    name: torch.cat([part[name] for part in parts], dim=_row_seq_dim(row_dim, seq_dim)).unsqueeze(
                        row_dim
                    )
                    for name, row_dim, seq_dim in _stored_fields(layer, parts[0])
                },
            )
        blocks = [self.blocks[key] for key in keys]
        if not share or not all(isinstance(block, int) for block in blocks):
            return []
        self.pool.hold(blocks)
        self.stats["shared_blocks"] += len(blocks)
        return blocks

    def block_parts(self, key: int, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s tensors of the kept block `key` (a pool block's are views of the pool)."""
        entry = self.blocks[key]
        if not isinstance(entry, int):
            return entry[layer]
        return self.pool.block_parts(layer, entry)

    def keep(self, cache: Any, row: int, tokens: int, keys: list[int]) -> None:
        """Keep the blocks of `keys` of the batch's `row`, which holds `tokens` tokens (its last positions, the
        first block first): each block not kept yet held in the pool (a paged cache) or copied (the batch's cache
        is dropped or rewritten later), a touch of the others."""
        table = block_table(cache)
        if table is not None:
            self._hold(table.blocks[row], keys)
            return
        new = [i for i, key in enumerate(keys) if key not in self.blocks]
        if new:
            rows = [
                {
                    name: (row_positions(layer, name, row_dim, row), _row_seq_dim(row_dim, seq_dim))
                    for name, row_dim, seq_dim in position_fields(layer)
                }
                for layer in cache.layers
            ]
        for i in new:
            self.blocks[keys[i]] = [
                {
                    name: tensor.narrow(dim, tensor.shape[dim] - tokens + i * BLOCK_TOKENS, BLOCK_TOKENS).clone()
                    for name, (tensor, dim) in layer.items()
                }
                for layer in rows
            ]
            self.stats["stored_blocks"] += 1
        self._touch(keys)

    def _hold(self, blocks: list[int], keys: list[int]) -> None:
        """Keep a paged row's first blocks, `blocks`, as `keys` (a kept key's block stays the one kept first)."""
        for key, block in zip(keys, blocks):
            if key not in self.blocks:
                self.blocks[key] = block
                self.pool.hold([block])
                self.stats["stored_blocks"] += 1
        self._touch(keys)

    def end_hit(self, tokens: list[int]) -> tuple[int, int | None]:
        """The longest kept end state whose tokens start `tokens`: (its length, its key), or (0, None) (rank 0, as it
        plans; touches nothing)."""
        keys = block_keys(tokens)
        for length in sorted({end.tokens for end in self.ends.values() if end.tokens <= len(tokens)}, reverse=True):
            key = end_key(tokens[:length], keys[: length // BLOCK_TOKENS])
            if key in self.ends and self.ends[key].tokens == length:
                return length, key
        return 0, None

    def seed_end(self, cache: Any, key: int) -> int:
        """Make the empty one-row `cache` the end state `key` (a copy: the forwards after it write in place); the
        tokens it holds."""
        self.ends.move_to_end(key)
        end = self.ends[key]
        for layer, positions, states in zip(cache.layers, end.positions, end.states):
            _fill_positions(layer, {name: tensor.unsqueeze(0) for name, tensor in positions.items()})
            set_states(layer, states)
            set_length(layer, end.tokens)
        return end.tokens

    def keep_end(self, cache: Any, row: int, tokens: int, key: int, cost: int) -> None:
        """Keep a copy of the batch's `row`, which holds `tokens` tokens, as the end state `key` (a touch when kept
        already)."""
        if key not in self.ends:
            positions, states = _row_copy(cache, row, tokens)
            self.ends[key] = EndState(tokens, positions, states, cost)
            self._end_cost += cost
            self.stats["stored_blocks"] += cost
        self.ends.move_to_end(key)

    def trim(self, size: int) -> None:
        """Evict the least recently used blocks (end states) beyond `size`."""
        while self.size > size:
            if self.blocks:
                entry = self.blocks.popitem(last=False)[1]
                if isinstance(entry, int):
                    self.pool.release([entry])
                evicted = 1
            else:
                evicted = self.ends.popitem(last=False)[1].cost
                self._end_cost -= evicted
            self.stats["evictions"] += evicted

    def forget_rows(self) -> None:
        """No batch runs: the pool's blocks are held by the store alone (a batch that stopped on an error may not
        have given its rows' blocks back)."""
        self.pool.forget_rows({entry for entry in self.blocks.values() if isinstance(entry, int)})

    def shrink_pool(self) -> None:
        """After a batch: a pool more than half free shrinks to the blocks kept here (`BlockPool.shrink`)."""
        self.forget_rows()
        kept = {key: entry for key, entry in self.blocks.items() if isinstance(entry, int)}
        moved = self.pool.shrink(list(kept.values()))
        for key, entry in kept.items():
            self.blocks[key] = moved.get(entry, entry)

    def _touch(self, keys: list[int]) -> None:
        for key in reversed(keys):  # the chain's first block ends most recently used
            self.blocks.move_to_end(key)


def prefix_store(model: Any) -> PrefixStore:
    """This rank's store for `model` (it outlives each batch command; a reloaded model starts empty)."""
    if model not in _STORES:
        _STORES[model] = PrefixStore()
    return _STORES[model]


_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reuse_kind(model: Any) -> str | None:
    """How `model`'s prompts reuse kept caches: "blocks" (every layer holds every position), "ends" (some layer
    holds a sliding window or a linear-attention state; logged once per model) or None (a layer kind the batch has
    no row operations for)."""
    from transformers import DynamicCache

    if model not in _KINDS:
        cache = DynamicCache(config=model.config)
        kinds = {layer_kind(layer) for layer in cache.layers}
        batchable = layer_refusal(cache) is None  # an end state copies a row as the batch's row operations do
        _KINDS[model] = "blocks" if kinds <= set(_BLOCK_KINDS) else "ends" if batchable else None
        if _KINDS[model] == "ends":
            logger.warning(
                "prefix reuse for this model continues kept sequences only: its cache has %s layers, which cannot "
                "be cut into blocks, so a prompt reuses a kept prompt's or sequence's whole cache when it starts "
                "with all its tokens (a conversation's next turn), and prompts that share only a beginning share "
                "nothing",
                ", ".join(sorted(kinds - set(_BLOCK_KINDS))),
            )
    return _KINDS[model]


def end_cost(cache: Any, row: int, tokens: int) -> int:
    """The blocks an end state of the batch's `row` counts for: the bytes it would copy over the bytes of a block of
    every layer's positions (rank 0 measures it for every rank)."""
    positions, states = _row_copy(cache, row, tokens, measure_only=True)
    held = sum(t.numel() * t.element_size() for layer in positions for t in layer.values())
    held += sum(t.numel() * t.element_size() for layer in states for kind in layer.values() for t in kind.values())
    per_position = sum(
        t.numel() // max(1, t.shape[_row_seq_dim(row_dim, seq_dim)]) * t.element_size()
        for layer in cache.layers
        for name, row_dim, seq_dim in position_fields(layer)
        for t in (row_positions(layer, name, row_dim, row),)
    )
    return max(1, -(-held // max(1, per_position * BLOCK_TOKENS)))


_BLOCK_KINDS = ("DynamicLayer", "DynamicIndexedLayer")
"""Cache layer kinds whose every position's tensors the store keeps (full attention, with or without an indexer)."""


def _row_copy(
    cache: Any, row: int, tokens: int, measure_only: bool = False
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, dict[int, torch.Tensor]]]]:
    """The batch's `row` (its real tokens are its last `tokens` columns): per layer, its positions' tensors (the last
    it holds of those) and its states; views when `measure_only`, else copies."""
    positions, states = [], []
    for layer in cache.layers:
        fields = {}
        for name, row_dim, seq_dim in position_fields(layer):
            tensor = row_positions(layer, name, row_dim, row)
            dim = _row_seq_dim(row_dim, seq_dim)
            held = min(tokens, tensor.shape[dim])
            tensor = tensor.narrow(dim, tensor.shape[dim] - held, held)
            fields[name] = tensor if measure_only else tensor.clone()
        positions.append(fields)
        states.append(row_states(layer, row, copy=not measure_only))
    return positions, states


def _fill_positions(layer: Any, parts: dict[str, torch.Tensor]) -> None:
    """Give an empty layer its positions' tensors `parts` (one row each) through its own updates."""
    if not parts:
        return
    layer.update(parts.pop("keys"), parts.pop("values"))
    if "indexer_keys" in parts:
        layer.update_indexer(parts.pop("indexer_keys"))
    for name, tensor in parts.items():
        setattr(layer, name, tensor)


def _row_seq_dim(row_dim: int, seq_dim: int) -> int:
    """The sequence dim of a field once its row dim is taken out."""
    return seq_dim - 1 if seq_dim > row_dim else seq_dim


def _stored_fields(layer: Any, stored: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """The (attribute, row dim, sequence dim) of each tensor a kept block holds for a layer of `layer`'s kind."""
    return [field for field in grown_fields(layer) if field[0] in stored]


_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
