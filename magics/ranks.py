"""Parsing rank specifications such as ``1``, ``0,2`` or ``1-3`` for ``%%rank``.

Every bound is checked against the world size before a range is expanded, and an error quotes
at most a short prefix of the spec, so a spec like ``0-10000000`` costs nothing to refuse.
"""

from __future__ import annotations

from IPython.core.error import UsageError

MAX_DIGITS = 9
"""Longest rank number accepted: no job has a billion ranks, and int() of longer text is slow."""
QUOTED_CHARS = 40


def parse_rank_spec(spec: str, world_size: int) -> list[int]:
    """Sorted, unique ranks named by ``spec``; a UsageError that states the world size otherwise."""
    ranks: set[int] = set()
    outside: list[str] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            raise UsageError(_bad(spec, world_size, "an empty item"))
        low, high = _bounds(part, spec, world_size)
        if high >= world_size:
            outside.append(str(high) if low == high else f"{max(low, world_size)}-{high}")
        else:
            ranks.update(range(low, high + 1))
    if outside:
        plural = len(outside) > 1 or "-" in outside[0]
        raise UsageError(
            f"rank{'s' if plural else ''} {_quote(', '.join(outside))} outside the world: this kernel "
            f"has {_world(world_size)}"
        )
    return sorted(ranks)


def _bounds(part: str, spec: str, world_size: int) -> tuple[int, int]:
    bounds = part.split("-")
    if len(bounds) > 2 or not all(b.isdigit() and b.isascii() for b in bounds):
        raise UsageError(_bad(spec, world_size, repr(_quote(part))))
    if any(len(b) > MAX_DIGITS for b in bounds):
        raise UsageError(_bad(spec, world_size, f"a rank number longer than {MAX_DIGITS} digits"))
    low, high = int(bounds[0]), int(bounds[-1])
    if high < low:
        raise UsageError(_bad(spec, world_size, f"the descending range {_quote(part)!r}"))
    return low, high


def _quote(text: str) -> str:
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + f"... ({len(text)} characters)"


def _world(world_size: int) -> str:
    return f"{world_size} rank{'s' if world_size != 1 else ''} (0-{world_size - 1})"


def _bad(spec: str, world_size: int, what: str) -> str:
    return (
        f"bad rank spec {_quote(spec)!r} ({what}): use a rank (1), a list (0,2) or a range (1-3); "
        f"this kernel has {_world(world_size)}"
    )
