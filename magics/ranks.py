"""Parsing rank specifications such as ``1``, ``0,2`` or ``1-3`` for ``%%rank``."""

from __future__ import annotations

from IPython.core.error import UsageError


def parse_rank_spec(spec: str, world_size: int) -> list[int]:
    """Sorted, unique ranks named by ``spec``; a UsageError that states the world size otherwise."""
    ranks: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            raise UsageError(_bad(spec, world_size, "an empty item"))
        ranks.update(_parse_part(part, spec, world_size))
    outside = sorted(r for r in ranks if r >= world_size)
    if outside:
        raise UsageError(
            f"rank{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside))} outside the world: this kernel "
            f"has {world_size} rank{'s' if world_size != 1 else ''} (0-{world_size - 1})"
        )
    return sorted(ranks)


def _parse_part(part: str, spec: str, world_size: int) -> range:
    bounds = part.split("-")
    if len(bounds) > 2 or not all(b.isdigit() for b in bounds):
        raise UsageError(_bad(spec, world_size, repr(part)))
    low, high = int(bounds[0]), int(bounds[-1])
    if high < low:
        raise UsageError(_bad(spec, world_size, f"the descending range {part!r}"))
    return range(low, high + 1)


def _bad(spec: str, world_size: int, what: str) -> str:
    return (
        f"bad rank spec {spec!r} ({what}): use a rank (1), a list (0,2) or a range (1-3); "
        f"this kernel has {world_size} rank{'s' if world_size != 1 else ''} (0-{world_size - 1})"
    )
