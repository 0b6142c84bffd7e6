"""How the tensor-parallel layout divides heads, MLP rows and the vocabulary among the ranks of a group.

Pure arithmetic, the same on every rank, so each rank knows every rank's share without asking.
Splits may be uneven: the demo model has 9 query heads and 3 key/value heads, which no even
split over 2 ranks can serve. Attention is split along key/value-head groups when there are at
least as many KV heads as ranks (each rank keeps whole groups: its KV heads and the query heads
that read them); with fewer KV heads than ranks the query heads are split and each rank keeps
the KV heads its query heads read. The MLP rows then even out the per-rank weight bytes, so the
rank with more heads gets fewer MLP rows and no rank waits for the other at every reduction.
"""

from __future__ import annotations

from dataclasses import dataclass


def balanced_ranges(total: int, parts: int) -> list[range]:
    """`total` items in `parts` contiguous ranges whose sizes differ by at most one, the larger first."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class HeadShare:
    """One rank's attention heads: which query heads, which KV heads (in the order it stores them)."""

    query_heads: range
    kv_heads: tuple[int, ...]
    """KV heads this rank stores, ascending; query head `q` (local index i) reads `kv_heads[i // groups]`."""

    @property
    def groups(self) -> int:
        """Query heads per stored KV head on this rank (the attention module's `num_key_value_groups`)."""
        return len(self.query_heads) // len(self.kv_heads)


def split_heads(num_heads: int, num_kv_heads: int, parts: int) -> list[HeadShare]:
    """Every rank's `HeadShare`; each rank gets at least one query head."""
    if num_heads < parts:
        raise ValueError(
            f"the model has {num_heads} attention heads, fewer than the {parts} ranks of the tensor-parallel "
            f"group: use parallel.decode gather or reshard, or a parallel.fsdp_size of at most {num_heads}"
        )
    groups = num_heads // num_kv_heads
    if num_kv_heads >= parts:
        return [
            HeadShare(range(kv.start * groups, kv.stop * groups), tuple(kv))
            for kv in balanced_ranges(num_kv_heads, parts)
        ]
    return [_query_split_share(queries, groups) for queries in balanced_ranges(num_heads, parts)]


def _query_split_share(queries: range, groups: int) -> HeadShare:
    """The KV heads `queries` read: each once when they read them equally often, else one per query head."""
    readers = [q // groups for q in queries]
    distinct = sorted(set(readers))
    if all(readers.count(kv) == len(readers) // len(distinct) for kv in distinct):
        return HeadShare(queries, tuple(distinct))
    return HeadShare(queries, tuple(readers))


def split_mlp_rows(intermediate: int, attention_units: list[int], hidden: int) -> list[range]:
    """MLP rows per rank so that attention plus MLP weights come out as even as whole rows allow.

    `attention_units[r]` is the attention weight count rank r holds; one MLP row costs `3 * hidden`
    weights (gate, up and down). Every rank keeps at least one row.
    """
    parts = len(attention_units)
    row_cost = 3 * hidden
    target = (sum(attention_units) + intermediate * row_cost) / parts
    wanted = [max(1.0, (target - units) / row_cost) for units in attention_units]
    scale = intermediate / sum(wanted)
    sizes = _round_preserving_sum([w * scale for w in wanted], intermediate)
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _round_preserving_sum(values: list[float], total: int) -> list[int]:
    """Whole numbers (each at least 1) adding up to `total`, each within one of its value."""
    sizes = [max(1, int(v)) for v in values]
    order = sorted(range(len(values)), key=lambda i: values[i] - int(values[i]), reverse=True)
    i = 0
    while sum(sizes) < total:
        sizes[order[i % len(order)]] += 1
        i += 1
    while sum(sizes) > total:
        largest = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[largest] -= 1
    return sizes
