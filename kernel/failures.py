"""A command's per-rank failures, grouped: the same failure on several ranks counts once.

Shared by the magics (which render a RankError) and the terminal chat (which prints one line).
"""

from __future__ import annotations

from typing import Any

from .pool import Outcome


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


def group_errors(errors: dict[int, dict[str, Any]]) -> list[tuple[list[int], dict[str, Any]]]:
    """Group per-rank errors by (exception name, message), ranks ascending."""
    groups: dict[tuple[str, str], tuple[list[int], dict[str, Any]]] = {}
    for rank in sorted(errors):
        error = errors[rank]
        key = (error.get("ename", "?"), error.get("evalue", ""))
        groups.setdefault(key, ([], error))[0].append(rank)
    return list(groups.values())


def ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def describe_failures(outcome: Outcome) -> str:
    """One line: each distinct failure once, with the ranks it happened on ('' when none failed)."""
    groups = group_errors(outcome_errors(outcome))
    return "; ".join(f"{ranks_label(ranks)}: {e.get('ename')}: {e.get('evalue')}" for ranks, e in groups)
