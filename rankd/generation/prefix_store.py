"""Prefix reuse: the keys and values of token blocks the batch computed before, kept on every rank for the next
prompt that starts with them (a conversation's next turn, a shared system prompt or document).

A prompt is cut into blocks of `BLOCK_TOKENS` tokens; block i's key hashes block i's tokens with block i-1's key
(a chain, as vLLM's prefix caching keys its blocks), so one key names a whole prefix. Each rank's
:class:`PrefixStore` (one per model) maps a key to every layer's per-position tensors for that block (keys and
values; a sparse-attention indexer's keys too), one row and no padding (under `tp`, this rank's own heads: nothing
crosses ranks). Only layers that hold every position of a prompt can be kept: full attention, MLA's latents and
GLM-5's and DeepSeek-V3.2's indexed layers. Each position's entries there depend on it and the tokens before it
alone, so kept blocks equal what a cold prefill computes. A sliding window or a recurrent state cannot be rebuilt
from blocks (`reuse_refusal`).

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
from typing import Any

import torch

from shardbook.rankd.generation.cache_rows import grown_fields, position_fields
from shardbook.rankd.generation.growing_layers import layer_kind

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16
"""Tokens per block: a prompt reuses the longest run of whole blocks it shares with a kept one."""


def block_keys(tokens: list[int]) -> list[int]:
    """The chain key of each whole block of `tokens` (a trailing partial block has none)."""
    keys, previous = [], b""
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = torch.tensor(tokens[start : start + BLOCK_TOKENS], dtype=torch.int64).numpy().tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        keys.append(int.from_bytes(previous, "little"))
    return keys


class PrefixStore:
    """One rank's kept blocks: key -> per layer {attribute: that block's tensor of one row} (keys and values are
    (heads, BLOCK_TOKENS, head_dim), an indexer's keys (BLOCK_TOKENS, index_head_dim))."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, list[dict[str, torch.Tensor]]] = OrderedDict()
        self.stats = {"stored_blocks": 0, "evictions": 0}

    def cached_blocks(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, are kept (rank 0, as it plans; touches nothing)."""
        count = 0
        while count < len(keys) and keys[count] in self.blocks:
            count += 1
        return count

    def seed(self, cache: Any, keys: list[int]) -> None:
        """Fill the empty one-row `cache` with the blocks of `keys`, in order, through the layers' own updates."""
        self._touch(keys)
        for i, layer in enumerate(cache.layers):
            parts = {
                name: torch.cat(
                    [self.blocks[key][i][name] for key in keys], dim=_row_seq_dim(row_dim, seq_dim)
                ).unsqueeze(row_dim)
                for name, row_dim, seq_dim in _stored_fields(layer, self.blocks[keys[0]][i])
            }
            layer.update(parts.pop("keys"), parts.pop("values"))
            if "indexer_keys" in parts:
                layer.update_indexer(parts.pop("indexer_keys"))
            for name, tensor in parts.items():
                setattr(layer, name, tensor)

    def keep(self, cache: Any, row: int, start: int, keys: list[int]) -> None:
        """Keep the blocks of `keys` of the batch's `row`, whose first block starts at column `start`: a copy of
        each block not kept yet (the batch's cache is dropped or rewritten later), a touch of the others."""
        for i, key in enumerate(keys):
            if key in self.blocks:
                continue
            first = start + i * BLOCK_TOKENS
            self.blocks[key] = [
                {
                    name: getattr(layer, name)
                    .select(row_dim, row)
                    .narrow(_row_seq_dim(row_dim, seq_dim), first, BLOCK_TOKENS)
                    .clone()
                    for name, row_dim, seq_dim in position_fields(layer)
                }
                for layer in cache.layers
            ]
            self.stats["stored_blocks"] += 1
        self._touch(keys)

    def trim(self, size: int) -> None:
        """Evict the least recently used blocks beyond `size`."""
        while len(self.blocks) > size:
            self.blocks.popitem(last=False)
            self.stats["evictions"] += 1

    def _touch(self, keys: list[int]) -> None:
        for key in reversed(keys):  # the chain's first block ends most recently used
            self.blocks.move_to_end(key)


def prefix_store(model: Any) -> PrefixStore:
    """This rank's store for `model` (it outlives each batch command; a reloaded model starts empty)."""
    if model not in _STORES:
        _STORES[model] = PrefixStore()
    return _STORES[model]


_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reuse_refusal(model: Any) -> str | None:
    """Why `model`'s prompts cannot reuse kept blocks (a layer kind that does not hold every position: a sliding
    window, a recurrent state), or None; logged once per model."""
    from transformers import DynamicCache

    if model not in _REFUSALS:
        layers = DynamicCache(config=model.config).layers
        kinds = sorted({layer_kind(layer) for layer in layers} - set(_KEPT_KINDS))
        _REFUSALS[model] = f"its cache has {', '.join(kinds)} layers" if kinds else None
        if kinds:
            logger.warning(
                "prefix reuse is off for this model: %s (only layers that hold every position are kept)",
                _REFUSALS[model],
            )
    return _REFUSALS[model]


_KEPT_KINDS = ("DynamicLayer", "DynamicIndexedLayer")
"""Cache layer kinds whose every position's tensors the store keeps (full attention, with or without an indexer)."""


def _row_seq_dim(row_dim: int, seq_dim: int) -> int:
    """The sequence dim of a field once its row dim is taken out."""
    return seq_dim - 1 if seq_dim > row_dim else seq_dim


def _stored_fields(layer: Any, stored: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """The (attribute, row dim, sequence dim) of each tensor a kept block holds for a layer of `layer`'s kind."""
    return [field for field in grown_fields(layer) if field[0] in stored]


_REFUSALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
