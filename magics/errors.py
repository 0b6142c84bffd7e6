"""Turning a command's per-rank failures into one error for the cell.

The same failure on several ranks is shown once with the list of ranks; different failures are
shown per rank, the first few with their full traceback (ipyparallel's CompositeError idea).
The cell's reply is an error whenever any rank failed, died, timed out or did not stop.
"""

from __future__ import annotations

from typing import Any

from shardbook.kernel.ranks.failures import describe_failures, group_errors, outcome_errors, ranks_label, restart_hint
from shardbook.kernel.ranks.pool import Outcome

MAX_FULL_TRACEBACKS = 3


class RankError(Exception):
    """One or more ranks failed while running a cell; ``groups`` pairs rank lists with errors."""

    def __init__(self, groups: list[tuple[list[int], dict[str, Any]]], summary: str):
        super().__init__(summary)
        self.groups = groups
        self.summary = summary


def raise_for_outcome(outcome: Outcome) -> None:
    errors = outcome_errors(outcome)
    if errors:
        raise RankError(group_errors(errors), describe_failures(outcome))


def render(error: RankError) -> list[str]:
    """The structured traceback shown for a RankError: a header per group, a few full tracebacks."""
    lines = [f"RankError: {sum(len(r) for r, _ in error.groups)} rank(s) failed"]
    for i, (ranks, e) in enumerate(error.groups):
        lines.append(f"\n---- {ranks_label(ranks)}: {e.get('ename')}: {e.get('evalue')}")
        if i < MAX_FULL_TRACEBACKS and e.get("traceback"):
            lines.extend(e["traceback"])
    hidden = len(error.groups) - MAX_FULL_TRACEBACKS
    if hidden > 0:
        lines.append(f"\n({hidden} more distinct error(s) shown without traceback)")
    hint = restart_hint({ranks[0]: e for ranks, e in error.groups})
    if hint:
        lines.append(f"\n{hint}")
    return lines


def show_rank_error(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython custom-exception handler for RankError (registered with ``set_custom_exc``)."""
    stb = render(value)
    shell._showtraceback(etype, value, stb)
    return stb
