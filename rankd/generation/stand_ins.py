"""Stand-ins for keys and values, handed from a cache layer or an attention module to the batch's attention entry.

A paged layer's keys are in blocks and MLA's are latents not yet expanded: neither is the padded tensor
transformers' forward passes on to attention. Such a producer returns stand-ins of the expected shape that own no
memory (a zero expanded), registered with what they stand for; the batch's `sdpa` entry takes them back by
identity. A forward that changed them on the way (a family's own step between the cache and attention) would let
attention read zeros, so a stand-in never taken fails the step, with the producer's error naming its switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch


def stand_in(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A tensor of `shape` and `like`'s dtype and device that owns no memory (one zero, expanded)."""
    return like.new_zeros(()).expand(*shape)


class StandIns:
    """One producer's stand-ins handed and not yet taken, inside `expected`."""

    def __init__(self, name: str) -> None:
        self._pending: ContextVar[dict | None] = ContextVar(name, default=None)

    @contextlib.contextmanager
    def expected(self, untaken: str) -> Iterator[None]:
        """The forwards inside may hand stand-ins; raise RuntimeError(`untaken`) at the end if one was not taken."""
        pending: dict = {}
        token = self._pending.set(pending)
        try:
            yield
        finally:
            self._pending.reset(token)
        if pending:
            raise RuntimeError(untaken)

    def active(self) -> bool:
        return self._pending.get() is not None

    def hand(self, key: torch.Tensor, value: torch.Tensor, source: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Register `key` and `value` as stand-ins for `source` (inside `expected`); they are returned."""
        self._pending.get()[id(key)] = (key, value, source)
        return key, value

    def take(self, key: torch.Tensor, value: torch.Tensor) -> Any:
        """What `key` and `value` stand for (taken), or None when they are not this producer's stand-ins."""
        pending = self._pending.get()
        entry = None if pending is None else pending.get(id(key))
        if entry is None or entry[0] is not key or entry[1] is not value:
            return None
        del pending[id(key)]
        return entry[2]
