"""One model's cache blocks on one rank: every paged layer's key and value pools, and who holds each block.

A block's holders are the rows of the running batch whose positions it holds and the prefix store when it keeps
the block for later prompts (`prefix_store`). A prompt that starts with kept blocks takes them as its row's first
blocks, holding them too, rather than copying them (`paged_layers`): a kept block is always full and a row only
writes past its own length, so a shared block is never written again. A block no one holds is free.

The pool outlives each batch (the prefix store, which owns it, does): its blocks are numbered per rank, and the
ranks need not agree on the numbers (the plans name kept blocks by their prefix keys). At a batch's start nothing
but the store holds a block (`forget_rows`: rows an aborted batch never gave back are free again); at its end a
pool more than half free shrinks to the blocks the store keeps (`shrink`), so an idle model holds about what it
keeps and no more.
"""

from __future__ import annotations

import torch

from shardbook.rankd.generation.growing_layers import ROOM_SHARE

PAGE_TOKENS = 16
"""Positions per block (a multiple of 4, the kernel's step through keys; the prefix store's block size)."""
MIN_BLOCKS = 64
"""Blocks a pool grows by at least."""


class BlockPool:
    """The blocks of one model's paged layers on one rank (each layer's pools by its index in the cache)."""

    def __init__(self) -> None:
        self.pools: dict[str, dict[int, torch.Tensor]] = {}
        """Per tensor a paged layer holds per position ("keys", "values", a sparse-attention indexer's
        "indexer_keys"), per paged layer, (blocks, heads, PAGE_TOKENS, size), laid out head by head (`empty_pool`;
        an indexer's keys, which have no heads, as one head)."""
        self.holders: list[int] = []
        """Per block, how many rows and stores hold it."""
        self.free: list[int] = []
        """Blocks no one holds, the next taken last."""

    @property
    def capacity(self) -> int:
        """Blocks in each layer's pools (grown by `take`; a layer grows its pools to it as it writes, `fit`)."""
        return len(self.holders)

    def take(self, count: int) -> list[int]:
        """`count` free blocks, now held once (the pools grow by an eighth, at least MIN_BLOCKS, when used up)."""
        if len(self.free) < count:
            more = max(count - len(self.free), self.capacity // ROOM_SHARE, MIN_BLOCKS)
            self.free += range(self.capacity + more - 1, self.capacity - 1, -1)  # the lowest numbers taken first
            self.holders += [0] * more
        taken, self.free = self.free[len(self.free) - count :], self.free[: len(self.free) - count]
        self.hold(taken)
        return taken[::-1]

    def hold(self, blocks: list[int]) -> None:
        for block in blocks:
            self.holders[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; those no one holds now are free."""
        for block in blocks:
            self.holders[block] -= 1
            assert self.holders[block] >= 0, f"block {block} released more often than held"
            if not self.holders[block]:
                self.free.append(block)

    def forget_rows(self, kept: set[int]) -> None:
        """Only the blocks `kept` (the store's) are held, once each: no batch runs, so no row holds any."""
        self.holders = [int(block in kept) for block in range(self.capacity)]
        self.free = [block for block in reversed(range(self.capacity)) if block not in kept]

    def shrink(self, kept: list[int]) -> dict[int, int]:
        """When no row holds a block and more than half the pool is free: copy the blocks `kept` (the store's) into
        pools just their size; each kept block's new number (empty when the pool stays as it is)."""
        if len(self.free) * 2 <= self.capacity:
            return {}
        index = torch.tensor(kept, dtype=torch.int64)
        for pools in self.pools.values():
            for layer, pool in pools.items():
                pools[layer] = empty_pool(pool, len(kept))
                pools[layer][:] = pool[index]
        self.holders, self.free = [1] * len(kept), []
        return {old: new for new, old in enumerate(kept)}

    def fit(self, layer: int, likes: dict[str, torch.Tensor]) -> None:
        """Give paged layer `layer` pools of `capacity` blocks for each tensor of `likes` (as the layer holds it
        left-padded: (rows, heads, positions, size), or (rows, positions, size) for HEADLESS ones): new ones shaped
        after it, or its pools grown (a copy, only when `take` took more blocks)."""
        for name, like in likes.items():
            pools, like = self.pools.setdefault(name, {}), pool_layout(name, like)
            pool = pools.get(layer)
            if pool is None:
                pools[layer] = empty_pool(like, self.capacity)
            elif pool.shape[0] < self.capacity:
                grown = empty_pool(pool, self.capacity)
                grown[: pool.shape[0]] = pool
                pools[layer] = grown

    def block_parts(self, layer: int, block: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s tensors of `block`, each as one row of the left-padded layout holds it ((heads,
        PAGE_TOKENS, size), or (PAGE_TOKENS, size) for HEADLESS ones): views of the pools."""
        parts = {name: pools[layer][block] for name, pools in self.pools.items() if layer in pools}
        return {name: part[0] if name in HEADLESS else part for name, part in parts.items()}


HEADLESS = ("indexer_keys",)
"""Tensors with one vector per position and row, no heads ((rows, positions, size)): pools hold them as one head."""


def pool_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (rows, ..., positions, size) as its pool lays out a row: with a head dim (one) when it has none."""
    return tensor.unsqueeze(1) if name in HEADLESS else tensor


def empty_pool(like: torch.Tensor, blocks: int) -> torch.Tensor:
    """(blocks, kv heads, PAGE_TOKENS, head size) of `like`'s kv heads (dim 1), size (dim 3), dtype and device, laid
    out head by head: a row's blocks, taken in order, are then one stream of memory per head, as the CPU's prefetch
    wants (block by block, one head's 16 positions are 4 KB out of every 12 KB of the demo model's pool, and a
    decode step's attention took 1.7x the time)."""
    return like.new_empty(like.shape[1], blocks, PAGE_TOKENS, like.shape[3]).transpose(0, 1)
