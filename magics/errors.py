"""Turning a command's per-rank failures into one error for the cell.

The same failure on several ranks is shown once with the list of ranks; different failures are
shown per rank, the first few with their full traceback (ipyparallel's CompositeError idea).
The cell's reply is an error whenever any rank failed, died, timed out or did not stop.
"""

from __future__ import annotations

from typing import Any

from shardbook.kernel.pool import Outcome

MAX_FULL_TRACEBACKS = 3


class RankError(Exception):
    """One or more ranks failed while running a cell; ``groups`` pairs rank lists with errors."""

    def __init__(self, groups: list[tuple[list[int], dict[str, Any]]], summary: str):
        super().__init__(summary)
        self.groups = groups
        self.summary = summary


def group_errors(errors: dict[int, dict[str, Any]]) -> list[tuple[list[int], dict[str, Any]]]:
    """Group per-rank errors by (exception name, message), ranks ascending."""
    groups: dict[tuple[str, str], tuple[list[int], dict[str, Any]]] = {}
    for rank in sorted(errors):
        error = errors[rank]
        key = (error.get("ename", "?"), error.get("evalue", ""))
        groups.setdefault(key, ([], error))[0].append(rank)
    return list(groups.values())


def outcome_errors(outcome: Outcome) -> dict[int, dict[str, Any]]:
    """Every rank's failure: its reported error, or why it never finished."""
    errors = {
        rank: reply.get("error") or {"ename": "RankFailed", "evalue": f"status {reply.get('status')}", "traceback": []}
        for rank, reply in outcome.replies.items()
        if reply.get("status") != "ok"
    }
    why = "timed out" if outcome.timed_out else "did not stop after the interrupt"
    for rank in outcome.stuck:
        errors[rank] = {"ename": "RankStuck", "evalue": f"{why}; still busy (see %dist)", "traceback": []}
    return errors


def raise_for_outcome(outcome: Outcome) -> None:
    errors = outcome_errors(outcome)
    if not errors:
        return
    groups = group_errors(errors)
    parts = [f"{_ranks_label(ranks)}: {e.get('ename')}: {e.get('evalue')}" for ranks, e in groups]
    raise RankError(groups, "; ".join(parts))


def render(error: RankError) -> list[str]:
    """The structured traceback shown for a RankError: a header per group, a few full tracebacks."""
    lines = [f"RankError: {sum(len(r) for r, _ in error.groups)} rank(s) failed"]
    for i, (ranks, e) in enumerate(error.groups):
        lines.append(f"\n---- {_ranks_label(ranks)}: {e.get('ename')}: {e.get('evalue')}")
        if i < MAX_FULL_TRACEBACKS and e.get("traceback"):
            lines.extend(e["traceback"])
    hidden = len(error.groups) - MAX_FULL_TRACEBACKS
    if hidden > 0:
        lines.append(f"\n({hidden} more distinct error(s) shown without traceback)")
    return lines


def show_rank_error(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython custom-exception handler for RankError (registered with ``set_custom_exc``)."""
    stb = render(value)
    shell._showtraceback(etype, value, stb)
    return stb


def _ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
