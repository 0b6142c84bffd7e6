"""What a forward needs to know of the interventions on a model: which are set, which rows of a batched forward
they apply to, and whether one failed.

The hooks and the user's functions live in :mod:`shardbook.rankd.inspection.interventions`, a layer above; the
generation loop (the single reply and the continuous batch's steps) only names the rows and collects failures, so
this state sits here, below both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

REGISTRY_ATTRIBUTE = "shardbook_interventions"
ROWS_ATTRIBUTE = "shardbook_intervened_rows"


@dataclass
class Intervention:
    """One registered function: where it applies, its hooks, and its first failure since the last check."""

    name: str
    modules: list[str]
    on_input: bool
    handles: list[Any] = field(default_factory=list)
    failure: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "modules": self.modules, "on": "input" if self.on_input else "output"}


@dataclass(frozen=True)
class Rows:
    """The rows of one batched forward that the interventions apply to (the continuous batch names them)."""

    rows: tuple[int, ...]
    batch: int
    """Rows in the forward."""
    tokens: int
    """Tokens each row feeds in the forward (left-padded to the longest)."""
    start: int = 0
    """The first column where one of `rows` has a real token: the padding before it is cut from their slice."""


def registry(model: nn.Module) -> dict[str, Intervention]:
    """The interventions on `model` by name (kept on the model: a new model starts with none)."""
    if not hasattr(model, REGISTRY_ATTRIBUTE):
        object.__setattr__(model, REGISTRY_ATTRIBUTE, {})
    return getattr(model, REGISTRY_ATTRIBUTE)


def take_failure(model: nn.Module) -> str | None:
    """The first failure of any intervention since the last call, or None (and forget them: the functions run
    again from the next forward on)."""
    failed = [iv for iv in registry(model).values() if iv.failure]
    for iv in failed:
        iv.failure, text = None, iv.failure
    return text if failed else None


@contextlib.contextmanager
def applied_to(model: nn.Module, rows: Rows) -> Iterator[None]:
    """Within the block (one batched forward), the interventions apply to `rows` only."""
    selected = row_selection(model)
    selected[0] = rows
    try:
        yield
    finally:
        selected[0] = None


def row_selection(model: nn.Module) -> list[Rows | None]:
    """The model's current row selection, in a box the hooks hold (None: every row, as outside the batch)."""
    if not hasattr(model, ROWS_ATTRIBUTE):
        object.__setattr__(model, ROWS_ATTRIBUTE, [None])
    return getattr(model, ROWS_ATTRIBUTE)
